#!/usr/bin/env bash
# Wheels for bench/gpu_check.sh --wheels on a GPU machine without an index: every package of the environment the
# tests pass in here (pip freeze of $PYTHON), at the same versions, except torch and its CUDA/Triton pieces (the
# GPU image's CUDA torch stays). Run it with a Python of the GPU machine's minor version: the binary wheels
# (numpy, pyarrow, psutil…) are built for it, and packages published only as source (deepspeed) are built here.
#   PYTHON=.venv/bin/python bench/gpu_wheels.sh shared/wheels
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:?usage: bench/gpu_wheels.sh DIR}"
PYTHON=${PYTHON:-python3}
mapfile -t requirements < <("$PYTHON" -m pip freeze --all --exclude-editable | grep -viE "^(torch|triton|nvidia-|moe-platform|pip)[=_ -]" | grep -v '^-e ')
"$PYTHON" -m pip wheel --quiet --no-deps -w "$dest" "${requirements[@]}" 2> >(grep -v "^WARNING: Location" >&2)
echo "$(ls "$dest" | wc -l) wheels for $("$PYTHON" -c 'import sys; print(f"Python {sys.version_info[0]}.{sys.version_info[1]}")') in $dest ($(du -sh "$dest" | cut -f1))"
