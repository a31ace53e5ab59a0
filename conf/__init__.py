"""The Hydra config tree of moe-train, shipped inside the package as moe_platform.conf (see pyproject.toml)."""
