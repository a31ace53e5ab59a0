"""`moe-export CHECKPOINT OUT.pt`: one consolidated fp32 state dict that loads into `moe.Transformer`.

ZeRO checkpoints hold each rank's shard of the flat fp32 master weights; DeepSpeed's zero_to_fp32 stitches them
back together. The checkpoint's config.yaml tells which model to build, so the result is checked by loading it
strictly before it is written.
"""

import argparse
from pathlib import Path

import torch

from moe import Transformer
from moe_platform.checkpoint import CheckpointError, export_fp32_state_dict
from moe_platform.config import TrainConfig, load_run_config


def load_checkpoint_config(checkpoint: Path) -> TrainConfig:
    """The validated run config saved beside a checkpoint's state."""
    config_path = Path(checkpoint) / "config.yaml"
    if not config_path.is_file():
        raise CheckpointError(f"{checkpoint} has no config.yaml: it is not a complete moe-platform checkpoint")
    return load_run_config(config_path)


def load_exported_model(checkpoint: Path) -> Transformer:
    """The model of a checkpoint with its consolidated fp32 weights (strict load: nothing missing or extra)."""
    model = Transformer(load_checkpoint_config(checkpoint).model)
    model.load_state_dict(export_fp32_state_dict(Path(checkpoint)), strict=True)
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="moe-export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoints/step_XXXXXXXX directory")
    parser.add_argument("output", type=Path, help="where to write the fp32 state dict (torch.save)")
    args = parser.parse_args(argv)
    model = load_exported_model(args.checkpoint)
    torch.save(model.state_dict(), args.output)
    print(f"wrote {args.output}: {sum(p.numel() for p in model.parameters()):,} parameters in fp32")


if __name__ == "__main__":
    main()
