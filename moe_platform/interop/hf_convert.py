"""Exact conversion between `moe.Transformer` state dicts and Hugging Face transformers causal LMs.

Legend: D model width, F (expert) hidden width, E routed experts, L layers.

Which architecture (`hf_architecture`): `model.attention=mla` → DeepSeek-V3 (dense or MoE); otherwise dense →
Llama; MoE on every layer, no shared experts, renormalised top-k, no attention bias → Mixtral; any other
representable softmax-routed MoE → Qwen2-MoE. DeepSeek-V3's router features (sigmoid scores, the selection bias,
group limits, routed scaling) exist in no other architecture, and DeepSeek-V3 has only MLA, so a GQA model with one
of them is refused. A config that no architecture computes exactly is refused with one sentence
(`ConversionError`), never exported approximately.

Decisions that keep the logits exact (fp32, up to summation order):
  * Routing. Ours with softmax over all E then top-k then renormalise (or softmax over the top-k logits, the same
    numbers) is Mixtral's router and Qwen2-MoE's `norm_topk_prob=True`; without renormalisation it is Qwen2-MoE's
    `norm_topk_prob=False`. Sigmoid scores, the aux-loss-free selection bias, group limits and routed scaling exist
    only in DeepSeek-V3 (below), which has only MLA: a GQA model with one of them is refused. Jitter, aux loss and
    z-loss act only in training: dropped (for every architecture).
  * Capacity. HF MoE layers are dropless. `capacity_factor` drops tokens only in training; `eval_capacity_factor`
    drops them at inference too, so a model evaluated with one is refused (its own eval logits would differ).
  * Shared experts. Qwen2-MoE gates its shared expert by sigmoid(x·g); ours are ungated. With g = 0 the gate is
    exactly 1/2, so the export writes g = 0 and the shared down projection ×2 (a power of two: bit-exact); an
    import accepts only g = 0 and halves it back. A non-zero gate is refused.
  * Attention bias. Ours biases Q, K, V and O. Llama does the same; Qwen2 / Qwen2-MoE bias Q, K, V only, so their
    import sets the O bias to zero, and a Qwen2-MoE export needs every O bias to be zero.
  * Interleaved dense layers map to Qwen2-MoE `mlp_only_layers` (with `decoder_sparse_step=1`), which names any set.

DeepSeek-V3 (`DeepseekV3ForCausalLM`; H heads, n content and r RoPE dims per query/key head, C the KV latent):
  * RoPE layout. Ours pairs coordinate i with i + r/2 (rotate-half); real DeepSeek-V3 checkpoints pair 2i with
    2i+1, which HF computes with `rope_interleave=True` and returns in the rotate-half order (first all the
    rotated evens, then the odds). The export writes `rope_interleave=True` and permutes the r RoPE rows of each
    head of q_b_proj (q_proj) and of kv_a_proj_with_mqa (weight and bias) so that interleaved row 2i is our row i
    and row 2i+1 our row r/2 + i: HF's interleaved rotation then computes our rotate-half rotation with the same
    products (x1·cos - x2·sin, x2·cos + x1·sin; only the cos/sin tables, which each side computes itself, may round
    differently in the last bit). The import undoes the permutation under `rope_interleave=True` and copies the rows as
    they are under False.
  * Selection bias. HF's `e_score_correction_bias` is our `router.expert_bias`, which exists only when
    `moe.router.bias_update_rate > 0`: the import sets DeepSeek-V3's rate 0.001 so the bias is kept (training from
    the import balances as DeepSeek-V3 did); the export of a model without the buffer writes zeros (no bias).
  * Routing. HF always scores by sigmoid, adds the bias for the choice only, keeps the `topk_group` best of
    `n_group` groups by the sum of each group's top-2 scores, renormalises when `norm_topk_prob`, and multiplies by
    `routed_scaling_factor`: our sigmoid router with the same fields. Softmax scoring is refused, and so is a group
    of one expert (HF takes the top-2 of every group, ours the group's one score).
  * Layers. HF's dense layers are exactly the first `first_k_dense_replace`; interleaved dense layers
    (moe_layer_interval != 1) are refused. A dense MLA model exports with first_k_dense_replace = L (and a nominal
    one-expert router that no layer builds), and such a config imports as a dense model.
  * FFN widths. Dense layers: model.d_ff = intermediate_size; experts: moe.expert_d_ff = moe_intermediate_size; the
    shared experts are one ungated FFN of width n_shared_experts · moe_intermediate_size, as ours fuses them (no gate
    to neutralise, unlike Qwen2-MoE). With no shared expert HF still builds a zero-width one, which adds exactly 0.
  * Attention bias. HF's `attention_bias` biases q_a_proj, kv_a_proj_with_mqa and o_proj, the same three linears
    ours biases (never the full-rank q_proj, q_b_proj or kv_b_proj): copied as they are. Both latent RMSNorms use
    eps 1e-6 on both sides; the model's norms use rms_norm_eps.
  * Refused on import: scaled RoPE (YaRN etc.: `rope_parameters.rope_type` != "default", which also rescales the
    softmax), num_key_value_heads != num_attention_heads (HF would repeat MLA's per-head keys), a non-silu
    activation, top-1 routing with norm_topk_prob (a constant gate ours cannot express), a group of one expert.
  * MTP. transformers builds no multi-token-prediction module (`num_mtp_layers` only describes the checkpoint) and
    drops the `model.layers.{L}.*` weights real checkpoints hold for it; ours has none either. The import ignores
    them the same way and prints a note naming how many it dropped; the export writes num_mtp_layers=0.
  * Inference only: our MLA's `absorb_decode` changes no number HF computes and is not written; an import takes
    the default.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moe.config import ModelConfig
from moe.errors import ModelConfigError
from moe.mla_config import MLAConfig
from moe.moe_config import MoEConfig, RouterConfig


class ConversionError(ModelConfigError):
    """A model that no supported transformers architecture represents exactly; one sentence names the feature."""


LLAMA, MIXTRAL, QWEN2_MOE, QWEN2 = "LlamaForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen2ForCausalLM"
DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
DEEPSEEK_V3_BIAS_UPDATE_RATE = 1e-3  # DeepSeek-V3's γ, set on import so that e_score_correction_bias is kept


def _refuse_if(condition: bool, message: str) -> None:
    if condition:
        raise ConversionError(message)


def hf_architecture(config: ModelConfig) -> str:
    """The transformers class name that computes exactly what `config` computes at inference, or ConversionError."""
    _refuse_if(
        config.pos_encoding != "rope",
        f"model.pos_encoding={config.pos_encoding!r} has no exact equivalent in Llama/Mixtral/Qwen2-MoE/DeepSeek-V3, "
        "which use RoPE",
    )
    _refuse_if(
        config.norm != "rmsnorm",
        f"model.norm={config.norm!r} has no exact equivalent in Llama/Mixtral/Qwen2-MoE/DeepSeek-V3, which use RMSNorm",
    )
    _refuse_if(
        config.activation != "swiglu",
        f"model.activation={config.activation!r} has no exact equivalent in Llama/Mixtral/Qwen2-MoE/DeepSeek-V3, "
        "which use SwiGLU",
    )
    dense_layers = [i for i in range(config.n_layers) if not config.is_moe_layer(i)]
    if config.attention == "mla":
        return _deepseek_v3_architecture(config, dense_layers)
    if config.moe is None:
        return LLAMA
    moe, router = config.moe, config.moe.router
    _refuse_if(
        router.score_fn != "softmax",
        f"moe.router.score_fn={router.score_fn!r} routing has no exact equivalent in Mixtral/Qwen2-MoE, "
        "which route by softmax, and DeepSeek-V3 needs model.attention=mla",
    )
    _refuse_if(
        router.bias_update_rate > 0,
        "moe.router.bias_update_rate>0 (aux-loss-free balancing) adds a selection bias to top-k that "
        "Mixtral/Qwen2-MoE routers do not have, and DeepSeek-V3 needs model.attention=mla",
    )
    _refuse_if(
        router.n_group > 1,
        f"moe.router.n_group={router.n_group} (group-limited routing) exists only in DeepSeek-V3, which needs "
        "model.attention=mla",
    )
    _refuse_if(
        router.routed_scaling_factor != 1.0,
        f"moe.router.routed_scaling_factor={router.routed_scaling_factor} exists only in DeepSeek-V3, which needs "
        "model.attention=mla",
    )
    _refuse_if(
        moe.eval_capacity_factor is not None,
        f"moe.eval_capacity_factor={moe.eval_capacity_factor} drops tokens at inference, but Mixtral/Qwen2-MoE "
        "are dropless",
    )
    _refuse_if(
        config.ffn_bias and bool(dense_layers),
        "model.ffn_bias=True in the dense layers of a MoE model has no equivalent in Qwen2-MoE, whose MLPs are "
        "bias-free",
    )
    renormalised = router.renormalize_topk or router.softmax_after_topk
    if not dense_layers and moe.num_shared_experts == 0 and renormalised and not config.attention_bias:
        return MIXTRAL
    return QWEN2_MOE


def _deepseek_v3_architecture(config: ModelConfig, dense_layers: list[int]) -> str:
    """DEEPSEEK_V3 for an MLA model that HF's DeepSeek-V3 computes exactly, or ConversionError."""
    _refuse_if(
        config.ffn_bias and bool(dense_layers),
        "model.ffn_bias=True has no equivalent in DeepSeek-V3, whose dense MLPs are bias-free",
    )
    if config.moe is None:
        return DEEPSEEK_V3
    moe, router = config.moe, config.moe.router
    _refuse_if(
        router.score_fn != "sigmoid",
        f"moe.router.score_fn={router.score_fn!r} routing has no exact equivalent in DeepSeek-V3, which scores "
        "experts by sigmoid",
    )
    _refuse_if(
        moe.eval_capacity_factor is not None,
        f"moe.eval_capacity_factor={moe.eval_capacity_factor} drops tokens at inference, but DeepSeek-V3 is dropless",
    )
    _refuse_if(
        dense_layers != list(range(moe.first_dense_layers)),
        f"moe.moe_layer_interval={moe.moe_layer_interval} interleaves dense layers, but DeepSeek-V3's dense layers "
        "are only the first first_k_dense_replace",
    )
    _refuse_if(
        moe.num_experts // router.n_group < 2,
        f"moe.router.n_group={router.n_group} makes groups of one expert, whose score DeepSeek-V3 takes as a "
        "top-2 sum that such a group does not have",
    )
    return DEEPSEEK_V3


def _rope(config: ModelConfig) -> dict:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": float(config.rope_theta)}}


def hf_config(config: ModelConfig, **token_ids) -> object:
    """The transformers config object of `config` (see `hf_architecture`); `token_ids` (eos/bos/pad_token_id)
    go into it unchanged, and default to None so that generation never stops on an id the run never used."""
    import transformers

    arch = hf_architecture(config)
    ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **token_ids}
    common = dict(
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
        architectures=[arch],
        **_rope(config),
        **ids,
    )
    if arch == DEEPSEEK_V3:  # MLA's head widths are its own fields, not head_dim
        return _deepseek_v3_config(config, common)
    common["head_dim"] = config.head_dim
    if arch == LLAMA:
        return transformers.LlamaConfig(
            intermediate_size=config.d_ff, attention_bias=config.attention_bias, mlp_bias=config.ffn_bias, **common
        )
    moe = config.moe
    if arch == MIXTRAL:
        return transformers.MixtralConfig(
            intermediate_size=moe.expert_d_ff,
            num_local_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            router_aux_loss_coef=moe.aux_loss_coef,
            sliding_window=None,
            **common,
        )
    return transformers.Qwen2MoeConfig(
        intermediate_size=config.d_ff,
        moe_intermediate_size=moe.expert_d_ff,
        shared_expert_intermediate_size=moe.num_shared_experts * moe.expert_d_ff,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.router.renormalize_topk or moe.router.softmax_after_topk,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(config.n_layers) if not config.is_moe_layer(i)],
        qkv_bias=config.attention_bias,
        use_sliding_window=False,
        router_aux_loss_coef=moe.aux_loss_coef,
        **common,
    )


def _deepseek_v3_config(config: ModelConfig, common: dict) -> object:
    import transformers

    mla, moe = config.mla, config.moe
    if moe is None:  # every layer dense: a nominal one-expert router that no layer builds
        routing = dict(
            first_k_dense_replace=config.n_layers,
            n_routed_experts=1,
            num_experts_per_tok=1,
            moe_intermediate_size=1,
            n_shared_experts=0,
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
        )
    else:
        routing = dict(
            first_k_dense_replace=moe.first_dense_layers,
            n_routed_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            moe_intermediate_size=moe.expert_d_ff,
            n_shared_experts=moe.num_shared_experts,
            n_group=moe.router.n_group,
            topk_group=moe.router.topk_group,
            norm_topk_prob=moe.router.renormalize_topk,
            routed_scaling_factor=float(moe.router.routed_scaling_factor),
        )
    return transformers.DeepseekV3Config(
        intermediate_size=config.d_ff,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_nope_head_dim=mla.qk_nope_head_dim,
        qk_rope_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        rope_interleave=True,
        attention_bias=config.attention_bias,
        num_mtp_layers=0,
        **routing,
        **common,
    )


def _rope_permutation(rope_dim: int) -> torch.Tensor:
    """Index p with interleaved[j] = rotate_half[p[j]]: p = [0, r/2, 1, r/2 + 1, …]."""
    return torch.arange(rope_dim).view(2, rope_dim // 2).t().flatten()


def _permute_rope_rows(w: torch.Tensor, heads: int, nope: int, rope: int, to_interleaved: bool) -> torch.Tensor:
    """`w` (weight [heads·(nope + rope), …] or bias) with the last `rope` rows of every head moved between our
    rotate-half order and HF's interleaved order (module docstring)."""
    order = _rope_permutation(rope)
    if not to_interleaved:
        order = order.argsort()
    w_hx = w.reshape(heads, nope + rope, *w.shape[1:])
    index = torch.cat((torch.arange(nope), nope + order))
    return w_hx[:, index].reshape(w.shape).contiguous()


# ---- weight names: (ours, HF) per layer, for the plain 2-D tensors that are copied as they are ---------------------

_ATTN = {"w_q": "q_proj", "w_k": "k_proj", "w_v": "v_proj", "w_o": "o_proj"}
_MLP = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


def to_hf(config: ModelConfig, state_dict: dict[str, torch.Tensor], **token_ids) -> tuple[object, dict]:
    """(transformers config, state dict in transformers' in-memory layout) computing exactly what ours computes."""
    hf = hf_config(config, **token_ids)
    arch = hf.architectures[0]
    sd = state_dict
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["final_norm.weight"]}
    out["lm_head.weight"] = sd["embed.weight"] if config.tie_embeddings else sd["lm_head.weight"]
    for i in range(config.n_layers):  # the norms outside attention: every architecture names them alike
        out[f"model.layers.{i}.input_layernorm.weight"] = sd[f"blocks.{i}.attn_norm.weight"]
        out[f"model.layers.{i}.post_attention_layernorm.weight"] = sd[f"blocks.{i}.ffn_norm.weight"]
    if arch == DEEPSEEK_V3:
        return hf, {**out, **_deepseek_v3_layers_to_hf(config, sd)}
    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}", f"model.layers.{i}"
        for our_name, hf_name in _ATTN.items():
            out[f"{theirs}.self_attn.{hf_name}.weight"] = sd[f"{ours}.attn.{our_name}.weight"]
            if config.attention_bias and (arch == LLAMA or our_name != "w_o"):
                out[f"{theirs}.self_attn.{hf_name}.bias"] = sd[f"{ours}.attn.{our_name}.bias"]
        if config.attention_bias and arch != LLAMA:
            _refuse_if(
                bool(sd[f"{ours}.attn.w_o.bias"].any()),
                f"layer {i} has a non-zero attention output bias, which Qwen2-MoE (bias on Q, K, V only) lacks",
            )
        if not config.is_moe_layer(i):
            for our_name, hf_name in _MLP.items():
                out[f"{theirs}.mlp.{hf_name}.weight"] = sd[f"{ours}.ffn.{our_name}.weight"]
                if config.ffn_bias:
                    out[f"{theirs}.mlp.{hf_name}.bias"] = sd[f"{ours}.ffn.{our_name}.bias"]
            continue
        out[f"{theirs}.mlp.gate.weight"] = sd[f"{ours}.ffn.router.weight"]
        _experts_to_hf(sd, ours, theirs, out)
        if arch == QWEN2_MOE:
            shared = f"{theirs}.mlp.shared_expert"
            D, S = config.d_model, config.moe.num_shared_experts * config.moe.expert_d_ff
            dtype = out[f"{theirs}.mlp.gate.weight"].dtype
            out[f"{theirs}.mlp.shared_expert_gate.weight"] = torch.zeros(1, D, dtype=dtype)
            if S == 0:  # Qwen2-MoE always builds a shared expert: a zero-width one adds exactly 0
                for hf_name, shape in (("gate_proj", (0, D)), ("up_proj", (0, D)), ("down_proj", (D, 0))):
                    out[f"{shared}.{hf_name}.weight"] = torch.zeros(shape, dtype=dtype)
                continue
            for our_name, hf_name in _MLP.items():
                out[f"{shared}.{hf_name}.weight"] = sd[f"{ours}.ffn.shared_experts.{our_name}.weight"]
            # sigmoid(0) = 1/2 exactly; ×2 is exact in floating point, so 1/2 · (h · 2W) == h · W bit for bit.
            out[f"{shared}.down_proj.weight"] = out[f"{shared}.down_proj.weight"] * 2
    return hf, out


def _experts_to_hf(sd: dict, ours: str, theirs: str, out: dict) -> None:
    """Ours x @ w[e] with w_gate/w_up [E, D, F], w_down [E, F, D]; HF F.linear with gate_up_proj [E, 2F, D] (gate
    rows first) and down_proj [E, D, F]."""
    gate_EFD = sd[f"{ours}.ffn.experts.w_gate"].transpose(1, 2)
    up_EFD = sd[f"{ours}.ffn.experts.w_up"].transpose(1, 2)
    out[f"{theirs}.mlp.experts.gate_up_proj"] = torch.cat((gate_EFD, up_EFD), dim=1).contiguous()
    out[f"{theirs}.mlp.experts.down_proj"] = sd[f"{ours}.ffn.experts.w_down"].transpose(1, 2).contiguous()


def _experts_from_hf(sd: dict, theirs: str, ours: str, out: dict) -> None:
    gate_EFD, up_EFD = sd[f"{theirs}.mlp.experts.gate_up_proj"].chunk(2, dim=1)
    out[f"{ours}.ffn.experts.w_gate"] = gate_EFD.transpose(1, 2).contiguous()
    out[f"{ours}.ffn.experts.w_up"] = up_EFD.transpose(1, 2).contiguous()
    out[f"{ours}.ffn.experts.w_down"] = sd[f"{theirs}.mlp.experts.down_proj"].transpose(1, 2).contiguous()


def _mla_names(config: ModelConfig) -> list[tuple[str, str, bool]]:
    """(our name, HF name, whether its rows carry RoPE rows to permute) of one MLA layer's tensors."""
    if config.mla.q_lora_rank is None:
        names = [("w_q.weight", "q_proj.weight", True)]
    else:
        names = [
            ("w_q.0.weight", "q_a_proj.weight", False),
            ("w_q.1.weight", "q_a_layernorm.weight", False),
            ("w_q.2.weight", "q_b_proj.weight", True),
        ]
        if config.attention_bias:
            names.append(("w_q.0.bias", "q_a_proj.bias", False))
    names += [
        ("w_kv_down.weight", "kv_a_proj_with_mqa.weight", True),
        ("kv_norm.weight", "kv_a_layernorm.weight", False),
        ("w_kv_up.weight", "kv_b_proj.weight", False),
        ("w_o.weight", "o_proj.weight", False),
    ]
    if config.attention_bias:
        names += [("w_kv_down.bias", "kv_a_proj_with_mqa.bias", True), ("w_o.bias", "o_proj.bias", False)]
    return names


def _mla_rope_rows(config: ModelConfig, our_name: str) -> tuple[int, int, int]:
    """(heads, rows before the RoPE rows, RoPE rows) of a tensor whose RoPE rows move: the query projection per
    head [n; r], the KV down projection once [C; r]."""
    mla = config.mla
    if our_name.startswith("w_q"):
        return config.n_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim
    return 1, mla.kv_lora_rank, mla.qk_rope_head_dim


def _deepseek_v3_layers_to_hf(config: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}", f"model.layers.{i}"
        for our_name, hf_name, has_rope_rows in _mla_names(config):
            tensor = sd[f"{ours}.attn.{our_name}"]
            if has_rope_rows:
                tensor = _permute_rope_rows(tensor, *_mla_rope_rows(config, our_name), to_interleaved=True)
            out[f"{theirs}.self_attn.{hf_name}"] = tensor
        if not config.is_moe_layer(i):
            for our_name, hf_name in _MLP.items():
                out[f"{theirs}.mlp.{hf_name}.weight"] = sd[f"{ours}.ffn.{our_name}.weight"]
            continue
        router_weight = sd[f"{ours}.ffn.router.weight"]
        out[f"{theirs}.mlp.gate.weight"] = router_weight
        zero_bias = torch.zeros(config.moe.num_experts, dtype=torch.float32)  # no selection bias: chooses as ours
        out[f"{theirs}.mlp.gate.e_score_correction_bias"] = sd.get(f"{ours}.ffn.router.expert_bias", zero_bias)
        _experts_to_hf(sd, ours, theirs, out)
        D, S = config.d_model, config.moe.num_shared_experts * config.moe.expert_d_ff
        for our_name, hf_name in _MLP.items():
            shape = (S, D) if hf_name != "down_proj" else (D, S)  # a zero-width shared expert adds exactly 0
            zero = torch.zeros(shape, dtype=router_weight.dtype)
            out[f"{theirs}.mlp.shared_experts.{hf_name}.weight"] = (
                sd[f"{ours}.ffn.shared_experts.{our_name}.weight"] if S else zero
            )
    return out


def _moe_layer_pattern(moe_layers: list[bool]) -> tuple[int, int]:
    """(first_dense_layers, moe_layer_interval) that pick exactly the layers marked True, or ConversionError."""
    ids = [i for i, is_moe in enumerate(moe_layers) if is_moe]
    _refuse_if(not ids, "a model with no MoE layer should be imported as a dense model")
    first = ids[0]
    interval = ids[1] - ids[0] if len(ids) > 1 else len(moe_layers)
    expected = [i >= first and (i - first) % interval == 0 for i in range(len(moe_layers))]
    _refuse_if(
        expected != moe_layers,
        f"MoE layers {ids} are not 'first N dense, then every k-th' (moe.first_dense_layers/moe_layer_interval)",
    )
    return first, interval


def load_hf_model_dir(path: str | Path) -> tuple[object, dict[str, torch.Tensor]]:
    """(transformers config, fp32 in-memory state dict) of a model directory; transformers itself reads either
    expert layout (per-expert 2-D files or fused), and does so exactly. DeepSeek-V3's MTP tensors, which
    transformers drops, are named from the files' headers in a printed note."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32)
    if model.config.model_type == "deepseek_v3":
        from safetensors import safe_open

        names = []
        for file in sorted(Path(path).glob("*.safetensors")):
            with safe_open(file, framework="pt") as f:
                names += list(f.keys())
        _note_ignored_mtp(model.config, names)
    return model.config, model.state_dict()


def _note_ignored_mtp(hf: object, names: list[str]) -> None:
    """Print how many of `names` are DeepSeek-V3 MTP tensors: the layer indices after the last decoder layer (the
    regex transformers ignores them by is model.layers.61 for the full model's 61 layers)."""
    prefix = f"model.layers.{hf.num_hidden_layers}."
    if mtp := [name for name in names if name.startswith(prefix)]:
        print(
            f"note: ignored {len(mtp)} multi-token-prediction tensors ({prefix}*), which neither transformers' "
            "DeepseekV3ForCausalLM nor moe.Transformer models"
        )


def _shared_model_fields(hf: object, rope: dict) -> dict:
    """The ModelConfig fields every importable architecture maps alike: RoPE, RMSNorm and SwiGLU (checked)."""
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


def _embeddings_and_norms_from_hf(config: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our embedding, output head and every norm outside attention, which all architectures name alike (a tied
    model's head is its embedding, whether or not the HF state dict lists it)."""
    out = {"embed.weight": sd["model.embed_tokens.weight"], "final_norm.weight": sd["model.norm.weight"]}
    out["lm_head.weight"] = (
        out["embed.weight"] if config.tie_embeddings else sd.get("lm_head.weight", out["embed.weight"])
    )
    for i in range(config.n_layers):
        out[f"blocks.{i}.attn_norm.weight"] = sd[f"model.layers.{i}.input_layernorm.weight"]
        out[f"blocks.{i}.ffn_norm.weight"] = sd[f"model.layers.{i}.post_attention_layernorm.weight"]
    return out


def from_hf(
    hf: object | str | Path, hf_state_dict: dict[str, torch.Tensor] | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, our state dict) from a Llama, Qwen2, Mixtral, Qwen2-MoE or DeepSeek-V3 config and its
    in-memory state dict (`model.state_dict()` of a loaded transformers model), or from a model directory alone;
    refuses what ours cannot compute exactly."""
    if hf_state_dict is None:
        hf, hf_state_dict = load_hf_model_dir(hf)
    model_type = hf.model_type
    _refuse_if(
        model_type not in ("llama", "qwen2", "mixtral", "qwen2_moe", "deepseek_v3"),
        f"model_type={model_type!r} is not one of the importable architectures llama, qwen2, mixtral, qwen2_moe, "
        "deepseek_v3",
    )
    _refuse_if(hf.hidden_act != "silu", f"hidden_act={hf.hidden_act!r} is not SwiGLU's silu")
    rope = getattr(hf, "rope_parameters", None) or {"rope_type": "default", "rope_theta": hf.rope_theta}
    _refuse_if(
        rope.get("rope_type", "default") != "default",
        f"rope_parameters rope_type={rope.get('rope_type')!r} (scaled RoPE; YaRN also rescales the softmax) is not "
        "the plain RoPE moe.Transformer computes",
    )
    if model_type == "deepseek_v3":
        return _deepseek_v3_from_hf(hf, hf_state_dict, rope)
    _refuse_if(
        bool(getattr(hf, "use_sliding_window", False)) or (model_type == "mixtral" and hf.sliding_window is not None),
        "sliding-window attention has no equivalent in moe.Transformer's full causal attention",
    )
    _refuse_if(bool(getattr(hf, "mlp_bias", False)) and model_type != "llama", "mlp_bias is only mapped for Llama")
    llama_bias = model_type == "llama" and bool(hf.attention_bias)
    qkv_bias = model_type == "qwen2" or (model_type == "qwen2_moe" and bool(hf.qkv_bias))
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads

    moe = None
    d_ff = hf.intermediate_size
    moe_layers = [False] * hf.num_hidden_layers
    if model_type == "mixtral":
        _refuse_if(
            hf.num_experts_per_tok == 1, "Mixtral with top-1 routing has gate 1, which moe.router cannot express"
        )
        moe = MoEConfig(
            num_experts=hf.num_local_experts,
            top_k=hf.num_experts_per_tok,
            expert_d_ff=hf.intermediate_size,
            aux_loss_coef=hf.router_aux_loss_coef,
            router=RouterConfig(renormalize_topk=True),
        )
        moe_layers = [True] * hf.num_hidden_layers
    elif model_type == "qwen2_moe":
        moe_layers = [
            i not in hf.mlp_only_layers and hf.num_experts > 0 and (i + 1) % hf.decoder_sparse_step == 0
            for i in range(hf.num_hidden_layers)
        ]
        first, interval = _moe_layer_pattern(moe_layers)
        F, S = hf.moe_intermediate_size, hf.shared_expert_intermediate_size
        _refuse_if(
            S % F != 0,
            f"shared_expert_intermediate_size={S} is not a multiple of moe_intermediate_size={F}, so it is not a whole "
            "number of moe.num_shared_experts",
        )
        _refuse_if(
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
    config = ModelConfig(
        **_shared_model_fields(hf, rope),
        n_kv_heads=hf.num_key_value_heads,
        head_dim=head_dim,
        d_ff=d_ff,
        attention_bias=llama_bias or qkv_bias,
        ffn_bias=bool(getattr(hf, "mlp_bias", False)),
        moe=moe,
    )

    sd = hf_state_dict
    out = _embeddings_and_norms_from_hf(config, sd)
    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}", f"model.layers.{i}"
        for our_name, hf_name in _ATTN.items():
            weight = sd[f"{theirs}.self_attn.{hf_name}.weight"]
            out[f"{ours}.attn.{our_name}.weight"] = weight
            if config.attention_bias:
                zero_bias = torch.zeros(weight.shape[0], dtype=weight.dtype)  # Qwen2's O projection has no bias
                out[f"{ours}.attn.{our_name}.bias"] = sd.get(f"{theirs}.self_attn.{hf_name}.bias", zero_bias)
        if not moe_layers[i]:
            for our_name, hf_name in _MLP.items():
                out[f"{ours}.ffn.{our_name}.weight"] = sd[f"{theirs}.mlp.{hf_name}.weight"]
                if config.ffn_bias:
                    out[f"{ours}.ffn.{our_name}.bias"] = sd[f"{theirs}.mlp.{hf_name}.bias"]
            continue
        out[f"{ours}.ffn.router.weight"] = sd[f"{theirs}.mlp.gate.weight"]
        _experts_from_hf(sd, theirs, ours, out)
        if model_type == "qwen2_moe":
            _refuse_if(
                bool(sd[f"{theirs}.mlp.shared_expert_gate.weight"].any()),
                f"layer {i}'s shared_expert_gate is not zero: a per-token sigmoid gate on the shared expert has no "
                "equivalent in moe-platform's ungated shared experts",
            )
            if config.moe.num_shared_experts:
                shared = f"{theirs}.mlp.shared_expert"
                for our_name, hf_name in _MLP.items():
                    out[f"{ours}.ffn.shared_experts.{our_name}.weight"] = sd[f"{shared}.{hf_name}.weight"]
                out[f"{ours}.ffn.shared_experts.w_down.weight"] = sd[f"{shared}.down_proj.weight"] / 2  # gate = 1/2
    return config, out


def _deepseek_v3_from_hf(
    hf: object, sd: dict[str, torch.Tensor], rope: dict
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The DeepSeek-V3 half of `from_hf` (module docstring: decisions); activation and RoPE already checked."""
    _refuse_if(
        hf.num_key_value_heads != hf.num_attention_heads,
        f"num_key_value_heads={hf.num_key_value_heads} differs from num_attention_heads={hf.num_attention_heads}, "
        "so transformers would repeat MLA's per-head keys, which moe.Transformer never does",
    )
    L = hf.num_hidden_layers
    first = min(hf.first_k_dense_replace or 0, L)
    moe = None
    if first < L:
        E, n_group, topk_group = hf.n_routed_experts, hf.n_group or 1, hf.topk_group or 1
        _refuse_if(
            E // n_group < 2,
            f"n_group={n_group} makes groups of one of n_routed_experts={E}, which transformers cannot score (it "
            "sums each group's top 2)",
        )
        _refuse_if(
            bool(hf.norm_topk_prob) and hf.num_experts_per_tok == 1,
            "DeepSeek-V3 with top-1 routing and norm_topk_prob has a constant gate, which moe.router cannot express",
        )
        moe = MoEConfig(
            num_experts=E,
            top_k=hf.num_experts_per_tok,
            expert_d_ff=hf.moe_intermediate_size,
            num_shared_experts=hf.n_shared_experts,
            first_dense_layers=first,
            router=RouterConfig(
                score_fn="sigmoid",
                renormalize_topk=bool(hf.norm_topk_prob),
                bias_update_rate=DEEPSEEK_V3_BIAS_UPDATE_RATE,
                n_group=n_group,
                topk_group=topk_group,
                routed_scaling_factor=float(hf.routed_scaling_factor),
            ),
        )
    heads = hf.num_attention_heads
    config = ModelConfig(
        **_shared_model_fields(hf, rope),
        head_dim=None if hf.hidden_size % heads == 0 else hf.v_head_dim,  # MLA's shapes are all in `mla`
        attention="mla",
        mla=MLAConfig(
            q_lora_rank=hf.q_lora_rank,
            kv_lora_rank=hf.kv_lora_rank,
            qk_nope_head_dim=hf.qk_nope_head_dim,
            qk_rope_head_dim=hf.qk_rope_head_dim,
            v_head_dim=hf.v_head_dim,
        ),
        d_ff=hf.intermediate_size,
        attention_bias=bool(hf.attention_bias),
        moe=moe,
    )
    _note_ignored_mtp(hf, list(sd))

    out = _embeddings_and_norms_from_hf(config, sd)
    interleaved = hf.rope_interleave is not False  # transformers' default is True
    for i in range(L):
        ours, theirs = f"blocks.{i}", f"model.layers.{i}"
        for our_name, hf_name, has_rope_rows in _mla_names(config):
            tensor = sd[f"{theirs}.self_attn.{hf_name}"]
            if has_rope_rows and interleaved:
                tensor = _permute_rope_rows(tensor, *_mla_rope_rows(config, our_name), to_interleaved=False)
            out[f"{ours}.attn.{our_name}"] = tensor
        if i < first:
            for our_name, hf_name in _MLP.items():
                out[f"{ours}.ffn.{our_name}.weight"] = sd[f"{theirs}.mlp.{hf_name}.weight"]
            continue
        out[f"{ours}.ffn.router.weight"] = sd[f"{theirs}.mlp.gate.weight"]
        out[f"{ours}.ffn.router.expert_bias"] = sd[f"{theirs}.mlp.gate.e_score_correction_bias"].float()
        out[f"{ours}.ffn.router.load_since_update"] = torch.zeros(moe.num_experts, dtype=torch.int64)
        _experts_from_hf(sd, theirs, ours, out)
        shared = f"{theirs}.mlp.shared_experts"
        if moe.num_shared_experts:
            for our_name, hf_name in _MLP.items():
                out[f"{ours}.ffn.shared_experts.{our_name}.weight"] = sd[f"{shared}.{hf_name}.weight"]
    return config, out
