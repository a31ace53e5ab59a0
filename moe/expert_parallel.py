"""Expert parallelism (EP): each rank of an EP group computes only its block of experts; tokens travel to them.

Legend: E experts in all, EP ranks in the group, L = E/EP experts per rank, A assignments this rank kept (grouped
by global expert id, as `plan_dispatch` orders them), R rows this rank receives, D model width.

Rank p of the group holds global experts [p·L, (p+1)·L). Because the kept assignments are already sorted by
global expert id, the rows bound for rank p are one contiguous slice of x_AD, so the exchange is one uneven
`all_to_all_single` each way (the design of torchtitan's and Megatron's all-to-all token dispatchers):

    1. counts_PL  = this rank's kept assignments per global expert, as [EP destination ranks, L local experts]
    2. received_PL = all_to_all(counts_PL)             even exchange: what every source rank sends to my experts
    3. x_RD = all_to_all(x_AD, send = Σ_l counts_PL, receive = Σ_l received_PL)      rows ordered (source, expert)
    4. reorder (source, expert) → (expert, source), run my L experts, reorder back
    5. y_AD = all_to_all(y_RD) in reverse: every row returns to the rank and position it came from

Routing, capacity, the drop policy, the combine, the losses and the statistics all happen on the token's own
rank exactly as without EP; only the expert matmuls move. So an EP run computes the same function as EP=1.
The exchange is differentiable (torch's functional `all_to_all_single` has autograd: the backward is the
reverse exchange), and the reorders are gathers both ways.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from moe.experts import GroupedExperts


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's place in its EP group: `size` ranks, this one at `rank`, over `group` (None: the world)."""

    size: int
    rank: int
    group: dist.ProcessGroup | None = None

    def local_experts(self, num_experts: int) -> range:
        """The global ids of the experts this rank holds: a contiguous block of E/EP."""
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def run_experts(
        self, experts: GroupedExperts, x_AD: torch.Tensor, tokens_per_expert_E: torch.Tensor
    ) -> torch.Tensor:
        """y_AD = Expert_{e(a)}(x_a) for every kept assignment a, wherever expert e(a) lives (steps 1–5 above)."""
        num_local = tokens_per_expert_E.numel() // self.size
        counts_PL = tokens_per_expert_E.view(self.size, num_local)
        received_PL = torch.empty_like(counts_PL)
        dist.all_to_all_single(received_PL, counts_PL, group=self.group)
        send_P = counts_PL.sum(dim=1).tolist()  # one host sync per layer: the split sizes must be Python ints
        receive_P = received_PL.sum(dim=1).tolist()
        group = self.group if self.group is not None else dist.group.WORLD

        x_RD = all_to_all_single_autograd(x_AD, receive_P, send_P, group)
        by_expert_R = _source_to_expert_order(received_PL)
        x_RD = _Reorder.apply(x_RD, by_expert_R)
        y_RD = experts(x_RD, received_PL.sum(dim=0).tolist())
        y_RD = _Reorder.apply(y_RD, torch.argsort(by_expert_R))
        return all_to_all_single_autograd(y_RD, send_P, receive_P, group)


def _source_to_expert_order(received_PL: torch.Tensor) -> torch.Tensor:
    """Row ids that turn rows ordered (source rank, local expert) into rows ordered (local expert, source rank)."""
    sizes = received_PL.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes  # where block (p, l) begins in the received order
    blocks_by_expert = received_PL.t().reshape(-1)
    starts_by_expert = starts.view_as(received_PL).t().reshape(-1)
    offsets = torch.cumsum(blocks_by_expert, 0) - blocks_by_expert
    within = torch.arange(int(sizes.sum()), device=sizes.device) - offsets.repeat_interleave(blocks_by_expert)
    return starts_by_expert.repeat_interleave(blocks_by_expert) + within


class _Reorder(torch.autograd.Function):
    """out = x[order]; the gradient is the inverse gather (order is a permutation), not autograd's scatter-add."""

    @staticmethod
    def forward(ctx, x_RD, order_R):
        ctx.save_for_backward(order_R)
        return x_RD.index_select(0, order_R)

    @staticmethod
    def backward(ctx, grad_RD):
        (order_R,) = ctx.saved_tensors
        return grad_RD.index_select(0, torch.argsort(order_R)), None


def is_expert_parameter(name: str) -> bool:
    """Parameters that EP shards (experts.w_gate / w_up / w_down of an MoE layer); the router is replicated."""
    return ".experts." in f".{name}"


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every routed expert weight in `model`, in registration order."""
    return [(name, p) for name, p in model.named_parameters() if is_expert_parameter(name)]
