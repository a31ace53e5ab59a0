"""Dense models: Llama both ways, Qwen2 on import (`LlamaForCausalLM`, `Qwen2ForCausalLM`).

Decisions that keep the logits exact (fp32, up to summation order):
  * Attention bias. Ours biases Q, K, V and O. Llama does the same (`attention_bias`), so a dense model always
    exports as Llama; Qwen2 biases Q, K, V only, so its import sets the O bias to zero.
  * FFN bias. Llama's `mlp_bias` is ours `model.ffn_bias`; an `mlp_bias` on any other family is refused.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moe.config import ModelConfig
from moe_platform.interop.hf.common import (
    attention_from_hf,
    attention_to_hf,
    dense_mlp_from_hf,
    dense_mlp_to_hf,
    gqa_fields_from_hf,
)
from moe_platform.interop.hf.tensors import HFTensors, Reader

LLAMA, QWEN2 = "LlamaForCausalLM", "Qwen2ForCausalLM"


def represents(config: ModelConfig) -> bool:
    """Every dense GQA model (RoPE, RMSNorm and SwiGLU already checked) is a Llama."""
    return config.attention != "mla" and config.moe is None


def config_to_hf(config: ModelConfig, common: dict) -> object:
    import transformers

    return transformers.LlamaConfig(
        intermediate_size=config.d_ff,
        attention_bias=config.attention_bias,
        mlp_bias=config.ffn_bias,
        head_dim=config.head_dim,
        **common,
    )


def config_from_hf(hf: object, fields: dict) -> ModelConfig:
    """A Llama or Qwen2 config (`fields`: the shared ones, already checked) as ours."""
    attention_bias = hf.model_type == "qwen2" or bool(hf.attention_bias)
    return ModelConfig(
        **fields,
        **gqa_fields_from_hf(hf),
        d_ff=hf.intermediate_size,
        attention_bias=attention_bias,
        ffn_bias=bool(getattr(hf, "mlp_bias", False)),
    )


def weights_to_hf(config: ModelConfig, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(config.n_layers):
        out |= attention_to_hf(config, sd, i, output_bias=True)
        out |= dense_mlp_to_hf(sd, f"blocks.{i}.ffn", f"model.layers.{i}.mlp", config.ffn_bias)
    return out


def weights_from_hf(config: ModelConfig, hf: object, tensors: HFTensors) -> dict[str, Reader]:
    out = {}
    for i in range(config.n_layers):
        out |= attention_from_hf(config, tensors, i)
        out |= dense_mlp_from_hf(tensors, f"model.layers.{i}.mlp", f"blocks.{i}.ffn", config.ffn_bias)
    return out
