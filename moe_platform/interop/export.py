"""`moe-export CHECKPOINT OUT`: the checkpoint's model as one fp32 state dict (default) or, with `--format hf`, as a
transformers model directory that `AutoModelForCausalLM.from_pretrained(OUT)` loads with no custom code.

ZeRO checkpoints hold each rank's shard of the flat fp32 master weights; DeepSpeed's zero_to_fp32 stitches them
back together. The checkpoint's config.yaml tells which model to build, so the result is checked by loading it
strictly before it is written. The HF format is exact or refused (see `moe_platform.interop.hf`).
"""

import argparse
import json
from pathlib import Path

import torch

from moe import Transformer
from moe_platform.checkpoint.consolidate import export_fp32_state_dict
from moe_platform.checkpoint.errors import CheckpointError
from moe_platform.config import TrainConfig, load_run_config

DEFAULT_MAX_SHARD_SIZE = "5GB"
MTP_FILE = "model-mtp.safetensors"  # DeepSeek-V3's MTP layers, which transformers' causal LM does not save


def write_beside(directory: Path, tensors: dict[str, torch.Tensor], file_name: str) -> None:
    """Add `tensors` to a saved transformers directory as one more safetensors file, listed in the index (written
    when save_pretrained wrote a single unindexed file), so that readers of the index find them."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    # Copies: a tied model's embedding and head copies are one tensor, which safetensors will not write twice.
    copies = {name: t.detach().clone().contiguous() for name, t in tensors.items()}
    save_file(copies, directory / file_name, metadata={"format": "pt"})
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:
        with safe_open(directory / "model.safetensors", framework="pt") as f:
            index = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), "model.safetensors")}
    index["weight_map"].update(dict.fromkeys(tensors, file_name))
    index["metadata"]["total_size"] = sum((directory / f).stat().st_size for f in set(index["weight_map"].values()))
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True))


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


def export_hf(checkpoint: Path, output: Path, max_shard_size: str = DEFAULT_MAX_SHARD_SIZE) -> str:
    """Write the checkpoint as a transformers model directory: config.json, safetensors (sharded past
    `max_shard_size`), generation_config.json, and the run's tokenizer files when it used a HF tokenizer.
    Returns the architecture name; raises hf.ConversionError before writing anything it cannot represent."""
    import transformers

    from data_pipeline.tokenizer import build_tokenizer
    from moe_platform.interop.hf import hf_architecture, to_hf
    from moe_platform.interop.hf.deepseek_v3 import split_mtp

    run_config = load_checkpoint_config(checkpoint)
    hf_architecture(run_config.model)  # refuse before consolidating a large checkpoint
    model = load_exported_model(checkpoint)
    tokenizer = build_tokenizer(run_config.data.tokenizer)
    token_ids = {"eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    hf_config, hf_state = to_hf(run_config.model, model.state_dict(), **token_ids)
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight is overwritten below; a random init of a large model would take minutes
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    hf_state, mtp_state = split_mtp(run_config.model, hf_state)
    hf_model.load_state_dict(hf_state, strict=True)
    hf_model.generation_config = transformers.GenerationConfig(**token_ids)
    hf_model.save_pretrained(output, max_shard_size=max_shard_size)
    if mtp_state:
        write_beside(Path(output), mtp_state, MTP_FILE)
    if run_config.data.tokenizer.name_or_path is not None:
        # The same Rust backend the run tokenised with (file, directory or hub name alike), with its EOS/PAD choice.
        backend = tokenizer.backend
        transformers.PreTrainedTokenizerFast(
            tokenizer_object=backend,
            eos_token=backend.id_to_token(tokenizer.eos_id),
            pad_token=backend.id_to_token(tokenizer.pad_id),
        ).save_pretrained(output)
    return hf_config.architectures[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="moe-export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoints/step_XXXXXXXX directory")
    parser.add_argument(
        "output", type=Path, help="the fp32 state dict file (torch.save), or a directory for --format hf"
    )
    parser.add_argument("--format", choices=("pt", "hf"), default="pt", help="pt: state dict; hf: transformers dir")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, help="hf only: largest safetensors shard")
    args = parser.parse_args(argv)
    if args.format == "hf":
        from moe_platform.interop.hf import ConversionError

        try:
            arch = export_hf(args.checkpoint, args.output, args.max_shard_size)
        except ConversionError as exc:
            parser.exit(2, f"moe-export: cannot export to Hugging Face format: {exc}\n")
        print(f"wrote {args.output}: {arch}")
        return
    model = load_exported_model(args.checkpoint)
    torch.save(model.state_dict(), args.output)
    print(f"wrote {args.output}: {sum(p.numel() for p in model.parameters()):,} parameters in fp32")


if __name__ == "__main__":
    main()
