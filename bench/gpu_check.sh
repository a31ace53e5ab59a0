#!/usr/bin/env bash
# The prepared GPU check (issue 27): install what the GPU machine lacks, run every CUDA test and the two GPU
# benches, print one table (bench/gpu_check.py). Fits in ~8 minutes on an H100/H200; exit 0 when nothing failed.
#
#   bench/gpu_check.sh                      # on a GPU machine whose image has a CUDA torch (2.4 … 2.13)
#   bench/gpu_check.sh --wheels DIR         # first install the project and its dependencies from DIR, offline
#   bench/gpu_check.sh --cpu-smoke          # the same steps on CPU in about a minute (tests/bench/test_gpu_check.py)
#
# The wheels: the GPU machine reaches no index, and a bare image lacks hydra, omegaconf, datasets, deepspeed…
# On a machine with an index, for the GPU machine's Python (here 3.11) and without torch (the image's CUDA build
# stays):   PYTHON=.venv/bin/python bench/gpu_wheels.sh shared/wheels   then on the GPU machine: bench/gpu_check.sh --wheels shared/wheels
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
  "$PYTHON" -m pip install --quiet --no-index --find-links "$wheels" --no-build-isolation -e . pytest
fi
"$PYTHON" -c "import torch, hydra, moe_platform" 2>/dev/null || {
  echo "gpu_check.sh: $PYTHON lacks torch, hydra or the project: pass --wheels DIR (bench/gpu_wheels.sh builds it)" >&2
  exit 2
}
exec "$PYTHON" bench/gpu_check.py "${smoke[@]}" "${rest[@]}"
