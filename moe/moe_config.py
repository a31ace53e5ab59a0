"""Configuration of the top-k routed expert layer (`ModelConfig.moe`; None there means a dense model).

Legend: D model width, F expert hidden width, E routed experts, K experts per token (top-k).

Every field is a plain int/float/bool/str/Optional so Hydra's structured configs can hold it; cross-field
checks run once in `__post_init__` and say what to change. The analytic counts here (`num_params`,
`num_active_params`, `matmul_flops_per_token`) are checked against the real `MoELayer` by a test.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe.errors import ModelConfigError
from moe.ffn import ACTIVATIONS, ffn_matmul_flops_per_token, ffn_num_params

SCORE_FNS = ("softmax", "sigmoid")
DROP_POLICIES = ("position", "probs", "choice")
EXPERTS_IMPLS = ("auto", "grouped_mm", "loop")
AUX_LOSS_SCOPES = ("micro_batch", "sequence", "global")


@dataclass
class RouterConfig:
    """How a token's router logits become K expert ids and K gates.

    score_fn="softmax", softmax_after_topk=False: p = softmax(x) over all E, pick the K largest (Switch, Mixtral).
    score_fn="softmax", softmax_after_topk=True: pick the K largest logits, softmax over those K only.
    score_fn="sigmoid": independent per-expert scores sigmoid(x) (DeepSeek-V3).
    renormalize_topk rescales the K selected scores to sum to one (the seeds' 0.6, 0.3 -> 2/3, 1/3).
    bias_update_rate > 0 turns on aux-loss-free balancing: a per-expert bias added to the scores only when
    choosing experts (gates still come from the unbiased scores), nudged by ±rate once per optimizer step.
    n_group > 1 limits each token to the experts of its `topk_group` best of n_group contiguous expert groups,
    a group scored by the sum of its two best choice scores (DeepSeek-V3's node-limited routing; 1 = no limit).
    routed_scaling_factor multiplies the final gates, after any renormalisation (DeepSeek-V3: 2.5), so the
    routed experts' sum is scaled against the shared experts and the residual.
    """

    score_fn: str = "softmax"
    softmax_after_topk: bool = False
    renormalize_topk: bool = True
    jitter_eps: float = 0.0  # multiplicative U(1-eps, 1+eps) noise on the router input, training only (Switch)
    bias_update_rate: float = 0.0  # 0 = no bias balancing; DeepSeek-V3 used 1e-3
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.score_fn not in SCORE_FNS:
            raise ModelConfigError(f"moe.router.score_fn={self.score_fn!r} is not supported: use one of {SCORE_FNS}")
        if self.softmax_after_topk and self.score_fn != "softmax":
            raise ModelConfigError(
                f"moe.router.softmax_after_topk=True only applies to score_fn='softmax', not {self.score_fn!r}: "
                "set softmax_after_topk=False"
            )
        if self.softmax_after_topk and not self.renormalize_topk:
            raise ModelConfigError(
                "moe.router.softmax_after_topk=True already gives K gates that sum to one, so "
                "renormalize_topk=False would be silently ignored: set renormalize_topk=True"
            )
        if not 0.0 <= self.jitter_eps < 1.0:
            raise ModelConfigError(
                f"moe.router.jitter_eps={self.jitter_eps} must lie in [0, 1): use e.g. 0.01, or 0 for off"
            )
        if self.bias_update_rate < 0:
            raise ModelConfigError(
                f"moe.router.bias_update_rate={self.bias_update_rate} is negative: use 0 (off) or a rate like 1e-3"
            )
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ModelConfigError(
                f"moe.router.n_group={self.n_group}, topk_group={self.topk_group}: need n_group >= 1 and "
                "1 <= topk_group <= n_group (n_group=1 means no group limit)"
            )
        if not self.routed_scaling_factor > 0:
            raise ModelConfigError(
                f"moe.router.routed_scaling_factor={self.routed_scaling_factor} must be positive: use 1.0 for none"
            )


@dataclass
class MoEConfig:
    """A top-k routed expert layer replacing the dense FFN in selected blocks.

    Which blocks: layer i is MoE when i >= first_dense_layers and (i - first_dense_layers) % moe_layer_interval == 0
    (every layer: 0/1; every other layer: 0/2; DeepSeek's "first N dense, then MoE": N/1).
    Capacity per expert per micro-batch of N tokens: C = max(ceil(K · capacity_factor · N / E), min_capacity);
    capacity_factor=None is dropless. eval_capacity_factor applies when the module is in eval mode
    (None = dropless at eval, so evaluation never loses tokens unless asked to).
    """

    num_experts: int
    top_k: int
    expert_d_ff: int  # routed (and shared) expert hidden width; the model's d_ff is for its dense layers
    num_shared_experts: int = 0  # DeepSeek-style always-on experts, each of width expert_d_ff
    first_dense_layers: int = 0
    moe_layer_interval: int = 1
    capacity_factor: float | None = None
    eval_capacity_factor: float | None = None
    min_capacity: int = 4
    # Which assignments overflow: later tokens ("position"), lowest gates ("probs"), or every token's 2nd..K-th
    # choice before any token's 1st, then later tokens ("choice", GShard's and DeepSpeed's top-2 order).
    drop_policy: str = "position"
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    # Over which tokens the balancing loss counts load: this rank's micro-batch; each sequence (averaged); or
    # "global": the same micro-batch of every data-parallel rank pooled (see losses.global_load_balancing_loss).
    aux_loss_scope: str = "micro_batch"
    router: RouterConfig = field(default_factory=RouterConfig)
    # How the experts' matmuls run: one grouped_mm per projection ("grouped_mm"), a loop of E matmuls ("loop"), or
    # grouped_mm wherever it can run and the loop elsewhere ("auto"); see moe/experts.py. Results are equal.
    experts_impl: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.router, dict):  # e.g. MoEConfig(**yaml_dict); Hydra itself passes a RouterConfig
            self.router = RouterConfig(**self.router)
        if self.num_experts < 1:
            raise ModelConfigError(f"moe.num_experts={self.num_experts} must be at least 1: add experts")
        if self.top_k < 1:
            raise ModelConfigError(
                f"moe.top_k={self.top_k} must be at least 1: route each token to one or more experts"
            )
        if self.top_k > self.num_experts:
            raise ModelConfigError(
                f"moe.top_k={self.top_k} exceeds moe.num_experts={self.num_experts}: lower top_k or add experts"
            )
        if self.expert_d_ff < 1:
            raise ModelConfigError(f"moe.expert_d_ff={self.expert_d_ff} must be positive: set the expert hidden width")
        if self.num_shared_experts < 0:
            raise ModelConfigError(f"moe.num_shared_experts={self.num_shared_experts} is negative: use 0 for none")
        if self.first_dense_layers < 0:
            raise ModelConfigError(f"moe.first_dense_layers={self.first_dense_layers} is negative: use 0 for none")
        if self.moe_layer_interval < 1:
            raise ModelConfigError(
                f"moe.moe_layer_interval={self.moe_layer_interval} must be at least 1: use 1 for every layer"
            )
        for name in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ModelConfigError(f"moe.{name}={value} must be positive: use e.g. 1.25, or null for dropless")
        if self.min_capacity < 0:
            raise ModelConfigError(f"moe.min_capacity={self.min_capacity} is negative: use 0 for no floor")
        if self.drop_policy not in DROP_POLICIES:
            raise ModelConfigError(f"moe.drop_policy={self.drop_policy!r} is not supported: use one of {DROP_POLICIES}")
        if self.experts_impl not in EXPERTS_IMPLS:
            raise ModelConfigError(
                f"moe.experts_impl={self.experts_impl!r} is not supported: use one of {EXPERTS_IMPLS}"
            )
        for name in ("aux_loss_coef", "z_loss_coef"):
            if getattr(self, name) < 0:
                raise ModelConfigError(f"moe.{name}={getattr(self, name)} is negative: use 0 to disable the loss")
        if self.aux_loss_scope not in AUX_LOSS_SCOPES:
            raise ModelConfigError(
                f"moe.aux_loss_scope={self.aux_loss_scope!r} is not supported: use one of {AUX_LOSS_SCOPES}"
            )
        group_size, n_group = self.num_experts // self.router.n_group, self.router.n_group
        if self.num_experts % n_group != 0:
            raise ModelConfigError(
                f"moe.num_experts={self.num_experts} does not split into moe.router.n_group={n_group} equal groups: "
                "choose n_group dividing num_experts"
            )
        if self.top_k > self.router.topk_group * group_size:
            raise ModelConfigError(
                f"moe.top_k={self.top_k} exceeds the {self.router.topk_group * group_size} experts in "
                f"moe.router.topk_group={self.router.topk_group} groups of {group_size}: "
                "raise topk_group or lower top_k"
            )
        if self.top_k == 1 and self.router.renormalize_topk:
            # softmax-after-top-1 is the same trap: a softmax over one logit is 1.
            raise ModelConfigError(
                "moe.router.renormalize_topk=True with moe.top_k=1 makes every gate exactly 1, so the router gets "
                "no gradient from the model's loss: set moe.router.renormalize_topk=False "
                "(and softmax_after_topk=False), as Switch keeps the gate value"
            )

    # ---- which layers -------------------------------------------------------------------------------------------

    def is_moe_layer(self, layer_idx: int, n_layers: int) -> bool:
        """Whether block `layer_idx` (0-based) of an `n_layers` model uses this MoE layer instead of a dense FFN."""
        if not 0 <= layer_idx < n_layers:
            raise ValueError(f"layer_idx={layer_idx} is outside a model of n_layers={n_layers}")
        if self.first_dense_layers >= n_layers:
            raise ModelConfigError(
                f"moe.first_dense_layers={self.first_dense_layers} leaves no MoE layer in a {n_layers}-layer model: "
                "lower first_dense_layers or set moe to null for a dense model"
            )
        offset = layer_idx - self.first_dense_layers
        return offset >= 0 and offset % self.moe_layer_interval == 0

    # ---- analytic accounting of ONE MoE layer (bias-free linears; balancing bias is a buffer, not a parameter) --

    def num_params(self, d_model: int, activation: str) -> int:
        """Parameters held by one MoE layer: router E·D + E routed experts + shared experts."""
        _check_activation(activation)
        expert = ffn_num_params(d_model, self.expert_d_ff, activation)
        return self.num_experts * d_model + (self.num_experts + self.num_shared_experts) * expert

    def num_active_params(self, d_model: int, activation: str) -> int:
        """Parameters one token touches: router + its K routed experts + all shared experts."""
        _check_activation(activation)
        expert = ffn_num_params(d_model, self.expert_d_ff, activation)
        return self.num_experts * d_model + (self.top_k + self.num_shared_experts) * expert

    def matmul_flops_per_token(self, d_model: int, activation: str) -> int:
        """Forward matmul FLOPs per token (2 per multiply-add): router 2·D·E + K routed + shared expert FFNs.

        Dropped assignments would lower the realised figure; this is the dropless (planned) cost.
        """
        _check_activation(activation)
        expert = ffn_matmul_flops_per_token(d_model, self.expert_d_ff, activation)
        return 2 * d_model * self.num_experts + (self.top_k + self.num_shared_experts) * expert


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ModelConfigError(f"activation={activation!r} is not supported: use one of {ACTIVATIONS}")
