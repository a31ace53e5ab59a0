"""Sparse upcycling: the state dict of an MoE model whose experts start as copies of a dense model's FFNs.

Legend: D model width, F the dense FFN's hidden width, f the expert width (moe.expert_d_ff), m = F / f the
granularity, S shared experts, E routed experts.

A dense FFN is a sum over its hidden units (the activation acts per unit, w_down sums them), so cutting its F units
into m disjoint slices of f units gives FFN(x) = Σ_j slice_j(x) exactly, and scaling a slice's w_down by c scales
its output by c. The routed part of an MoE layer, Σ_{k in top-K} g_k Expert_k(x), equals R(x) for *any* routing
whose gates sum to one (renormalised top-k, softmax after top-k) exactly when every routed expert is the same R.
So the layer reproduces the dense FFN for every token when the S shared experts and the one routed "slot" are
S + 1 pieces of width f that sum to it. With `routed_scaling_factor` ρ (DeepSeek-V3) the gates sum to ρ, not one,
so every routed expert's w_down is further scaled by 1/ρ (the shared experts are not gated and keep their scale):

  * exact (S + 1 a multiple of m; e.g. f = F with any S, or F = (S + 1)·f): piece p = slice (p mod m) with w_down
    scaled by m / (S + 1); shared expert s = piece s, every routed expert = piece S. Logits equal the dense
    model's for any router, given gates that sum to one and no dropped tokens.
  * fine-grained (m > S + 1, e.g. F = 4f without shared experts): there are not enough pieces of width f, so no
    init is exact for every routing. Shared expert s = slice s; routed expert e = slice S + (e mod (m − S)) scaled
    by m − S (the virtual-group init of "Upcycling Large Language Models into Mixture of Experts", 2024).
    The dense FFN is reproduced exactly when a token's gates are 1/(m − S) on one expert of each of the m − S
    slice groups (e.g. K = E = m − S with equal router logits), and in expectation under uniformly random routing;
    a freshly initialised router is close to that, not at it.
  * anything else (S + 1 not a multiple of m ≤ S + 1, or f not dividing F) is refused.

The router is drawn fresh (N(0, init_std²) from `seed`), the aux-loss-free balancing bias and its load counter
start at zero, and every other tensor (embeddings, attention, norms, dense layers' FFNs, lm_head) is copied by
name, whatever the attention's parameters are (GQA's w_q/w_k/w_v/w_o, MLA's latents and norms).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from moe.config import ModelConfig
from moe.errors import ModelConfigError


def upcycle_state_dict(
    dense_config: ModelConfig, dense_state: Mapping[str, torch.Tensor], moe_config: ModelConfig, seed: int = 0
) -> dict[str, torch.Tensor]:
    """The state dict of `Transformer(moe_config)` upcycled from a dense model's (see the module docstring)."""
    check_upcycle_configs(dense_config, moe_config)
    moe = moe_config.moe
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    # The MTP modules' blocks (moe/mtp.py) are upcycled like the layers.
    blocks = [f"blocks.{i}" for i in range(moe_config.n_layers)] + [
        f"mtp.{k}.block" for k in range(moe_config.mtp.depth)
    ]
    moe_prefixes = tuple(f"{name}.ffn." for i, name in enumerate(blocks) if moe_config.is_moe_layer(i))
    for name in dense_state:  # by name: a lazy source reads each tensor only when asked, the FFNs below
        if not name.startswith(moe_prefixes):
            state[name] = dense_state[name].detach().clone()
    for prefix in moe_prefixes:
        w_gate_FD = dense_state.get(prefix + "w_gate.weight")  # nn.Linear stores [out, in]
        w_up_FD = dense_state[prefix + "w_up.weight"]
        w_down_DF = dense_state[prefix + "w_down.weight"]
        routed, shared = _pieces(moe_config.d_ff, moe.expert_d_ff, moe.num_shared_experts, moe.num_experts)
        # The routed gates sum to ρ = routed_scaling_factor: the routed slot carries its piece divided by ρ.
        routed = [(units, scale / moe.router.routed_scaling_factor) for units, scale in routed]
        # Experts store [E, D, f] / [E, f, D]: the transposes of the dense Linear weights' slices.
        for proj, weight_FD in (("w_gate", w_gate_FD), ("w_up", w_up_FD)):
            if weight_FD is not None:
                state[f"{prefix}experts.{proj}"] = torch.stack([weight_FD[units].T for units, _ in routed])
        state[f"{prefix}experts.w_down"] = torch.stack([scale * w_down_DF[:, units].T for units, scale in routed])
        if shared:  # the S shared experts are one fused FFN of width S·f
            units = torch.cat([torch.arange(u.start, u.stop) for u, _ in shared])
            scales_F = torch.cat([torch.full((u.stop - u.start,), s, dtype=w_down_DF.dtype) for u, s in shared])
            if w_gate_FD is not None:
                state[f"{prefix}shared_experts.w_gate.weight"] = w_gate_FD[units].clone()
            state[f"{prefix}shared_experts.w_up.weight"] = w_up_FD[units].clone()
            state[f"{prefix}shared_experts.w_down.weight"] = w_down_DF[:, units] * scales_F
        router_ED = torch.empty(moe.num_experts, moe_config.d_model, dtype=w_up_FD.dtype)
        state[f"{prefix}router.weight"] = router_ED.normal_(0.0, moe_config.init_std, generator=generator)
        if moe.router.bias_update_rate > 0:
            state[f"{prefix}router.expert_bias"] = torch.zeros(moe.num_experts)
            state[f"{prefix}router.load_since_update"] = torch.zeros(moe.num_experts, dtype=torch.int64)
    return state


def _pieces(d_ff: int, expert_d_ff: int, num_shared: int, num_routed: int) -> tuple[list, list]:
    """([(hidden-unit slice, w_down scale)] per routed expert, the same per shared expert), by the module's rule."""
    m = d_ff // expert_d_ff

    def piece(j: int, scale: float) -> tuple[slice, float]:
        return slice(j * expert_d_ff, (j + 1) * expert_d_ff), scale

    if (num_shared + 1) % m == 0:  # exact: S + 1 pieces, each a slice scaled by m / (S + 1)
        scale = m / (num_shared + 1)
        shared = [piece(p % m, scale) for p in range(num_shared)]
        return [piece(num_shared % m, scale)] * num_routed, shared
    groups = m - num_shared  # fine-grained: m − S slice groups among the routed experts
    shared = [piece(s, 1.0) for s in range(num_shared)]
    return [piece(num_shared + e % groups, float(groups)) for e in range(num_routed)], shared


def check_upcycle_configs(dense_config: ModelConfig, moe_config: ModelConfig) -> None:
    """Refuse, in one sentence, a dense/MoE pair that upcycling cannot map: anything but the FFN differs, or the
    expert width does not split the dense FFN by the module docstring's rule."""
    if dense_config.moe is not None:
        raise ModelConfigError(
            "the upcycling source already has MoE layers (its model.moe is set): start from a dense model"
        )
    if moe_config.moe is None:
        raise ModelConfigError("upcycling needs MoE layers but the target's model.moe is null: give it an MoE config")
    for field in dataclasses.fields(ModelConfig):
        if field.name in ("moe", "init_std", "dropout", "max_seq_len"):  # the FFN, or no weight's shape or value
            continue
        dense_value, moe_value = getattr(dense_config, field.name), getattr(moe_config, field.name)
        if field.name == "mla" and dense_value is not None and moe_value is not None:
            # absorb_decode chooses how a cached decode runs, not a weight: the run may set it its own way.
            moe_value = dataclasses.replace(moe_value, absorb_decode=dense_value.absorb_decode)
        if dense_value != moe_value:
            raise ModelConfigError(
                f"model.{field.name}={moe_value!r} differs from the dense source's {dense_value!r}: upcycling changes "
                f"only the FFN, so set model.{field.name}={dense_value!r}"
            )
    if dense_config.ffn_bias:
        raise ModelConfigError(
            "the dense source has model.ffn_bias=true but experts have no biases: upcycle a bias-free dense model"
        )
    moe = moe_config.moe
    d_ff, f, s = dense_config.d_ff, moe.expert_d_ff, moe.num_shared_experts
    if f > d_ff or d_ff % f:
        raise ModelConfigError(
            f"moe.expert_d_ff={f} does not divide the dense model.d_ff={d_ff} into whole expert slices: "
            f"use a divisor of {d_ff}"
        )
    m = d_ff // f
    if m <= s + 1 and (s + 1) % m:
        raise ModelConfigError(
            f"moe.num_shared_experts={s} with {m} slices of width {f} (d_ff={d_ff}) cannot share the dense FFN "
            f"evenly: use num_shared_experts+1 a multiple of {m} (e.g. {m - 1}) or fewer than {m - 1} shared experts"
        )
