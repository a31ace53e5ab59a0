"""One fp32 state dict of the whole model from any checkpoint: ZeRO shards, a universal copy, a plain model file,
expert shards by global id, an FSDP run's DCP shards. Nothing is opened before the checkpoint's files match their
manifest."""

from pathlib import Path

import torch

from moe_platform.checkpoint import manifest
from moe_platform.checkpoint.errors import CheckpointError
from moe_platform.checkpoint.experts import consolidated_experts
from moe_platform.checkpoint.layout import DCP, CheckpointLayout
from moe_platform.checkpoint.sharded import model_state_dict
from moe_platform.checkpoint.universal import DEEPSPEED_TAG, state_dict_from_universal


def verify_checkpoint(checkpoint: Path) -> None:
    """In one process: every file of `checkpoint` present, at its size and checksum, its pickles safe."""
    try:
        names = sorted(manifest.check_files(checkpoint)["files"])
    except manifest.ManifestError as err:
        raise CheckpointError(f"{checkpoint} cannot be used: {err}") from None
    problems = manifest.verify_share(checkpoint, names)
    if problems:
        raise CheckpointError(f"{checkpoint} cannot be used: {problems[0]}")


def export_fp32_state_dict(checkpoint: Path) -> dict[str, torch.Tensor]:
    """One fp32 state dict of the whole model, whether the checkpoint holds ZeRO shards, DCP shards (read whole in
    this process, no process group needed) or a plain model file."""
    checkpoint = Path(checkpoint)
    verify_checkpoint(checkpoint)
    layout = CheckpointLayout.read(checkpoint)
    zero_shards = (checkpoint / DEEPSPEED_TAG).is_dir()
    if layout.format == DCP:
        state = model_state_dict(checkpoint)
    elif zero_shards and layout.expert_parallel_size > 1:
        # Measured with deepspeed 0.19.8: zero_to_fp32 reads every rank's expert partition as one tensor's.
        state = state_dict_from_universal(checkpoint)
    elif zero_shards:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=DEEPSPEED_TAG)
    elif (checkpoint / "model.safetensors").is_file():
        from safetensors.torch import load_file

        state = load_file(str(checkpoint / "model.safetensors"))
    elif (checkpoint / "pytorch_model.bin").is_file():
        state = torch.load(checkpoint / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise CheckpointError(f"{checkpoint} holds neither ZeRO shards nor a model file: is it a checkpoint dir?")
    state.update(consolidated_experts(checkpoint))
    return {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in state.items()}
