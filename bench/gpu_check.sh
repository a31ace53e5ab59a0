#!/usr/bin/env bash
# The prepared GPU check (issue 27): install what the GPU machine lacks, run every CUDA test and the two GPU
# benches, print one table (bench/gpu_check.py). Fits in ~8 minutes on an H100/H200; exit 0 when nothing failed.
#
#   bench/gpu_check.sh                      # on a GPU machine whose image has a CUDA torch (2.4 … 2.13)
#   bench/gpu_check.sh --wheels DIR         # first install the project and its dependencies from DIR, offline
#   bench/gpu_check.sh --cpu-smoke          # the same steps on CPU in about a minute (tests/bench/test_gpu_check.py)
#
# The wheels: the GPU machine reaches no index, and its image lacks hydra, omegaconf, deepspeed, pydantic…
# On a machine with an index, what the image lacks, for its Python (3.12), ~33 MB: bench/gpu_wheels.sh .gpu-wheels
# then on the GPU machine (the device tool carrying .gpu-wheels): bench/gpu_check.sh --wheels .gpu-wheels
# Other flags go to bench/gpu_check.py (--out DIR, --pytest-args "-k ...").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
wheels="" smoke=() rest=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels="$2"; shift 2 ;;
    --cpu-smoke) smoke=(--cpu-smoke); shift ;;
    *) rest+=("$1"); shift ;;
  esac
done
if [ -n "$wheels" ]; then
  [ -d "$wheels" ] || { echo "gpu_check.sh: --wheels $wheels is not a directory: build it with bench/gpu_wheels.sh" >&2; exit 2; }
  # Without dependency resolution: the image's packages (torch, accelerate, numpy…) stay as they are, and the project's
  # pins of what it lacks are the carried versions (bench/gpu_wheels.sh checked their requirements against it).
  "$PYTHON" -m pip install --quiet --no-index --no-deps "$wheels"/*.whl
  "$PYTHON" -m pip install --quiet --no-index --no-deps --no-build-isolation -e .
fi
"$PYTHON" -c "import torch, hydra, moe_platform" 2>/dev/null || {
  echo "gpu_check.sh: $PYTHON lacks torch, hydra or the project: pass --wheels DIR (bench/gpu_wheels.sh builds it)" >&2
  exit 2
}
exec "$PYTHON" bench/gpu_check.py "${smoke[@]}" "${rest[@]}"
