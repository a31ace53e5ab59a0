"""Expert-load accounting of one MoE layer: raw per-forward sums, and the ratios a person reads from them.

Legend: N tokens routed in the micro-batch, E experts, A kept assignments.

Accounting sits beside the layer's math, not inside it: the layer hands its routing results to `collect_stats`,
the trainer adds the stats of all micro-batches (`a + b`) and, for a global view, all-reduces `to_vector()` over
data-parallel ranks; then `summarize()` computes ratios (drop fraction, max/mean, MaxVio, utilisation, dead experts,
CV, mean entropy, mean losses) from the summed counts, which is exact for the step (or log window), whereas
averaging per-micro-batch ratios would not be.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moe.dispatch import DispatchPlan


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
    def zeros(cls, num_experts: int) -> MoEStats:
        """No token routed: what a layer another pipeline stage runs adds to this rank's sums."""
        return cls.from_vector(torch.zeros(2 * num_experts + len(dataclasses.fields(cls)) - 2), num_experts)

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


@torch.no_grad()
def collect_stats(
    probs_NE: torch.Tensor,
    plan: DispatchPlan,
    aux_loss: torch.Tensor,
    z_loss: torch.Tensor,
    num_tokens: int,
    capacity: int | None,
) -> MoEStats:
    """The raw sums of one forward: counts before/after capacity, fully dropped tokens, entropy and loss sums."""
    device = probs_NE.device
    fully_dropped = torch.zeros((), dtype=torch.int64, device=device)
    if capacity is not None:  # (index_add, not bincount, and torch.full, not torch.tensor: no host round trip)
        kept_per_token_N = plan.token_ids_A.new_zeros(num_tokens).index_add_(
            0, plan.token_ids_A, torch.ones_like(plan.token_ids_A)
        )
        fully_dropped = (kept_per_token_N == 0).sum()
    return MoEStats(
        tokens_per_expert_before=plan.tokens_per_expert_before_E,
        tokens_per_expert_after=plan.tokens_per_expert_after_E,
        num_tokens=torch.full((), num_tokens, dtype=torch.int64, device=device),
        fully_dropped_tokens=fully_dropped,
        entropy_sum=-torch.special.xlogy(probs_NE, probs_NE).sum().float(),
        aux_loss_sum=aux_loss.detach().float(),
        z_loss_sum=z_loss.detach().float(),
        num_micro_batches=torch.ones((), dtype=torch.int64, device=device),
    )


def load_balance(tokens_per_expert: torch.Tensor | list[int]) -> dict[str, float | int | list[float]]:
    """Balance metrics of one layer's load (assignments routed to each expert, before capacity).

    With load_e the assignments routed to expert e and mean = Σ load / E (the ideal, even load):
    utilisation_e = load_e / mean (1.0 everywhere when balanced), MaxVio = (max load − mean) / mean (0 when
    balanced, E − 1 when one expert takes everything at top-1), max/mean = MaxVio + 1, CV = population std / mean,
    dead experts = experts with load 0. A layer that routed nothing has every ratio 0."""
    load_E = torch.as_tensor(tokens_per_expert, dtype=torch.float64)
    mean_load = float(load_E.mean())
    return {
        "max_over_mean": float(load_E.max()) / mean_load if mean_load > 0 else 0.0,
        "maxvio": (float(load_E.max()) - mean_load) / mean_load if mean_load > 0 else 0.0,
        "utilisation": (load_E / mean_load).tolist() if mean_load > 0 else [0.0] * load_E.numel(),
        "dead_experts": int((load_E == 0).sum()),
        "cv": float(load_E.std(correction=0)) / mean_load if mean_load > 0 else 0.0,
    }


def summarize(stats: MoEStats) -> dict[str, float | int | list[int] | list[float]]:
    """Ratio metrics computed from (possibly summed) raw stats; load ratios use counts before capacity
    (`load_balance`)."""
    before_E = stats.tokens_per_expert_before.to(torch.float64)
    after_E = stats.tokens_per_expert_after.to(torch.float64)
    routed, kept = float(before_E.sum()), float(after_E.sum())
    num_tokens = int(stats.num_tokens)
    num_micro_batches = max(int(stats.num_micro_batches), 1)
    return {
        "tokens_per_expert": [int(c) for c in stats.tokens_per_expert_before.tolist()],
        "tokens_per_expert_after": [int(c) for c in stats.tokens_per_expert_after.tolist()],
        "dropped_assignments": round(routed - kept),
        "drop_frac": (routed - kept) / routed if routed > 0 else 0.0,
        "fully_dropped_frac": int(stats.fully_dropped_tokens) / num_tokens if num_tokens > 0 else 0.0,
        **load_balance(before_E),
        "entropy": float(stats.entropy_sum) / num_tokens if num_tokens > 0 else 0.0,
        "aux_loss": float(stats.aux_loss_sum) / num_micro_batches,
        "z_loss": float(stats.z_loss_sum) / num_micro_batches,
    }
