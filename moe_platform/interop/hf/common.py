"""What every Hugging Face family maps alike: the shared config fields, embeddings and norms, GQA attention, dense
MLPs, the expert layout, the RoPE-row permutation, and the one-sentence refusal (`ConversionError`).

Legend: D model width, F (expert) hidden width, E routed experts, L layers, r RoPE dims of a head.

Decisions that hold for every architecture (fp32 logits exact up to summation order):
  * Blocks. Every family is RoPE + RMSNorm + SwiGLU: learned or ALiBi positions, LayerNorm and GELU are refused
    (and, on import, a non-silu activation and scaled RoPE, `rope_parameters.rope_type` != "default"). The GQA
    families' sliding-window attention (Qwen2 and Qwen2-MoE `use_sliding_window`, Mixtral `sliding_window`) is
    refused: ours attends over the whole causal window.
  * Training-only router features. Jitter, aux loss and z-loss act only in training: dropped (for every
    architecture); the aux-loss coefficient travels where the HF config has a field for it.
  * Capacity. HF MoE layers are dropless. `capacity_factor` drops tokens only in training; `eval_capacity_factor`
    drops them at inference too, so a model evaluated with one is refused (its own eval logits would differ).
  * Experts. Ours computes x @ w[e] with w_gate/w_up [E, D, F] and w_down [E, F, D]; transformers keeps
    F.linear weights gate_up_proj [E, 2F, D] (gate rows first) and down_proj [E, D, F] in memory, and its files
    hold one 2-D tensor per expert (experts.{e}.gate_proj.weight [F, D], …). Both are read; the export hands
    transformers the in-memory layout and `save_pretrained` writes the files.
  * Quantized checkpoints (config.json's `quantization_config`, e.g. DeepSeek-V3's own FP8 files) are refused on
    import (registry.py): their stored numbers are not the weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moe.config import ModelConfig
from moe.errors import ModelConfigError
from moe_platform.interop.hf.tensors import ExpertRows, HFTensors, Reader


class ConversionError(ModelConfigError):
    """A model that no supported transformers architecture represents exactly; one sentence names the feature."""


def refuse_if(condition: bool, message: str) -> None:
    if condition:
        raise ConversionError(message)


# ---- weight names: ours → HF per layer, for the plain 2-D tensors that are copied as they are ----------------------
ATTN = {"w_q": "q_proj", "w_k": "k_proj", "w_v": "v_proj", "w_o": "o_proj"}
MLP = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


def refuse_other_blocks(config: ModelConfig) -> None:
    """Every family is RoPE + RMSNorm + SwiGLU: refuse anything else before choosing one."""
    refuse_if(
        config.pos_encoding != "rope",
        f"model.pos_encoding={config.pos_encoding!r} has no exact equivalent in Llama/Mixtral/Qwen2-MoE/DeepSeek-V3, "
        "which use RoPE",
    )
    refuse_if(
        config.norm != "rmsnorm",
        f"model.norm={config.norm!r} has no exact equivalent in Llama/Mixtral/Qwen2-MoE/DeepSeek-V3, which use RMSNorm",
    )
    refuse_if(
        config.activation != "swiglu",
        f"model.activation={config.activation!r} has no exact equivalent in Llama/Mixtral/Qwen2-MoE/DeepSeek-V3, "
        "which use SwiGLU",
    )


def refuse_what_gqa_moe_lacks(config: ModelConfig) -> None:
    """Refuse a GQA MoE model that neither Mixtral nor Qwen2-MoE computes: DeepSeek-V3's router features (which
    exist only with MLA there), capacity at inference, and biased MLPs beside the experts."""
    moe, router = config.moe, config.moe.router
    refuse_if(
        router.score_fn != "softmax",
        f"moe.router.score_fn={router.score_fn!r} routing has no exact equivalent in Mixtral/Qwen2-MoE, "
        "which route by softmax, and DeepSeek-V3 needs model.attention=mla",
    )
    refuse_if(
        router.bias_update_rate > 0,
        "moe.router.bias_update_rate>0 (aux-loss-free balancing) adds a selection bias to top-k that "
        "Mixtral/Qwen2-MoE routers do not have, and DeepSeek-V3 needs model.attention=mla",
    )
    refuse_if(
        router.n_group > 1,
        f"moe.router.n_group={router.n_group} (group-limited routing) exists only in DeepSeek-V3, which needs "
        "model.attention=mla",
    )
    refuse_if(
        router.routed_scaling_factor != 1.0,
        f"moe.router.routed_scaling_factor={router.routed_scaling_factor} exists only in DeepSeek-V3, which needs "
        "model.attention=mla",
    )
    refuse_if(
        moe.eval_capacity_factor is not None,
        f"moe.eval_capacity_factor={moe.eval_capacity_factor} drops tokens at inference, but Mixtral/Qwen2-MoE "
        "are dropless",
    )
    refuse_if(
        config.ffn_bias and bool(dense_layers(config)),
        "model.ffn_bias=True in the dense layers of a MoE model has no equivalent in Qwen2-MoE, whose MLPs are "
        "bias-free",
    )


def dense_layers(config: ModelConfig) -> list[int]:
    return [i for i in range(config.n_layers) if not config.is_moe_layer(i)]


# ---- config fields ---------------------------------------------------------------------------------------------


def hf_common_fields(config: ModelConfig, architecture: str, token_ids: dict) -> dict:
    """The transformers config fields every family fills alike (MLA's head widths and GQA's head_dim excepted)."""
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,  # = n_heads under MLA, whose keys are per head already
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        hidden_act="silu",
        tie_word_embeddings=config.tie_embeddings,
        initializer_range=config.init_std,
        architectures=[architecture],
        rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta)},
        **token_ids,
    )


def model_fields_from_hf(hf: object) -> dict:
    """The ModelConfig fields every importable architecture maps alike: RoPE, RMSNorm and SwiGLU (checked here)."""
    refuse_if(hf.hidden_act != "silu", f"hidden_act={hf.hidden_act!r} is not SwiGLU's silu")
    rope = getattr(hf, "rope_parameters", None) or {"rope_type": "default", "rope_theta": hf.rope_theta}
    refuse_if(
        rope.get("rope_type", "default") != "default",
        f"rope_parameters rope_type={rope.get('rope_type')!r} (scaled RoPE; YaRN also rescales the softmax) is not "
        "the plain RoPE moe.Transformer computes",
    )
    return dict(
        vocab_size=hf.vocab_size,
        d_model=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        n_heads=hf.num_attention_heads,
        max_seq_len=hf.max_position_embeddings,
        pos_encoding="rope",
        rope_theta=float(rope["rope_theta"]),
        norm="rmsnorm",
        norm_eps=hf.rms_norm_eps,
        activation="swiglu",
        tie_embeddings=bool(hf.tie_word_embeddings),
        init_std=hf.initializer_range,
    )


def gqa_fields_from_hf(hf: object) -> dict:
    """The attention fields of a GQA family (Llama, Qwen2, Mixtral, Qwen2-MoE), refusing what ours lacks."""
    mixtral_window = hf.model_type == "mixtral" and hf.sliding_window is not None
    refuse_if(
        bool(getattr(hf, "use_sliding_window", False)) or mixtral_window,
        "sliding-window attention has no equivalent in moe.Transformer's full causal attention",
    )
    refuse_if(bool(getattr(hf, "mlp_bias", False)) and hf.model_type != "llama", "mlp_bias is only mapped for Llama")
    return dict(
        n_kv_heads=hf.num_key_value_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
    )


# ---- weights, ours → HF (in memory, eager) ---------------------------------------------------------------------


def embeddings_and_norms_to_hf(config: ModelConfig, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's embedding, head and every norm outside attention, which all architectures name alike."""
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["final_norm.weight"]}
    out["lm_head.weight"] = sd["embed.weight"] if config.tie_embeddings else sd["lm_head.weight"]
    for i in range(config.n_layers):
        out[f"model.layers.{i}.input_layernorm.weight"] = sd[f"blocks.{i}.attn_norm.weight"]
        out[f"model.layers.{i}.post_attention_layernorm.weight"] = sd[f"blocks.{i}.ffn_norm.weight"]
    return out


def attention_to_hf(config: ModelConfig, sd: Mapping[str, torch.Tensor], i: int, output_bias: bool) -> dict:
    """Layer i's GQA projections; `output_bias` False for the families that bias Q, K, V only."""
    out = {}
    for our_name, hf_name in ATTN.items():
        ours, theirs = f"blocks.{i}.attn.{our_name}", f"model.layers.{i}.self_attn.{hf_name}"
        out[f"{theirs}.weight"] = sd[f"{ours}.weight"]
        if config.attention_bias and (output_bias or our_name != "w_o"):
            out[f"{theirs}.bias"] = sd[f"{ours}.bias"]
    return out


def dense_mlp_to_hf(sd: Mapping[str, torch.Tensor], ours: str, theirs: str, bias: bool) -> dict:
    """A dense SwiGLU MLP `{ours}.w_*` (a layer's FFN, or the fused shared experts) as HF's `{theirs}.*_proj`."""
    out = {}
    for our_name, hf_name in MLP.items():
        out[f"{theirs}.{hf_name}.weight"] = sd[f"{ours}.{our_name}.weight"]
        if bias:
            out[f"{theirs}.{hf_name}.bias"] = sd[f"{ours}.{our_name}.bias"]
    return out


def experts_to_hf(sd: Mapping[str, torch.Tensor], ours: str, theirs: str) -> dict[str, torch.Tensor]:
    """Our `{ours}.w_*` experts as transformers' in-memory `{theirs}.gate_up_proj` / `down_proj` (module docstring)."""
    gate_EFD = sd[f"{ours}.w_gate"].transpose(1, 2)
    up_EFD = sd[f"{ours}.w_up"].transpose(1, 2)
    return {
        f"{theirs}.gate_up_proj": torch.cat((gate_EFD, up_EFD), dim=1).contiguous(),
        f"{theirs}.down_proj": sd[f"{ours}.w_down"].transpose(1, 2).contiguous(),
    }


# ---- weights, HF → ours (readers: nothing is read until a reader is called) ------------------------------------


def embeddings_and_norms_from_hf(config: ModelConfig, tensors: HFTensors) -> dict[str, Reader]:
    """Our embedding, output head and every norm outside attention (a tied model's head is its embedding, whether
    or not the HF weights list it)."""
    embed = tensors.reader("model.embed_tokens.weight")
    out = {"embed.weight": embed, "final_norm.weight": tensors.reader("model.norm.weight")}
    untied_head = not config.tie_embeddings and "lm_head.weight" in tensors
    out["lm_head.weight"] = tensors.reader("lm_head.weight") if untied_head else embed
    for i in range(config.n_layers):
        out[f"blocks.{i}.attn_norm.weight"] = tensors.reader(f"model.layers.{i}.input_layernorm.weight")
        out[f"blocks.{i}.ffn_norm.weight"] = tensors.reader(f"model.layers.{i}.post_attention_layernorm.weight")
    return out


def attention_from_hf(config: ModelConfig, tensors: HFTensors, i: int) -> dict[str, Reader]:
    """Layer i's GQA projections; a bias the HF family lacks (Qwen2's O projection) is zero."""
    out = {}
    for our_name, hf_name in ATTN.items():
        ours, theirs = f"blocks.{i}.attn.{our_name}", f"model.layers.{i}.self_attn.{hf_name}"
        out[f"{ours}.weight"] = tensors.reader(f"{theirs}.weight")
        if config.attention_bias:
            bias = f"{theirs}.bias"
            out[f"{ours}.bias"] = tensors.reader(bias) if bias in tensors else tensors.zero_rows(f"{theirs}.weight")
    return out


def dense_mlp_from_hf(tensors: HFTensors, theirs: str, ours: str, bias: bool) -> dict[str, Reader]:
    """A dense SwiGLU MLP from HF's `{theirs}.*_proj` as our `{ours}.w_*`."""
    out = {}
    for our_name, hf_name in MLP.items():
        out[f"{ours}.{our_name}.weight"] = tensors.reader(f"{theirs}.{hf_name}.weight")
        if bias:
            out[f"{ours}.{our_name}.bias"] = tensors.reader(f"{theirs}.{hf_name}.bias")
    return out


def experts_from_hf(tensors: HFTensors, theirs: str, ours: str, num_experts: int) -> dict[str, ExpertRows]:
    """Our `{ours}.w_*` experts from `{theirs}` in either HF layout (module docstring), read a block of experts at
    a time, so that a rank under expert parallelism reads only its own rows."""
    fused = f"{theirs}.gate_up_proj"
    if fused in tensors:
        E, two_F = tensors.shape(fused)[:2]
        gate, up, down = slice(0, two_F // 2), slice(two_F // 2, two_F), f"{theirs}.down_proj"
        tensors.require(down)

        def gate_up(half: slice) -> ExpertRows:  # rows [a, b) of gate_up_proj's gate or up half, [n, F, D] → [n, D, F]
            return ExpertRows(E, lambda a, b: tensors.read(fused, slice(a, b), half).transpose(1, 2).contiguous())

        w_down = ExpertRows(E, lambda a, b: tensors.read(down, slice(a, b)).transpose(1, 2).contiguous())
        return {f"{ours}.w_gate": gate_up(gate), f"{ours}.w_up": gate_up(up), f"{ours}.w_down": w_down}

    def per_expert(hf_name: str) -> ExpertRows:  # experts.{e}.{hf_name}.weight [F, D] or [D, F], stacked transposed
        names = [tensors.require(f"{theirs}.{e}.{hf_name}.weight") for e in range(num_experts)]
        return ExpertRows(num_experts, lambda a, b: torch.stack([tensors.read(name).T for name in names[a:b]]))

    return {f"{ours}.{our_name}": per_expert(hf_name) for our_name, hf_name in MLP.items()}


# ---- RoPE rows (DeepSeek-V3's interleaved layout) --------------------------------------------------------------


def rope_permutation(rope_dim: int) -> torch.Tensor:
    """Index p with interleaved[j] = rotate_half[p[j]]: p = [0, r/2, 1, r/2 + 1, …]."""
    return torch.arange(rope_dim).view(2, rope_dim // 2).t().flatten()


def permute_rope_rows(w: torch.Tensor, heads: int, nope: int, rope: int, to_interleaved: bool) -> torch.Tensor:
    """`w` (weight [heads·(nope + rope), …] or bias) with the last `rope` rows of every head moved between our
    rotate-half order and HF's interleaved order (deepseek_v3.py's docstring)."""
    order = rope_permutation(rope)
    if not to_interleaved:
        order = order.argsort()
    w_hx = w.reshape(heads, nope + rope, *w.shape[1:])
    index = torch.cat((torch.arange(nope), nope + order))
    return w_hx[:, index].reshape(w.shape).contiguous()
