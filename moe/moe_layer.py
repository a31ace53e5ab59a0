"""The top-k routed expert layer: route, dispatch under capacity, run experts, combine, plus losses and stats.

Legend: B batch, T positions per sequence, N tokens routed in the micro-batch (the B·T positions, or only the
real ones under a token mask), D model width, E experts, K experts per token, A kept assignments.

    out_n = Σ_{e in kept top-K(n)} g_ne · Expert_e(x_n) + Σ_shared SharedExpert(x_n)

Gradient accumulation and data parallelism (how the numbers stay right per optimizer step):
  * `aux_loss` and `z_loss` are means over this micro-batch's tokens, like the LM loss: the trainer adds them to
    the LM loss and scales the sum by 1/grad_accum, so the step optimises the mean of per-micro-batch losses.
    (Balance is thus enforced per micro-batch and per rank, as in Switch/Megatron/OLMo; it is not the loss of the
    pooled global batch, which would need counts from micro-batches not yet run. Padding never counts.)
  * `stats` holds raw sums (counts, entropy sum, loss sums, number of micro-batches). The trainer adds the stats of
    all micro-batches (`a + b`) and, for a global view, all-reduces `to_vector()` over data-parallel ranks; then
    `summarize()` computes ratios (drop fraction, max/mean, CV, mean entropy, mean losses) from the summed counts,
    which is exact for the step, whereas averaging per-micro-batch ratios would not be.
  * The aux-loss-free bias is updated by `update_balancing_bias()`, which the trainer calls once per optimizer
    step; it uses the counts of every training forward since the previous call (summed over ranks).
  * Eval forwards (module.eval()) return their own stats but never touch the bias or its counts; they use
    `eval_capacity_factor` and no jitter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from moe.dispatch import DispatchPlan, combine, dispatch, expert_capacity, plan_dispatch
from moe.experts import GroupedExperts
from moe.ffn import FeedForward
from moe.losses import load_balancing_loss, router_z_loss
from moe.moe_config import MoEConfig
from moe.router import TopKRouter


@dataclass
class MoEStats:
    """Detached per-forward sums of one MoE layer; add them over micro-batches/ranks, then `summarize`."""

    tokens_per_expert_before: torch.Tensor  # [E] int64, assignments routed to each expert (before capacity)
    tokens_per_expert_after: torch.Tensor  # [E] int64, assignments each expert computed (after capacity)
    num_tokens: torch.Tensor  # () int64, tokens routed (padding excluded)
    fully_dropped_tokens: torch.Tensor  # () int64, tokens that lost all K assignments (pure residual)
    entropy_sum: torch.Tensor  # () Σ over tokens of the router distribution's entropy, in nats
    aux_loss_sum: torch.Tensor  # () Σ over micro-batches of aux_loss (coefficient applied)
    z_loss_sum: torch.Tensor  # () Σ over micro-batches of z_loss (coefficient applied)
    num_micro_batches: torch.Tensor  # () int64, 1 per forward

    def __add__(self, other: MoEStats) -> MoEStats:
        return MoEStats(*(a + b for a, b in zip(self._tensors(), other._tensors(), strict=True)))

    def _tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def to_vector(self) -> torch.Tensor:
        """All fields as one float64 vector (exact for counts below 2**53), for a single all-reduce."""
        return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in self._tensors()])

    @classmethod
    def from_vector(cls, vector: torch.Tensor, num_experts: int) -> MoEStats:
        """Inverse of `to_vector` (e.g. after an all-reduce); counts come back as int64."""
        fields = dataclasses.fields(cls)
        sizes = [num_experts, num_experts] + [1] * (len(fields) - 2)
        values = {}
        for f, piece in zip(fields, torch.split(vector, sizes), strict=True):
            value = piece if f.name.startswith("tokens_per_expert") else piece.squeeze(0)
            is_count = f.name not in ("entropy_sum", "aux_loss_sum", "z_loss_sum")
            values[f.name] = value.round().to(torch.int64) if is_count else value.float()
        return cls(**values)


def summarize(stats: MoEStats) -> dict[str, float | int | list[int]]:
    """Ratio metrics computed from (possibly summed) raw stats; load ratios use counts before capacity."""
    before_E = stats.tokens_per_expert_before.to(torch.float64)
    after_E = stats.tokens_per_expert_after.to(torch.float64)
    routed, kept = float(before_E.sum()), float(after_E.sum())
    mean_load = float(before_E.mean())
    num_tokens = int(stats.num_tokens)
    num_micro_batches = max(int(stats.num_micro_batches), 1)
    return {
        "tokens_per_expert": [int(c) for c in stats.tokens_per_expert_before.tolist()],
        "tokens_per_expert_after": [int(c) for c in stats.tokens_per_expert_after.tolist()],
        "dropped_assignments": round(routed - kept),
        "drop_frac": (routed - kept) / routed if routed > 0 else 0.0,
        "fully_dropped_frac": int(stats.fully_dropped_tokens) / num_tokens if num_tokens > 0 else 0.0,
        "max_over_mean": float(before_E.max()) / mean_load if mean_load > 0 else 0.0,
        # Coefficient of variation with the population std: 0 for perfectly even load.
        "cv": float(before_E.std(correction=0)) / mean_load if mean_load > 0 else 0.0,
        "entropy": float(stats.entropy_sum) / num_tokens if num_tokens > 0 else 0.0,
        "aux_loss": float(stats.aux_loss_sum) / num_micro_batches,
        "z_loss": float(stats.z_loss_sum) / num_micro_batches,
    }


class MoEOutput(NamedTuple):
    output: torch.Tensor  # [B, T, D]
    aux_loss: torch.Tensor  # () load-balancing loss, coefficient applied, differentiable
    z_loss: torch.Tensor  # () router z-loss, coefficient applied, differentiable
    stats: MoEStats


class MoELayer(nn.Module):
    """Top-k routed experts (+ optional shared experts) in place of a block's dense FFN.

    Parameters: `router.weight` [E, D]; `experts.w_gate`/`w_up` [E, D, F] (w_gate only for SwiGLU) and
    `experts.w_down` [E, F, D]; `shared_experts`, an ordinary dense FFN (see below), or None.
    """

    def __init__(self, d_model: int, config: MoEConfig, activation: str, init_std: float = 0.02):
        super().__init__()
        self.config = config
        self.d_model = d_model
        self.activation = activation
        self.router = TopKRouter(d_model, config.num_experts, config.top_k, config.router, init_std)
        self.experts = GroupedExperts(d_model, config.expert_d_ff, config.num_experts, activation, init_std)
        # S shared experts of width F summed equal one FFN of width S·F (the activation is per hidden unit),
        # so they are fused into one module: one matmul per projection instead of S (DeepSeek does the same).
        self.shared_experts: FeedForward | None = None
        if config.num_shared_experts > 0:
            shared_d_ff = config.num_shared_experts * config.expert_d_ff
            self.shared_experts = FeedForward(d_model, shared_d_ff, activation)
            for p in self.shared_experts.parameters():
                nn.init.normal_(p, mean=0.0, std=init_std)

    def forward(self, x_BTD: torch.Tensor, token_mask_BT: torch.Tensor | None = None) -> MoEOutput:
        B, T, D = x_BTD.shape
        cfg = self.config
        x_ND = x_BTD.reshape(B * T, D)
        group_ids_N = None
        if cfg.aux_loss_scope == "sequence":
            group_ids_N = torch.arange(B, device=x_BTD.device).repeat_interleave(T)
        real_N = None
        if token_mask_BT is not None:
            # Padding is never routed: it takes no capacity, enters no count or loss, and its output is 0.
            real_N = token_mask_BT.reshape(-1).nonzero().squeeze(-1)
            x_ND = x_ND.index_select(0, real_N)
            group_ids_N = group_ids_N.index_select(0, real_N) if group_ids_N is not None else None
        num_tokens = x_ND.shape[0]

        route = self.router(x_ND)
        capacity_factor = cfg.capacity_factor if self.training else cfg.eval_capacity_factor
        capacity = None
        if capacity_factor is not None:
            capacity = expert_capacity(
                num_tokens,
                num_experts=cfg.num_experts,
                top_k=cfg.top_k,
                capacity_factor=capacity_factor,
                min_capacity=cfg.min_capacity,
            )
        plan = plan_dispatch(
            route.topk_ids_NK,
            route.gates_NK,
            num_experts=cfg.num_experts,
            capacity=capacity,
            drop_policy=cfg.drop_policy,
        )
        y_AD = self.experts(dispatch(x_ND, plan), plan.tokens_per_expert_after_E.tolist())
        out_ND = combine(y_AD, route.gates_NK, plan)
        if self.shared_experts is not None:
            out_ND = out_ND + self.shared_experts(x_ND)

        aux_loss = load_balancing_loss(
            route.probs_NE, route.topk_ids_NK, coef=cfg.aux_loss_coef, group_ids_N=group_ids_N, num_groups=B
        )
        z_loss = router_z_loss(route.logits_NE, coef=cfg.z_loss_coef)
        stats = self._stats(route.probs_NE, plan, aux_loss, z_loss, num_tokens, capacity)

        if real_N is not None:
            out_ND = out_ND.new_zeros(B * T, D).index_copy(0, real_N, out_ND)
        return MoEOutput(out_ND.view(B, T, D), aux_loss, z_loss, stats)

    @torch.no_grad()
    def _stats(
        self,
        probs_NE: torch.Tensor,
        plan: DispatchPlan,
        aux_loss: torch.Tensor,
        z_loss: torch.Tensor,
        num_tokens: int,
        capacity: int | None,
    ) -> MoEStats:
        device = probs_NE.device
        fully_dropped = torch.zeros((), dtype=torch.int64, device=device)
        if capacity is not None:
            kept_per_token_N = torch.bincount(plan.token_ids_A, minlength=num_tokens)
            fully_dropped = (kept_per_token_N == 0).sum()
        return MoEStats(
            tokens_per_expert_before=plan.tokens_per_expert_before_E,
            tokens_per_expert_after=plan.tokens_per_expert_after_E,
            num_tokens=torch.tensor(num_tokens, dtype=torch.int64, device=device),
            fully_dropped_tokens=fully_dropped,
            entropy_sum=-torch.special.xlogy(probs_NE, probs_NE).sum().float(),
            aux_loss_sum=aux_loss.detach().float(),
            z_loss_sum=z_loss.detach().float(),
            num_micro_batches=torch.ones((), dtype=torch.int64, device=device),
        )

    def update_balancing_bias(self, group: dist.ProcessGroup | None = None) -> None:
        """One aux-loss-free bias step from the loads since the last call; call once per optimizer step."""
        self.router.update_balancing_bias(group)


def update_balancing_biases(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Step the balancing bias of every MoE layer in `model` (a no-op for layers without bias balancing)."""
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.update_balancing_bias(group)
