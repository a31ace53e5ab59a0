"""The top-k routed expert layer: route, dispatch under capacity, run experts, combine, plus losses and stats.

Legend: B batch, T positions per sequence, N tokens routed in the micro-batch (the B·T positions, or only the
real ones under a token mask), D model width, E experts, K experts per token, A kept assignments.

    out_n = Σ_{e in kept top-K(n)} g_ne · Expert_e(x_n) + Σ_shared SharedExpert(x_n)

Gradient accumulation and data parallelism (how the numbers stay right per optimizer step):
  * `aux_loss` and `z_loss` are means over this micro-batch's tokens, like the LM loss: the trainer adds them to
    the LM loss and scales the sum by 1/grad_accum, so the step optimises the mean of per-micro-batch losses.
    (Balance is thus enforced per micro-batch and per rank, as in Switch/Megatron/OLMo, or with
    aux_loss_scope="global" per micro-batch over all data-parallel ranks pooled (see losses.py); never over the
    step's whole batch, which would need counts from micro-batches not yet run. Padding never counts.)
  * `stats` holds raw sums (counts, entropy sum, loss sums, number of micro-batches); `moe/stats.py` says how they
    are added over micro-batches and ranks before any ratio is taken.
  * The aux-loss-free bias is updated by `step_balancing_biases()`, which the trainer calls once per optimizer
    step; it uses the counts of every training forward since the previous call (summed over ranks).
  * Eval forwards (module.eval()) return their own stats but never touch the bias or its counts; they use
    `eval_capacity_factor` and no jitter.

Host syncs: the forward reads device data to the host once, the experts' split sizes
(`plan_dispatch` reads tokens_per_expert_after_E, E ints; the number of kept rows follows from them). Routing,
capacity, losses and statistics stay on the device (histograms by index_add, not bincount; no .item(), no
boolean-mask indexing), so on a GPU the host never waits for the router. Two documented exceptions: a
`token_mask_BT` costs one more read (the number of real tokens), and expert parallelism reads its exchange
sizes itself (moe/expert_parallel.py). A test counts the reads (tests/moe/test_expert_impl.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from moe.dispatch import DispatchPlan, combine, dispatch, expert_capacity, plan_dispatch
from moe.expert_parallel import ExpertParallel
from moe.experts import GroupedExperts
from moe.ffn import FeedForward
from moe.losses import global_load_balancing_loss, load_balancing_loss, router_z_loss
from moe.moe_config import MoEConfig
from moe.router import RouterOutput, TopKRouter
from moe.stats import MoEStats, collect_stats


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
        # The data-parallel ranks whose load aux_loss_scope="global" pools (None: all ranks).
        self.balance_group: dist.ProcessGroup | None = None
        # Set by expert parallelism (moe_platform.parallel.expert_parallel.shard_experts): `experts` then holds only
        # this rank's block, and tokens travel to their expert.
        self.expert_parallel: ExpertParallel | None = None
        use_grouped_mm = {"auto": None, "grouped_mm": True, "loop": False}[config.experts_impl]
        self.experts = GroupedExperts(
            d_model, config.expert_d_ff, config.num_experts, activation, init_std, use_grouped_mm=use_grouped_mm
        )
        # S shared experts of width F summed equal one FFN of width S·F (the activation is per hidden unit),
        # so they are fused into one module: one matmul per projection instead of S (DeepSeek does the same).
        self.shared_experts: FeedForward | None = None
        if config.num_shared_experts > 0:
            shared_d_ff = config.num_shared_experts * config.expert_d_ff
            self.shared_experts = FeedForward(d_model, shared_d_ff, activation)

            def init_normal(module: nn.Module) -> None:
                for p in module.parameters(recurse=False):
                    nn.init.normal_(p, mean=0.0, std=init_std)

            # Through `apply`, as in Transformer.reset_parameters: under ZeRO-3's partitioned construction the
            # FFN's weights are already split here, and `apply` is the hook that gathers them.
            self.shared_experts.apply(init_normal)

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

        route, plan, capacity = self.route_and_plan(x_ND)
        x_AD = dispatch(x_ND, plan)
        if self.expert_parallel is None:
            y_AD = self.experts(x_AD, plan.tokens_per_expert_after)
        else:
            y_AD = self.expert_parallel.run_experts(self.experts, x_AD, plan.tokens_per_expert_after_E)
        out_ND = combine(y_AD, route.gates_NK, plan)
        if self.shared_experts is not None:
            out_ND = out_ND + self.shared_experts(x_ND)

        if cfg.aux_loss_scope == "global" and self.training:
            aux_loss = global_load_balancing_loss(
                route.probs_NE, route.balance_ids_NK, coef=cfg.aux_loss_coef, group=self.balance_group
            )
        else:  # eval forwards run on one rank's data alone (and need no collective): the local micro-batch
            aux_loss = load_balancing_loss(
                route.probs_NE, route.balance_ids_NK, coef=cfg.aux_loss_coef, group_ids_N=group_ids_N, num_groups=B
            )
        z_loss = router_z_loss(route.logits_NE, coef=cfg.z_loss_coef)
        stats = collect_stats(route.probs_NE, plan, aux_loss, z_loss, num_tokens, capacity)

        if real_N is not None:
            out_ND = out_ND.new_zeros(B * T, D).index_copy(0, real_N, out_ND)
        return MoEOutput(out_ND.view(B, T, D), aux_loss, z_loss, stats)

    def route_and_plan(self, x_ND: torch.Tensor) -> tuple[RouterOutput, DispatchPlan, int | None]:
        """Route the tokens and plan their dispatch under this mode's capacity (`capacity_factor` in training,
        `eval_capacity_factor` in eval; None: dropless): (router output, plan, capacity C or None)."""
        cfg = self.config
        route = self.router(x_ND)
        capacity_factor = cfg.capacity_factor if self.training else cfg.eval_capacity_factor
        capacity = None
        if capacity_factor is not None:
            capacity = expert_capacity(
                x_ND.shape[0],
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
        return route, plan, capacity


def balancing_routers(model: nn.Module) -> list[TopKRouter]:
    """The routers of `model`'s MoE layers that balance by bias (aux-loss-free), in module order."""
    return [m.router for m in model.modules() if isinstance(m, MoELayer) and m.router.uses_bias]


def step_balancing_biases(routers: list[TopKRouter], group: dist.ProcessGroup | None = None) -> None:
    """One bias step for each of `routers` from the loads counted since the last step, summed over `group` in a
    single all-reduce of all layers' counts (one collective per optimizer step, not one per layer)."""
    if not routers:
        return
    loads_LE = torch.cat([router.load_since_update for router in routers])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(loads_LE, group=group)
    sizes = [router.load_since_update.numel() for router in routers]
    for router, load_E in zip(routers, loads_LE.split(sizes), strict=True):
        router.step_balancing_bias(load_E)


def update_balancing_biases(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Step the balancing bias of every MoE layer in `model` (a no-op for layers without bias balancing)."""
    step_balancing_biases(balancing_routers(model), group)
