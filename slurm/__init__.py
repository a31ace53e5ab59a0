"""The Slurm job template and per-node launcher, shipped inside the package as moe_platform.slurm (pyproject.toml)."""
