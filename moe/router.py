"""Router: a bias-free linear gives each token E logits (in fp32); they become K expert ids and K gates.

Legend: N tokens, D model width, E experts, K experts per token (top-k).

Aux-loss-free balancing (DeepSeek-V3): a per-expert bias b is added to the scores only to *choose* experts;
the gates are the unbiased scores of the chosen experts, so b steers load without entering the output.
b moves by ±rate per optimizer step, towards the experts that received fewer than the mean load.
The balancing loss then counts experts from the *unbiased* top-k (`balance_ids_NK`), as DeepSeek-V3 and
Megatron-Core do: once b has evened out the chosen load, counts from the biased choice are flat and would leave
the loss almost no gradient, while the router's own preferences are still skewed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe.checkpointing import is_recomputing
from moe.moe_config import RouterConfig


class RouterOutput(NamedTuple):
    topk_ids_NK: torch.Tensor  # int64 expert ids, one row per token
    gates_NK: torch.Tensor  # weight of each chosen expert's output (router dtype, differentiable)
    probs_NE: torch.Tensor  # full distribution over experts before top-k: aux loss and entropy
    logits_NE: torch.Tensor  # raw router logits: z-loss
    balance_ids_NK: torch.Tensor  # the top-k the balancing loss counts: topk_ids_NK, or the unbiased top-k


def select_topk(
    logits_NE: torch.Tensor,
    *,
    top_k: int,
    score_fn: str = "softmax",
    softmax_after_topk: bool = False,
    renormalize: bool = True,
    selection_bias_E: torch.Tensor | None = None,
    scores_NE: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn logits into (topk_ids_NK, gates_NK) by the rule in `RouterConfig`'s docstring.

    `scores_NE`: the scores already computed from these logits (the router passes its balancing softmax, the
    same tensor), so that they are not computed twice.
    """
    if scores_NE is not None:
        pass
    elif score_fn == "softmax" and softmax_after_topk:
        scores_NE = logits_NE  # choose on logits; the softmax comes after, over the K chosen
    elif score_fn == "softmax":
        scores_NE = logits_NE.softmax(dim=-1)
    else:  # "sigmoid": RouterConfig admits no other score_fn
        scores_NE = logits_NE.sigmoid()

    choice_NE = scores_NE if selection_bias_E is None else scores_NE + selection_bias_E
    topk_ids_NK = group_limited_topk(choice_NE, top_k, n_group, topk_group)
    chosen_NK = scores_NE.gather(1, topk_ids_NK)  # unbiased: the bias never reaches the gates

    if softmax_after_topk:
        gates_NK = chosen_NK.softmax(dim=-1)
    elif renormalize:
        gates_NK = chosen_NK / chosen_NK.sum(dim=-1, keepdim=True)  # 0.6, 0.3 -> 2/3, 1/3
    else:
        gates_NK = chosen_NK
    if routed_scaling_factor != 1.0:
        gates_NK = gates_NK * routed_scaling_factor
    return topk_ids_NK, gates_NK


def group_limited_topk(choice_NE: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1) -> torch.Tensor:
    """The K experts with the largest choice scores, drawn only from each token's `topk_group` best of `n_group`
    equal, contiguous expert groups (DeepSeek-V3's node-limited routing). A group's score is the sum of its two
    largest choice scores (its one score when a group holds a single expert). n_group=1: plain top-k.

    Experts are returned in descending score order, as `torch.topk` gives them.
    """
    if n_group == 1:
        return choice_NE.topk(top_k, dim=-1).indices
    N, E = choice_NE.shape
    choice_NGe = choice_NE.view(N, n_group, E // n_group)
    group_score_NG = choice_NGe.topk(min(2, E // n_group), dim=-1).values.sum(dim=-1)
    kept_groups_NG = torch.zeros_like(group_score_NG, dtype=torch.bool)
    kept_groups_NG.scatter_(1, group_score_NG.topk(topk_group, dim=-1).indices, True)
    limited_NE = choice_NGe.masked_fill(~kept_groups_NG[:, :, None], float("-inf")).view(N, E)
    return limited_NE.topk(top_k, dim=-1).indices


def balancing_probs(logits_NE: torch.Tensor, score_fn: str = "softmax") -> torch.Tensor:
    """The per-token distribution over all E experts used by the balancing loss and the entropy statistic.

    softmax: the full softmax before top-k. sigmoid: the scores normalised to sum to one over experts
    (DeepSeek-V3's sequence-wise balance loss), so that balanced routing still gives Σ_i p_ti = 1.
    """
    if score_fn == "softmax":
        return logits_NE.softmax(dim=-1)
    scores_NE = logits_NE.sigmoid()
    return scores_NE / scores_NE.sum(dim=-1, keepdim=True)


class TopKRouter(nn.Module):
    """`weight` [E, D] maps tokens to expert logits; optionally holds the aux-loss-free balancing bias.

    Buffers (only with bias_update_rate > 0; both persistent, so checkpoints resume balancing exactly):
      expert_bias [E]: the selection bias b.
      load_since_update [E] (int64): assignments per expert counted by training forwards since the last
        `update_balancing_bias()`; eval forwards never touch either buffer.
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, config: RouterConfig, init_std: float = 0.02):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.config = config
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.uses_bias = config.bias_update_rate > 0
        if self.uses_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts))
            self.register_buffer("load_since_update", torch.zeros(num_experts, dtype=torch.int64))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)

    def _apply(self, fn, recurse=True):
        # module.bfloat16() (DeepSpeed's bf16 engine calls it) would round the bias to 8 mantissa bits, where a
        # 1e-3 step on a bias of 0.5 vanishes; the bias keeps at least fp32 whatever the module's dtype.
        bias_E = self.expert_bias if self.uses_bias else None
        super()._apply(fn, recurse)
        if bias_E is not None and self.expert_bias.dtype != torch.promote_types(self.expert_bias.dtype, bias_E.dtype):
            self.expert_bias = bias_E.to(self.expert_bias.device)
        return self

    def forward(self, x_ND: torch.Tensor) -> RouterOutput:
        # Routing decisions flip on tiny logit differences, so they are made in (at least) fp32 even when the
        # rest of the model runs under bf16 autocast; fp64 inputs stay fp64 (parity tests).
        router_dtype = torch.promote_types(x_ND.dtype, torch.float32)
        with torch.autocast(device_type=x_ND.device.type, enabled=False):
            x_ND = x_ND.to(router_dtype)
            if self.training and self.config.jitter_eps > 0:
                eps = self.config.jitter_eps
                x_ND = x_ND * torch.empty_like(x_ND).uniform_(1.0 - eps, 1.0 + eps)
            logits_NE = F.linear(x_ND, self.weight.to(router_dtype))
            probs_NE = balancing_probs(logits_NE, self.config.score_fn)
            # With a softmax before top-k the selection scores are the balancing probabilities: one softmax.
            shared = self.config.score_fn == "softmax" and not self.config.softmax_after_topk
            topk_ids_NK, gates_NK = select_topk(
                logits_NE,
                top_k=self.top_k,
                score_fn=self.config.score_fn,
                softmax_after_topk=self.config.softmax_after_topk,
                renormalize=self.config.renormalize_topk,
                selection_bias_E=self.expert_bias.to(router_dtype) if self.uses_bias else None,
                scores_NE=probs_NE if shared else None,
                n_group=self.config.n_group,
                topk_group=self.config.topk_group,
                routed_scaling_factor=self.config.routed_scaling_factor,
            )
            balance_ids_NK = topk_ids_NK
            if self.uses_bias:
                # The unbiased choice. probs_NE ranks experts, and groups by their top-2 sums, as the selection
                # scores do (the same softmax, or the sigmoid divided by one per-token sum); after-top-k softmax
                # chooses on the logits themselves.
                unbiased_NE = logits_NE if self.config.softmax_after_topk else probs_NE
                balance_ids_NK = group_limited_topk(
                    unbiased_NE.detach(), self.top_k, self.config.n_group, self.config.topk_group
                )

        if self.uses_bias and self.training and not is_recomputing():  # count each forward once
            with torch.no_grad():
                # index_add, not bincount, which on CUDA reads the ids' max to the host
                ids_A = topk_ids_NK.flatten()
                self.load_since_update.index_add_(0, ids_A, torch.ones_like(ids_A))
        return RouterOutput(topk_ids_NK, gates_NK, probs_NE, logits_NE, balance_ids_NK)

    @torch.no_grad()
    def update_balancing_bias(self, group: dist.ProcessGroup | None = None) -> None:
        """Apply one DeepSeek-V3 bias step from the load counted since the last call, then reset the count.

        Call once per optimizer step (after the last micro-batch), not per forward, so gradient accumulation
        sees one update per step. Under torch.distributed the counts are first summed over `group` (default:
        all ranks): every data-parallel replica must apply the same step or their routing drifts apart.
        """
        if not self.uses_bias:
            return
        load_E = self.load_since_update
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(load_E, group=group)
        self.step_balancing_bias(load_E)

    @torch.no_grad()
    def step_balancing_bias(self, load_E: torch.Tensor) -> None:
        """The bias step from `load_E`, the load already summed over the ranks, then a fresh count:

            b_e ← b_e + u · sign(mean(load) − load_e)

        Overloaded experts (above the mean) lose rate, underloaded ones gain it; exactly average (nothing counted
        included: 0 − 0) no change, so no host sync is needed to test for an empty count."""
        load_E = load_E.to(self.expert_bias.dtype)
        self.expert_bias += self.config.bias_update_rate * torch.sign(load_E.mean() - load_E)
        self.load_since_update.zero_()
