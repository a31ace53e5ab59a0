"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): every MLA model, dense or MoE.

Legend: H heads, n content and r RoPE dims per query/key head, C the KV latent, L layers, E routed experts.

Decisions that keep the logits exact (fp32, up to summation order):
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
    of one expert (HF takes the top-2 of every group, ours the group's one score). DeepSeek-V3 has only MLA, so these
    router features on a GQA model are refused (common.refuse_what_gqa_moe_lacks).
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
  * MTP. The checkpoint's multi-token-prediction module k is layer L + k - 1, `model.layers.{L+k-1}.*`: a decoder
    layer (built like the last one) plus enorm, hnorm, eh_proj, shared_head.norm, and copies of the shared
    embedding (embed_tokens) and head (shared_head.head). Ours is `mtp.{k-1}` (moe/mtp.py): `num_mtp_layers` =
    model.mtp.depth both ways. eh_proj reads [enorm(e) ; hnorm(h)], ours M_k [RMSNorm(h) ; RMSNorm(e)] as the
    paper writes it, so the two column halves swap. The copies are written on export and not read on import (ours
    shares the one embedding and head). transformers' causal LM builds no MTP module and does not load these
    tensors, so `to_hf`'s state has them beside the ones it loads (`split_mtp`) and moe-export writes them to a file
    of their own. A checkpoint whose config says num_mtp_layers=0 but holds such tensors has them ignored, with a
    printed note naming how many.
  * Inference only: our MLA's `absorb_decode` changes no number HF computes and is not written; an import takes
    the default.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from moe.config import ModelConfig
from moe.mla_config import MLAConfig
from moe.moe_config import MoEConfig, RouterConfig
from moe.mtp_config import MTPConfig
from moe_platform.interop.hf.common import (
    dense_layers,
    dense_mlp_from_hf,
    dense_mlp_to_hf,
    experts_from_hf,
    experts_to_hf,
    permute_rope_rows,
    refuse_if,
)
from moe_platform.interop.hf.tensors import HFTensors, Reader

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
DEEPSEEK_V3_BIAS_UPDATE_RATE = 1e-3  # DeepSeek-V3's γ, set on import so that e_score_correction_bias is kept


def represents(config: ModelConfig) -> bool:
    """Whether this is an MLA model, which only DeepSeek-V3 has; refuses one that DeepSeek-V3 does not compute."""
    if config.attention != "mla":
        return False
    layers = dense_layers(config)
    refuse_if(
        config.ffn_bias and bool(layers),
        "model.ffn_bias=True has no equivalent in DeepSeek-V3, whose dense MLPs are bias-free",
    )
    if config.moe is None:
        return True
    moe, router = config.moe, config.moe.router
    refuse_if(
        router.score_fn != "sigmoid",
        f"moe.router.score_fn={router.score_fn!r} routing has no exact equivalent in DeepSeek-V3, which scores "
        "experts by sigmoid",
    )
    refuse_if(
        moe.eval_capacity_factor is not None,
        f"moe.eval_capacity_factor={moe.eval_capacity_factor} drops tokens at inference, but DeepSeek-V3 is dropless",
    )
    refuse_if(
        layers != list(range(moe.first_dense_layers)),
        f"moe.moe_layer_interval={moe.moe_layer_interval} interleaves dense layers, but DeepSeek-V3's dense layers "
        "are only the first first_k_dense_replace",
    )
    refuse_if(
        moe.num_experts // router.n_group < 2,
        f"moe.router.n_group={router.n_group} makes groups of one expert, whose score DeepSeek-V3 takes as a "
        "top-2 sum that such a group does not have",
    )
    return True


def config_to_hf(config: ModelConfig, common: dict) -> object:
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
        num_mtp_layers=config.mtp.depth,
        **routing,
        **common,
    )


def config_from_hf(hf: object, fields: dict) -> ModelConfig:
    """A DeepSeek-V3 config as ours (`fields`: the shared ones; activation and RoPE already checked)."""
    refuse_if(
        hf.num_key_value_heads != hf.num_attention_heads,
        f"num_key_value_heads={hf.num_key_value_heads} differs from num_attention_heads={hf.num_attention_heads}, "
        "so transformers would repeat MLA's per-head keys, which moe.Transformer never does",
    )
    L = hf.num_hidden_layers
    first = min(hf.first_k_dense_replace or 0, L)
    moe = None
    if first < L:
        E, n_group, topk_group = hf.n_routed_experts, hf.n_group or 1, hf.topk_group or 1
        refuse_if(
            E // n_group < 2,
            f"n_group={n_group} makes groups of one of n_routed_experts={E}, which transformers cannot score (it "
            "sums each group's top 2)",
        )
        refuse_if(
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
    return ModelConfig(
        **fields,
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
        mtp=MTPConfig(depth=hf.num_mtp_layers or 0),
    )


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


def weights_to_hf(config: ModelConfig, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(config.n_layers):
        out |= _layer_to_hf(config, sd, i, f"blocks.{i}", f"model.layers.{i}")
    for k in range(1, config.mtp.depth + 1):
        ours, theirs = f"mtp.{k - 1}", f"model.layers.{config.n_layers + k - 1}"
        for hf_name, tensor in _mtp_layer_norms_to_hf(sd, ours).items():
            out[f"{theirs}.{hf_name}"] = tensor
        hidden_DD, embed_DD = sd[f"{ours}.proj.weight"].chunk(2, dim=1)
        out[f"{theirs}.eh_proj.weight"] = torch.cat((embed_DD, hidden_DD), dim=1)  # [e ; h] (module docstring)
        out[f"{theirs}.embed_tokens.weight"] = sd["embed.weight"]
        out[f"{theirs}.shared_head.head.weight"] = sd["embed.weight" if config.tie_embeddings else "lm_head.weight"]
        out |= _layer_to_hf(config, sd, config.n_layers + k - 1, f"{ours}.block", theirs)
    return out


def _mtp_layer_norms_to_hf(sd: Mapping[str, torch.Tensor], ours: str) -> dict[str, torch.Tensor]:
    """MTP module `ours`'s norms under their HF names (its block's two norms among them)."""
    return {f"{hf_name}.weight": sd[f"{ours}.{our_name}.weight"] for our_name, hf_name in _MTP_NORMS.items()}


# our name inside mtp.{k-1} → HF's inside model.layers.{L+k-1}
_MTP_NORMS = {
    "embed_norm": "enorm",
    "hidden_norm": "hnorm",
    "norm": "shared_head.norm",
    "block.attn_norm": "input_layernorm",
    "block.ffn_norm": "post_attention_layernorm",
}


def split_mtp(config: ModelConfig, hf_state: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
    """(what transformers' causal LM loads, the MTP layers it does not) of `to_hf`'s state."""
    prefixes = tuple(f"model.layers.{config.n_layers + k}." for k in range(config.mtp.depth))
    main = {name: tensor for name, tensor in hf_state.items() if not name.startswith(prefixes)}
    return main, {name: tensor for name, tensor in hf_state.items() if name.startswith(prefixes)}


def _layer_to_hf(config: ModelConfig, sd: Mapping[str, torch.Tensor], i: int, ours: str, theirs: str) -> dict:
    """Block `ours` (layer i, or an MTP module's block when i >= L) as HF's decoder layer `theirs`, norms apart."""
    out = {}
    for our_name, hf_name, has_rope_rows in _mla_names(config):
        tensor = sd[f"{ours}.attn.{our_name}"]
        if has_rope_rows:
            tensor = permute_rope_rows(tensor, *_mla_rope_rows(config, our_name), to_interleaved=True)
        out[f"{theirs}.self_attn.{hf_name}"] = tensor
    if not config.is_moe_layer(i):
        out |= dense_mlp_to_hf(sd, f"{ours}.ffn", f"{theirs}.mlp", bias=False)
        return out
    router_ED = sd[f"{ours}.ffn.router.weight"]
    out[f"{theirs}.mlp.gate.weight"] = router_ED
    zero_bias_E = torch.zeros(config.moe.num_experts, dtype=torch.float32)  # no selection bias: chooses as ours
    out[f"{theirs}.mlp.gate.e_score_correction_bias"] = sd.get(f"{ours}.ffn.router.expert_bias", zero_bias_E)
    out |= experts_to_hf(sd, f"{ours}.ffn.experts", f"{theirs}.mlp.experts")
    D, S = config.d_model, config.moe.num_shared_experts * config.moe.expert_d_ff
    if S:
        out |= dense_mlp_to_hf(sd, f"{ours}.ffn.shared_experts", f"{theirs}.mlp.shared_experts", bias=False)
        return out
    for hf_name, shape in (("gate_proj", (S, D)), ("up_proj", (S, D)), ("down_proj", (D, S))):
        # a zero-width shared expert adds exactly 0
        out[f"{theirs}.mlp.shared_experts.{hf_name}.weight"] = torch.zeros(shape, dtype=router_ED.dtype)
    return out


def weights_from_hf(config: ModelConfig, hf: object, tensors: HFTensors) -> dict[str, Reader]:
    if not config.mtp.depth:
        note_ignored_mtp(hf, tensors.names())
    interleaved = hf.rope_interleave is not False  # transformers' default is True
    out = {}
    for i in range(config.n_layers):
        out |= _layer_from_hf(config, tensors, interleaved, i, f"blocks.{i}", f"model.layers.{i}")
    for k in range(1, config.mtp.depth + 1):
        ours, theirs = f"mtp.{k - 1}", f"model.layers.{config.n_layers + k - 1}"
        for our_name, hf_name in _MTP_NORMS.items():
            out[f"{ours}.{our_name}.weight"] = tensors.reader(f"{theirs}.{hf_name}.weight")
        out[f"{ours}.proj.weight"] = _hidden_first(tensors.reader(f"{theirs}.eh_proj.weight"))
        out |= _layer_from_hf(config, tensors, interleaved, config.n_layers + k - 1, f"{ours}.block", theirs)
    return out


def _hidden_first(reader: Reader) -> Reader:
    """eh_proj's [e ; h] columns as our M_k's [h ; e] (module docstring)."""

    def read() -> torch.Tensor:
        embed_DD, hidden_DD = reader().chunk(2, dim=1)
        return torch.cat((hidden_DD, embed_DD), dim=1)

    return read


def _layer_from_hf(config: ModelConfig, tensors: HFTensors, interleaved: bool, i: int, ours: str, theirs: str) -> dict:
    """HF's decoder layer `theirs` as our block `ours` (layer i, or an MTP module's block when i >= L), norms apart."""
    out = {}
    for our_name, hf_name, has_rope_rows in _mla_names(config):
        reader = tensors.reader(f"{theirs}.self_attn.{hf_name}")
        if has_rope_rows and interleaved:
            reader = _rotate_half_rows(reader, _mla_rope_rows(config, our_name))
        out[f"{ours}.attn.{our_name}"] = reader
    if not config.is_moe_layer(i):
        out |= dense_mlp_from_hf(tensors, f"{theirs}.mlp", f"{ours}.ffn", bias=False)
        return out
    E = config.moe.num_experts
    out[f"{ours}.ffn.router.weight"] = tensors.reader(f"{theirs}.mlp.gate.weight")
    bias = tensors.reader(f"{theirs}.mlp.gate.e_score_correction_bias")
    out[f"{ours}.ffn.router.expert_bias"] = lambda bias=bias: bias().float()
    out[f"{ours}.ffn.router.load_since_update"] = lambda E=E: torch.zeros(E, dtype=torch.int64)
    out |= experts_from_hf(tensors, f"{theirs}.mlp.experts", f"{ours}.ffn.experts", E)
    if config.moe.num_shared_experts:
        out |= dense_mlp_from_hf(tensors, f"{theirs}.mlp.shared_experts", f"{ours}.ffn.shared_experts", bias=False)
    return out


def _rotate_half_rows(reader: Reader, rope_rows: tuple[int, int, int]) -> Reader:
    """`reader`'s tensor with its RoPE rows moved from HF's interleaved order back to ours (module docstring)."""
    return lambda: permute_rope_rows(reader(), *rope_rows, to_interleaved=False)


def note_ignored_mtp(hf: object, names: Iterable[str]) -> None:
    """Print how many of `names` are DeepSeek-V3 MTP tensors: the layer indices after the last decoder layer (the
    regex transformers ignores them by is model.layers.61 for the full model's 61 layers)."""
    prefix = f"model.layers.{hf.num_hidden_layers}."
    if mtp := [name for name in names if name.startswith(prefix)]:
        print(
            f"note: ignored {len(mtp)} multi-token-prediction tensors ({prefix}*), which neither transformers' "
            "DeepseekV3ForCausalLM nor moe.Transformer models"
        )
