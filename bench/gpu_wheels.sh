#!/usr/bin/env bash
# Wheels for bench/gpu_check.sh --wheels on the GPU machine, which reaches no index: only the packages a run and the
# GPU tests import that its image lacks (bench/gpu_image_packages.txt), at the versions the tests pass with here
# (pip freeze of $PYTHON), built for the image's Python (3.12, manylinux x86-64). The image's CUDA torch, numpy,
# accelerate and the rest stay. Everything that travels to that machine (working tree and carried paths) must stay
# under 64 MiB: this set is ~31 MB, where every package of the environment (the first version of this script) was
# 193 MB. Then it checks that every requirement of every carried wheel is carried or in the image.
#   bench/gpu_wheels.sh .gpu-wheels          # then on the device: carry .gpu-wheels, bench/gpu_check.sh --wheels .gpu-wheels
#   GPU_PYTHON_VERSION=3.11 bench/gpu_wheels.sh DIR   # for a rehearsal in a local 3.11 venv
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:?usage: bench/gpu_wheels.sh DIR}"
PYTHON=${PYTHON:-.venv/bin/python}
version=${GPU_PYTHON_VERSION:-3.12}
# What the runs of tests/gpu import beyond the image (read from sys.modules after moe-train with distributed=zero2,
# distributed=fsdp and bf16): DeepSpeed and its pydantic, Hydra, plotly (the report), and the transformers and
# huggingface_hub the tests pass with here; datasets for the data paths the GPU tests do not take but a user's would.
carry=(deepspeed hjson pydantic pydantic-core annotated-types typing-inspection hydra-core omegaconf
  antlr4-python3-runtime hydra-submitit-launcher submitit plotly dill sniffio truststore transformers huggingface-hub
  httpx2 httpcore2 kernels tomlkit datasets multiprocess)
mkdir -p "$dest"
freeze=$("$PYTHON" -m pip freeze --all)
pinned=()
for name in "${carry[@]}"; do
  pin=$(grep -iE "^${name//-/[-_.]}==" <<<"$freeze") || { echo "gpu_wheels.sh: $PYTHON has no $name installed" >&2; exit 2; }
  pinned+=("$pin")
done
binary=(--only-binary=:all: --python-version "$version" --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
quiet() { "$@" 2> >(grep -v "^WARNING: Location" >&2); }
for pin in "${pinned[@]}"; do
  # A published wheel for that Python, else (deepspeed and antlr4 publish source only) one built here: both are
  # pure Python, so a wheel built by this Python installs on the image's.
  if ! "$PYTHON" -m pip download --quiet --no-deps "${binary[@]}" -d "$dest" "$pin" 2>/dev/null; then
    quiet "$PYTHON" -m pip wheel --quiet --no-deps -w "$dest" "$pin"
  fi
done
"$PYTHON" - "$dest" "$version" bench/gpu_image_packages.txt <<'EOF'
"""Every requirement (for that Python, no extras) of every carried wheel is carried or in the image."""
import re, sys, zipfile
from pathlib import Path
from packaging.requirements import Requirement

def norm(name): return re.sub(r"[-_.]+", "-", name).lower()

dest, version, image_list = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
image = {norm(n) for line in image_list.read_text().splitlines() if not line.startswith("#") for n in line.split()}
wheels = sorted(dest.glob("*.whl"))
carried = {norm(w.name.split("-")[0]) for w in wheels}
environment = {"python_version": version, "python_full_version": f"{version}.0", "extra": ""}
missing = set()
for wheel in wheels:
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        for line in archive.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1].strip())
                if (req.marker is None or req.marker.evaluate(environment)) and norm(req.name) not in carried | image:
                    missing.add(f"{req.name} (for {wheel.name.split('-')[0]})")
if missing:
    sys.exit("gpu_wheels.sh: neither carried nor in the image: " + ", ".join(sorted(missing)))
EOF
echo "$(ls "$dest"/*.whl | wc -l) wheels for Python $version in $dest ($(du -sh "$dest" | cut -f1)), every requirement carried or in the image"
