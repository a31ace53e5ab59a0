"""Qwen2-MoE (`Qwen2MoeForCausalLM`): every softmax-routed GQA MoE model that is not a Mixtral.

Decisions that keep the logits exact (fp32, up to summation order):
  * Routing. Ours with softmax over all E then top-k then renormalise (or softmax over the top-k logits) is
    `norm_topk_prob=True`; without renormalisation it is `norm_topk_prob=False`. Top-1 with norm_topk_prob has a
    gate of exactly 1, which our router cannot express: refused on import.
  * Shared experts. Qwen2-MoE gates its shared expert by sigmoid(x·g); ours are ungated. With g = 0 the gate is
    exactly 1/2, so the export writes g = 0 and the shared down projection ×2 (a power of two: bit-exact); an
    import accepts only g = 0 and halves it back. A non-zero gate is refused. The shared expert is one FFN of
    width `shared_expert_intermediate_size` = moe.num_shared_experts · moe.expert_d_ff (a width that is not a
    multiple is refused); with none, the export writes a zero-width one, which adds exactly 0.
  * Attention bias. Qwen2-MoE biases Q, K, V only (`qkv_bias`): the import sets the O bias to zero, and an export
    needs every O bias to be zero.
  * Interleaved dense layers map to `mlp_only_layers` (with `decoder_sparse_step=1`), which names any set; an
    import needs them to be "first N dense, then every k-th" (moe.first_dense_layers / moe.moe_layer_interval).
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
    dense_mlp_from_hf,
    dense_mlp_to_hf,
    experts_from_hf,
    experts_to_hf,
    gqa_fields_from_hf,
    refuse_if,
    refuse_what_gqa_moe_lacks,
)
from moe_platform.interop.hf.tensors import HFTensors, Reader

QWEN2_MOE = "Qwen2MoeForCausalLM"


def represents(config: ModelConfig) -> bool:
    """Every GQA MoE model that Mixtral does not take and that neither GQA MoE family refuses."""
    if config.attention == "mla" or config.moe is None:
        return False
    refuse_what_gqa_moe_lacks(config)
    return True


def config_to_hf(config: ModelConfig, common: dict) -> object:
    import transformers

    moe = config.moe
    return transformers.Qwen2MoeConfig(
        intermediate_size=config.d_ff,
        moe_intermediate_size=moe.expert_d_ff,
        shared_expert_intermediate_size=moe.num_shared_experts * moe.expert_d_ff,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.router.renormalize_topk or moe.router.softmax_after_topk,
        decoder_sparse_step=1,
        mlp_only_layers=dense_layers(config),
        qkv_bias=config.attention_bias,
        use_sliding_window=False,
        router_aux_loss_coef=moe.aux_loss_coef,
        head_dim=config.head_dim,
        **common,
    )


def config_from_hf(hf: object, fields: dict) -> ModelConfig:
    gqa = gqa_fields_from_hf(hf)
    moe_layers = [
        i not in hf.mlp_only_layers and hf.num_experts > 0 and (i + 1) % hf.decoder_sparse_step == 0
        for i in range(hf.num_hidden_layers)
    ]
    first, interval = _moe_layer_pattern(moe_layers)
    F, S = hf.moe_intermediate_size, hf.shared_expert_intermediate_size
    refuse_if(
        S % F != 0,
        f"shared_expert_intermediate_size={S} is not a multiple of moe_intermediate_size={F}, so it is not a whole "
        "number of moe.num_shared_experts",
    )
    refuse_if(
        hf.norm_topk_prob and hf.num_experts_per_tok == 1,
        "Qwen2-MoE with top-1 routing and norm_topk_prob has gate 1, which moe.router cannot express",
    )
    moe = MoEConfig(
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        expert_d_ff=F,
        num_shared_experts=S // F,
        first_dense_layers=first,
        moe_layer_interval=interval,
        aux_loss_coef=hf.router_aux_loss_coef,
        router=RouterConfig(renormalize_topk=bool(hf.norm_topk_prob)),
    )
    return ModelConfig(**fields, **gqa, d_ff=hf.intermediate_size, attention_bias=bool(hf.qkv_bias), moe=moe)


def _moe_layer_pattern(moe_layers: list[bool]) -> tuple[int, int]:
    """(first_dense_layers, moe_layer_interval) that pick exactly the layers marked True, or ConversionError."""
    ids = [i for i, is_moe in enumerate(moe_layers) if is_moe]
    refuse_if(not ids, "a model with no MoE layer should be imported as a dense model")
    first = ids[0]
    interval = ids[1] - ids[0] if len(ids) > 1 else len(moe_layers)
    expected = [i >= first and (i - first) % interval == 0 for i in range(len(moe_layers))]
    refuse_if(
        expected != moe_layers,
        f"MoE layers {ids} are not 'first N dense, then every k-th' (moe.first_dense_layers/moe_layer_interval)",
    )
    return first, interval


def weights_to_hf(config: ModelConfig, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(config.n_layers):
        out |= attention_to_hf(config, sd, i, output_bias=False)
        refuse_if(
            config.attention_bias and bool(sd[f"blocks.{i}.attn.w_o.bias"].any()),
            f"layer {i} has a non-zero attention output bias, which Qwen2-MoE (bias on Q, K, V only) lacks",
        )
        if not config.is_moe_layer(i):
            out |= dense_mlp_to_hf(sd, f"blocks.{i}.ffn", f"model.layers.{i}.mlp", bias=False)
            continue
        router_ED = sd[f"blocks.{i}.ffn.router.weight"]
        out[f"model.layers.{i}.mlp.gate.weight"] = router_ED
        out |= experts_to_hf(sd, f"blocks.{i}.ffn.experts", f"model.layers.{i}.mlp.experts")
        out |= _shared_expert_to_hf(config, sd, i, router_ED.dtype)
    return out


def _shared_expert_to_hf(config: ModelConfig, sd: Mapping[str, torch.Tensor], i: int, dtype: torch.dtype) -> dict:
    shared = f"model.layers.{i}.mlp.shared_expert"
    D, S = config.d_model, config.moe.num_shared_experts * config.moe.expert_d_ff
    out = {f"{shared}_gate.weight": torch.zeros(1, D, dtype=dtype)}
    if S == 0:  # Qwen2-MoE always builds a shared expert: a zero-width one adds exactly 0
        for hf_name, shape in (("gate_proj", (0, D)), ("up_proj", (0, D)), ("down_proj", (D, 0))):
            out[f"{shared}.{hf_name}.weight"] = torch.zeros(shape, dtype=dtype)
        return out
    out |= dense_mlp_to_hf(sd, f"blocks.{i}.ffn.shared_experts", shared, bias=False)
    # sigmoid(0) = 1/2 exactly; ×2 is exact in floating point, so 1/2 · (h · 2W) == h · W bit for bit.
    out[f"{shared}.down_proj.weight"] = out[f"{shared}.down_proj.weight"] * 2
    return out


def weights_from_hf(config: ModelConfig, hf: object, tensors: HFTensors) -> dict[str, Reader]:
    out = {}
    for i in range(config.n_layers):
        out |= attention_from_hf(config, tensors, i)
        if not config.is_moe_layer(i):
            out |= dense_mlp_from_hf(tensors, f"model.layers.{i}.mlp", f"blocks.{i}.ffn", bias=False)
            continue
        ours, theirs = f"blocks.{i}.ffn", f"model.layers.{i}.mlp"
        out[f"{ours}.router.weight"] = tensors.reader(f"{theirs}.gate.weight")
        out |= experts_from_hf(tensors, f"{theirs}.experts", f"{ours}.experts", config.moe.num_experts)
        # Read now, not lazily: a gate of 1·D numbers, and a non-zero one must refuse the source before any weight.
        gate_1D = tensors.read(tensors.require(f"{theirs}.shared_expert_gate.weight"))
        refuse_if(
            bool(gate_1D.any()),
            f"layer {i}'s shared_expert_gate is not zero: a per-token sigmoid gate on the shared expert has no "
            "equivalent in moe-platform's ungated shared experts",
        )
        if config.moe.num_shared_experts:
            out |= dense_mlp_from_hf(tensors, f"{theirs}.shared_expert", f"{ours}.shared_experts", bias=False)
            down = out[f"{ours}.shared_experts.w_down.weight"]
            out[f"{ours}.shared_experts.w_down.weight"] = lambda down=down: down() / 2  # the gate's 1/2 (docstring)
    return out
