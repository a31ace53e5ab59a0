"""The table of Hugging Face families, and the conversions both ways that go through it (the package docstring says
how a family is chosen)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

import moe_platform.interop.hf.deepseek_v3 as deepseek_v3
import moe_platform.interop.hf.llama as llama
import moe_platform.interop.hf.mixtral as mixtral
import moe_platform.interop.hf.qwen2_moe as qwen2_moe
from moe.config import ModelConfig
from moe_platform.checkpoint.errors import CheckpointError
from moe_platform.interop.hf.common import (
    ConversionError,
    embeddings_and_norms_from_hf,
    embeddings_and_norms_to_hf,
    hf_common_fields,
    model_fields_from_hf,
    refuse_if,
    refuse_other_blocks,
)
from moe_platform.interop.hf.tensors import (
    SAFETENSORS,
    SAFETENSORS_INDEX,
    HFTensors,
    InMemoryTensors,
    LazyStateDict,
    Reader,
    SafetensorsTensors,
)

PYTORCH_BIN, PYTORCH_BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


@dataclass(frozen=True)
class Family:
    """One transformers architecture: whether it computes a ModelConfig exactly, and its config and weight mappings
    both ways (None: import only). `file_names` renames its files' tensors to transformers' in-memory names."""

    architecture: str  # the transformers class, written into config.json's `architectures`
    model_type: str  # config.json's model_type, which picks the family on import
    represents: Callable[[ModelConfig], bool] | None  # refuses, in one sentence, what only it could compute
    config_to_hf: Callable[[ModelConfig, dict], object] | None
    config_from_hf: Callable[[object, dict], ModelConfig]
    weights_to_hf: Callable[[ModelConfig, Mapping[str, torch.Tensor]], dict[str, torch.Tensor]] | None
    weights_from_hf: Callable[[ModelConfig, object, HFTensors], dict[str, Reader]]
    file_names: tuple[tuple[str, str], ...] = ()


# In the order an export tries them: the first that represents the model is its architecture.
FAMILIES = (
    Family(
        deepseek_v3.DEEPSEEK_V3,
        "deepseek_v3",
        deepseek_v3.represents,
        deepseek_v3.config_to_hf,
        deepseek_v3.config_from_hf,
        deepseek_v3.weights_to_hf,
        deepseek_v3.weights_from_hf,
    ),
    Family(
        llama.LLAMA,
        "llama",
        llama.represents,
        llama.config_to_hf,
        llama.config_from_hf,
        llama.weights_to_hf,
        llama.weights_from_hf,
    ),
    Family(
        mixtral.MIXTRAL,
        "mixtral",
        mixtral.represents,
        mixtral.config_to_hf,
        mixtral.config_from_hf,
        mixtral.weights_to_hf,
        mixtral.weights_from_hf,
        file_names=mixtral.FILE_NAMES,
    ),
    Family(
        qwen2_moe.QWEN2_MOE,
        "qwen2_moe",
        qwen2_moe.represents,
        qwen2_moe.config_to_hf,
        qwen2_moe.config_from_hf,
        qwen2_moe.weights_to_hf,
        qwen2_moe.weights_from_hf,
    ),
    Family(llama.QWEN2, "qwen2", None, None, llama.config_from_hf, None, llama.weights_from_hf),  # Llama exports
)


def export_family(config: ModelConfig) -> Family:
    """The family that computes exactly what `config` computes at inference, or ConversionError."""
    refuse_other_blocks(config)
    for family in FAMILIES:
        if family.represents is not None and family.represents(config):
            return family
    raise AssertionError("unreachable: every dense GQA model is a Llama and every other GQA MoE model a Qwen2-MoE")


def import_family(model_type: str) -> Family:
    for family in FAMILIES:
        if family.model_type == model_type:
            return family
    raise ConversionError(
        f"model_type={model_type!r} is not one of the importable architectures "
        f"{', '.join(sorted(family.model_type for family in FAMILIES))}"
    )


def hf_architecture(config: ModelConfig) -> str:
    """The transformers class name that computes exactly what `config` computes at inference, or ConversionError."""
    return export_family(config).architecture


def hf_config(config: ModelConfig, **token_ids) -> object:
    """The transformers config object of `config` (see `hf_architecture`); `token_ids` (eos/bos/pad_token_id)
    go into it unchanged, and default to None so that generation never stops on an id the run never used."""
    return _hf_config(export_family(config), config, token_ids)


def _hf_config(family: Family, config: ModelConfig, token_ids: dict) -> object:
    ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **token_ids}
    return family.config_to_hf(config, hf_common_fields(config, family.architecture, ids))


def to_hf(config: ModelConfig, state_dict: Mapping[str, torch.Tensor], **token_ids) -> tuple[object, dict]:
    """(transformers config, state dict in transformers' in-memory layout) computing exactly what ours computes."""
    family = export_family(config)
    out = {**embeddings_and_norms_to_hf(config, state_dict), **family.weights_to_hf(config, state_dict)}
    return _hf_config(family, config, token_ids), out


def config_from_hf(hf: object) -> ModelConfig:
    """Our ModelConfig of a transformers config, or ConversionError for what ours cannot compute exactly."""
    family = import_family(hf.model_type)
    return family.config_from_hf(hf, model_fields_from_hf(hf))


def hf_model_config(directory: str | Path) -> ModelConfig:
    """Our ModelConfig of a transformers model directory, from its config.json alone: no weight is read."""
    return config_from_hf(_read_config(Path(directory)))


def _read_config(directory: Path) -> object:
    """config.json as transformers' config object; an architecture we do not map is refused before transformers
    is asked about it."""
    import transformers

    try:
        fields = json.loads((directory / "config.json").read_text())
    except ValueError as err:
        raise CheckpointError(f"{directory / 'config.json'} is not JSON ({err}): re-save the model") from None
    import_family(fields.get("model_type"))
    # A quantized checkpoint (DeepSeek-V3's own is FP8 with per-block scales) would be read as if its numbers were
    # the weights: refused rather than imported wrong.
    quantization = fields.get("quantization_config")
    refuse_if(
        quantization is not None,
        f"quantization_config (quant_method={(quantization or {}).get('quant_method')!r}) marks quantized weights, "
        "which the import reads as they are: dequantize the checkpoint (to bf16 or fp32) first",
    )
    return transformers.AutoConfig.from_pretrained(directory)


def read_hf_dir(directory: str | Path) -> tuple[ModelConfig, LazyStateDict]:
    """(ModelConfig, our state dict as a LazyStateDict) of a transformers model directory: the config from
    config.json, the weights read one of our tensors at a time from the safetensors shards when asked (tensors.py).
    A directory with only pytorch_model.bin files is loaded whole by transformers instead (`load_hf_model_dir`).
    Refuses what ours cannot compute exactly, and a directory that lacks a tensor, before reading any weight."""
    directory = Path(directory)
    hf = _read_config(directory)
    config = config_from_hf(hf)
    family = import_family(hf.model_type)
    if (directory / SAFETENSORS_INDEX).is_file() or (directory / SAFETENSORS).is_file():
        tensors = SafetensorsTensors(directory, family.file_names)
    elif (directory / PYTORCH_BIN_INDEX).is_file() or (directory / PYTORCH_BIN).is_file():
        # torch.load of a pickle cannot read one tensor alone: these (older) directories load whole, in fp32.
        tensors = InMemoryTensors(load_hf_model_dir(directory)[1])
    else:
        raise CheckpointError(
            f"{directory} has a config.json but no {SAFETENSORS}, {SAFETENSORS_INDEX} or {PYTORCH_BIN}: copy the "
            "model's weight files into it"
        )
    return config, _state(config, hf, family, tensors)


def from_hf(
    hf: object | str | Path, hf_state_dict: Mapping[str, torch.Tensor] | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, our state dict) from a Llama, Qwen2, Mixtral, Qwen2-MoE or DeepSeek-V3 config and its
    in-memory state dict (`model.state_dict()` of a loaded transformers model), or from a model directory alone
    (read as `read_hf_dir` reads it, then all in memory); refuses what ours cannot compute exactly."""
    if hf_state_dict is None:
        config, state = read_hf_dir(hf)
        return config, state.materialize()
    config = config_from_hf(hf)
    return config, _state(config, hf, import_family(hf.model_type), InMemoryTensors(hf_state_dict)).materialize()


def _state(config: ModelConfig, hf: object, family: Family, tensors: HFTensors) -> LazyStateDict:
    readers = embeddings_and_norms_from_hf(config, tensors)
    return LazyStateDict({**readers, **family.weights_from_hf(config, hf, tensors)})


def load_hf_model_dir(path: str | Path) -> tuple[object, dict[str, torch.Tensor]]:
    """(transformers config, fp32 in-memory state dict) of a model directory, loaded whole by transformers, which
    reads either expert layout and .bin files too. DeepSeek-V3's MTP tensors, which transformers drops, are named
    from the safetensors files' headers in a printed note."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32)
    if model.config.model_type == "deepseek_v3":
        from safetensors import safe_open

        names = []
        for file in sorted(Path(path).glob("*.safetensors")):
            with safe_open(file, framework="pt") as f:
                names += list(f.keys())
        deepseek_v3.note_ignored_mtp(model.config, names)
    return model.config, model.state_dict()
