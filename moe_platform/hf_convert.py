"""Exact conversion between `moe.Transformer` state dicts and Hugging Face transformers causal LMs.

Legend: D model width, F (expert) hidden width, E routed experts, L layers.

Which architecture (`hf_architecture`): dense → Llama; MoE on every layer, no shared experts, renormalised top-k,
no attention bias → Mixtral; any other representable MoE → Qwen2-MoE. A config that no architecture computes
exactly is refused with one sentence (`ConversionError`), never exported approximately.

Decisions that keep the logits exact (fp32, up to summation order):
  * Routing. Ours with softmax over all E then top-k then renormalise (or softmax over the top-k logits, the same
    numbers) is Mixtral's router and Qwen2-MoE's `norm_topk_prob=True`; without renormalisation it is Qwen2-MoE's
    `norm_topk_prob=False`. Sigmoid scores and the aux-loss-free selection bias change which experts are chosen and
    no architecture here has them: refused. Jitter, aux loss and z-loss act only in training: dropped.
  * Capacity. HF MoE layers are dropless. `capacity_factor` drops tokens only in training; `eval_capacity_factor`
    drops them at inference too, so a model evaluated with one is refused (its own eval logits would differ).
  * Shared experts. Qwen2-MoE gates its shared expert by sigmoid(x·g); ours are ungated. With g = 0 the gate is
    exactly 1/2, so the export writes g = 0 and the shared down projection ×2 (a power of two: bit-exact); an
    import accepts only g = 0 and halves it back. A non-zero gate is refused.
  * Attention bias. Ours biases Q, K, V and O. Llama does the same; Qwen2 / Qwen2-MoE bias Q, K, V only, so their
    import sets the O bias to zero, and a Qwen2-MoE export needs every O bias to be zero.
  * Interleaved dense layers map to Qwen2-MoE `mlp_only_layers` (with `decoder_sparse_step=1`), which names any set.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moe.config import ModelConfig
from moe.errors import ModelConfigError
from moe.moe_config import MoEConfig, RouterConfig


class ConversionError(ModelConfigError):
    """A model that no supported transformers architecture represents exactly; one sentence names the feature."""


LLAMA, MIXTRAL, QWEN2_MOE, QWEN2 = "LlamaForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen2ForCausalLM"


def _refuse_if(condition: bool, message: str) -> None:
    if condition:
        raise ConversionError(message)


def hf_architecture(config: ModelConfig) -> str:
    """The transformers class name that computes exactly what `config` computes at inference, or ConversionError."""
    _refuse_if(
        config.pos_encoding != "rope",
        f"model.pos_encoding={config.pos_encoding!r} (learned absolute positions) has no exact equivalent in "
        "Llama/Mixtral/Qwen2-MoE, which use RoPE",
    )
    _refuse_if(
        config.norm != "rmsnorm",
        f"model.norm={config.norm!r} has no exact equivalent in Llama/Mixtral/Qwen2-MoE, which use RMSNorm",
    )
    _refuse_if(
        config.activation != "swiglu",
        f"model.activation={config.activation!r} has no exact equivalent in Llama/Mixtral/Qwen2-MoE, which use SwiGLU",
    )
    if config.moe is None:
        return LLAMA
    moe, router = config.moe, config.moe.router
    _refuse_if(
        router.score_fn != "softmax",
        f"moe.router.score_fn={router.score_fn!r} routing has no exact equivalent in Mixtral/Qwen2-MoE, "
        "which route by softmax",
    )
    _refuse_if(
        router.bias_update_rate > 0,
        "moe.router.bias_update_rate>0 (aux-loss-free balancing) adds a selection bias to top-k that "
        "Mixtral/Qwen2-MoE routers do not have",
    )
    _refuse_if(
        moe.eval_capacity_factor is not None,
        f"moe.eval_capacity_factor={moe.eval_capacity_factor} drops tokens at inference, but Mixtral/Qwen2-MoE "
        "are dropless",
    )
    _refuse_if(
        config.ffn_bias and any(not config.is_moe_layer(i) for i in range(config.n_layers)),
        "model.ffn_bias=True in the dense layers of a MoE model has no equivalent in Qwen2-MoE, whose MLPs are "
        "bias-free",
    )
    renormalised = router.renormalize_topk or router.softmax_after_topk
    every_layer_moe = all(config.is_moe_layer(i) for i in range(config.n_layers))
    if every_layer_moe and moe.num_shared_experts == 0 and renormalised and not config.attention_bias:
        return MIXTRAL
    return QWEN2_MOE


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
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        hidden_act="silu",
        tie_word_embeddings=config.tie_embeddings,
        initializer_range=config.init_std,
        architectures=[arch],
        **_rope(config),
        **ids,
    )
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
    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}", f"model.layers.{i}"
        out[f"{theirs}.input_layernorm.weight"] = sd[f"{ours}.attn_norm.weight"]
        out[f"{theirs}.post_attention_layernorm.weight"] = sd[f"{ours}.ffn_norm.weight"]
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
        # Experts: ours x @ w[e] with w_gate/w_up [E, D, F], w_down [E, F, D]; HF F.linear with gate_up_proj
        # [E, 2F, D] (gate rows first) and down_proj [E, D, F].
        out[f"{theirs}.mlp.gate.weight"] = sd[f"{ours}.ffn.router.weight"]
        gate_EFD = sd[f"{ours}.ffn.experts.w_gate"].transpose(1, 2)
        up_EFD = sd[f"{ours}.ffn.experts.w_up"].transpose(1, 2)
        out[f"{theirs}.mlp.experts.gate_up_proj"] = torch.cat((gate_EFD, up_EFD), dim=1).contiguous()
        out[f"{theirs}.mlp.experts.down_proj"] = sd[f"{ours}.ffn.experts.w_down"].transpose(1, 2).contiguous()
        if arch == QWEN2_MOE:
            shared = f"{theirs}.mlp.shared_expert"
            D, S = config.d_model, config.moe.num_shared_experts * config.moe.expert_d_ff
            out[f"{theirs}.mlp.shared_expert_gate.weight"] = torch.zeros(1, D, dtype=gate_EFD.dtype)
            if S == 0:  # Qwen2-MoE always builds a shared expert: a zero-width one adds exactly 0
                for hf_name, shape in (("gate_proj", (0, D)), ("up_proj", (0, D)), ("down_proj", (D, 0))):
                    out[f"{shared}.{hf_name}.weight"] = torch.zeros(shape, dtype=gate_EFD.dtype)
                continue
            for our_name, hf_name in _MLP.items():
                out[f"{shared}.{hf_name}.weight"] = sd[f"{ours}.ffn.shared_experts.{our_name}.weight"]
            # sigmoid(0) = 1/2 exactly; ×2 is exact in floating point, so 1/2 · (h · 2W) == h · W bit for bit.
            out[f"{shared}.down_proj.weight"] = out[f"{shared}.down_proj.weight"] * 2
    return hf, out


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
    expert layout (per-expert 2-D files or fused), and does so exactly."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32)
    return model.config, model.state_dict()


def from_hf(
    hf: object | str | Path, hf_state_dict: dict[str, torch.Tensor] | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, our state dict) from a Llama, Qwen2, Mixtral or Qwen2-MoE config and its in-memory state dict
    (`model.state_dict()` of a loaded transformers model), or from a model directory alone; refuses what ours
    cannot compute exactly."""
    if hf_state_dict is None:
        hf, hf_state_dict = load_hf_model_dir(hf)
    model_type = hf.model_type
    _refuse_if(
        model_type not in ("llama", "qwen2", "mixtral", "qwen2_moe"),
        f"model_type={model_type!r} is not one of the importable architectures llama, qwen2, mixtral, qwen2_moe",
    )
    _refuse_if(hf.hidden_act != "silu", f"hidden_act={hf.hidden_act!r} is not SwiGLU's silu")
    rope = getattr(hf, "rope_parameters", None) or {"rope_type": "default", "rope_theta": hf.rope_theta}
    _refuse_if(
        rope.get("rope_type", "default") != "default", f"rope scaling {rope.get('rope_type')!r} is not plain RoPE"
    )
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
        vocab_size=hf.vocab_size,
        d_model=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        n_heads=hf.num_attention_heads,
        n_kv_heads=hf.num_key_value_heads,
        head_dim=head_dim,
        d_ff=d_ff,
        max_seq_len=hf.max_position_embeddings,
        pos_encoding="rope",
        rope_theta=float(rope["rope_theta"]),
        norm="rmsnorm",
        norm_eps=hf.rms_norm_eps,
        activation="swiglu",
        attention_bias=llama_bias or qkv_bias,
        ffn_bias=bool(getattr(hf, "mlp_bias", False)),
        tie_embeddings=bool(hf.tie_word_embeddings),
        init_std=hf.initializer_range,
        moe=moe,
    )

    sd = hf_state_dict
    out = {"embed.weight": sd["model.embed_tokens.weight"], "final_norm.weight": sd["model.norm.weight"]}
    out["lm_head.weight"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    if config.tie_embeddings:
        out["lm_head.weight"] = out["embed.weight"]
    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}", f"model.layers.{i}"
        out[f"{ours}.attn_norm.weight"] = sd[f"{theirs}.input_layernorm.weight"]
        out[f"{ours}.ffn_norm.weight"] = sd[f"{theirs}.post_attention_layernorm.weight"]
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
        gate_up_E2FD = sd[f"{theirs}.mlp.experts.gate_up_proj"]
        gate_EFD, up_EFD = gate_up_E2FD.chunk(2, dim=1)
        out[f"{ours}.ffn.experts.w_gate"] = gate_EFD.transpose(1, 2).contiguous()
        out[f"{ours}.ffn.experts.w_up"] = up_EFD.transpose(1, 2).contiguous()
        out[f"{ours}.ffn.experts.w_down"] = sd[f"{theirs}.mlp.experts.down_proj"].transpose(1, 2).contiguous()
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
