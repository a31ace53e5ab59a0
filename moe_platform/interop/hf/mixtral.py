"""Mixtral (`MixtralForCausalLM`): MoE on every layer, renormalised softmax top-k, no shared experts, no bias.

Decisions that keep the logits exact (fp32, up to summation order):
  * Routing. Ours with softmax over all E then top-k then renormalise (or softmax over the top-k logits, the same
    numbers) is Mixtral's router. Top-1 Mixtral has a gate of exactly 1, which our router cannot express: refused.
  * Export. A model with dense layers, shared experts, unrenormalised gates or attention biases is not a Mixtral;
    it exports as Qwen2-MoE (qwen2_moe.py).
  * Files. Mixtral's files name the experts `block_sparse_moe.experts.{e}.w1/w3/w2` (gate, up, down) and the router
    `block_sparse_moe.gate`: read under transformers' in-memory names (`FILE_NAMES`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moe.config import ModelConfig
from moe.moe_config import MoEConfig, RouterConfig
from moe_platform.interop.hf.common import (
    attention_from_hf,
    attention_to_hf,
    dense_layers,
    experts_from_hf,
    experts_to_hf,
    gqa_fields_from_hf,
    refuse_if,
    refuse_what_gqa_moe_lacks,
)
from moe_platform.interop.hf.tensors import HFTensors, Reader

MIXTRAL = "MixtralForCausalLM"
FILE_NAMES = (
    (r"\.block_sparse_moe\.", ".mlp."),
    (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
    (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
    (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
)


def represents(config: ModelConfig) -> bool:
    """Whether Mixtral computes this GQA MoE model exactly (what neither GQA MoE family has is refused first)."""
    if config.attention == "mla" or config.moe is None:
        return False
    refuse_what_gqa_moe_lacks(config)
    moe = config.moe
    renormalised = moe.router.renormalize_topk or moe.router.softmax_after_topk
    return not dense_layers(config) and moe.num_shared_experts == 0 and renormalised and not config.attention_bias


def config_to_hf(config: ModelConfig, common: dict) -> object:
    import transformers

    moe = config.moe
    return transformers.MixtralConfig(
        intermediate_size=moe.expert_d_ff,
        num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        router_aux_loss_coef=moe.aux_loss_coef,
        sliding_window=None,
        head_dim=config.head_dim,
        **common,
    )


def config_from_hf(hf: object, fields: dict) -> ModelConfig:
    gqa = gqa_fields_from_hf(hf)
    refuse_if(hf.num_experts_per_tok == 1, "Mixtral with top-1 routing has gate 1, which moe.router cannot express")
    moe = MoEConfig(
        num_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        expert_d_ff=hf.intermediate_size,
        aux_loss_coef=hf.router_aux_loss_coef,
        router=RouterConfig(renormalize_topk=True),
    )
    return ModelConfig(**fields, **gqa, d_ff=hf.intermediate_size, moe=moe)


def weights_to_hf(config: ModelConfig, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(config.n_layers):
        out |= attention_to_hf(config, sd, i, output_bias=True)
        out[f"model.layers.{i}.mlp.gate.weight"] = sd[f"blocks.{i}.ffn.router.weight"]
        out |= experts_to_hf(sd, f"blocks.{i}.ffn.experts", f"model.layers.{i}.mlp.experts")
    return out


def weights_from_hf(config: ModelConfig, hf: object, tensors: HFTensors) -> dict[str, Reader]:
    out = {}
    for i in range(config.n_layers):
        out |= attention_from_hf(config, tensors, i)
        out[f"blocks.{i}.ffn.router.weight"] = tensors.reader(f"model.layers.{i}.mlp.gate.weight")
        theirs, ours = f"model.layers.{i}.mlp.experts", f"blocks.{i}.ffn.experts"
        out |= experts_from_hf(tensors, theirs, ours, config.moe.num_experts)
    return out
