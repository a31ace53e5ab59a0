#!/usr/bin/env bash
# Wheels for bench/gpu_check.sh --wheels on a GPU machine without an index: the project's dependencies (not torch:
# the image's CUDA build stays) and pytest, as binary wheels for that machine's Python on manylinux x86_64.
#   bench/gpu_wheels.sh 3.11 shared/wheels
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: bench/gpu_wheels.sh PYTHON_VERSION DIR}" dest="${2:?usage: bench/gpu_wheels.sh PYTHON_VERSION DIR}"
PYTHON=${PYTHON:-python3}
deps=$("$PYTHON" - <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print(" ".join(d for d in project["dependencies"] if not d.startswith("torch")))
PY
)
# shellcheck disable=SC2086
"$PYTHON" -m pip download --quiet --only-binary=:all: --python-version "$version" --platform manylinux_2_28_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --no-deps -d "$dest" setuptools wheel pytest $deps
"$PYTHON" -m pip download --quiet --only-binary=:all: --python-version "$version" --platform manylinux_2_28_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$dest" $deps pytest 2>&1 | grep -v "^$" || true
echo "wheels for Python $version in $dest: $(ls "$dest" | wc -l) files, $(du -sh "$dest" | cut -f1)"
