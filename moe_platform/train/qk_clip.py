"""QK-clip (Kimi K2's MuonClip) and the per-layer max attention logit in the metrics.

Every attention module gets a MaxLogitRecorder (moe/max_logit.py) while the run watches S_max^h, the largest logit
q·k/√d head h met in the step's forwards. After an applied step the [layer, head] maxima are all-reduced (MAX) over
every rank, so data-parallel ranks rescale alike and each pipeline stage sees every layer's value; then, with
optim.qk_clip = τ, each head with S_max^h > τ gets γ_h = τ / S_max^h folded into its projections (K2, §2.1):

    MHA (K = H):  W_Q^h ← √γ_h · W_Q^h,  W_K^h ← √γ_h · W_K^h            (biases alike)
    GQA (K < H):  W_Q^h ← γ_h · W_Q^h,  keys untouched                    (a shared key would clip its whole group)
    MLA:          W_UQ^{h,C} ← √γ_h · W_UQ^{h,C},  W_UK^h ← √γ_h · W_UK^h,  W_QR^h ← γ_h · W_QR^h,
                  the shared rotary key W_KR untouched                    (K2: only head-specific parts)

Each score q_h·k_j is linear in the query and the key, so every one of head h's logits is multiplied by γ_h and its
max becomes τ on the same inputs; heads at or under τ are not touched. Under FSDP each rank scales the rows of its
shards (the factors distributed like the parameter). DeepSpeed keeps an fp32 master copy that would undo the
rescale: config.py refuses it.
"""

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from moe.attention import Attention
from moe.max_logit import MaxLogitRecorder
from moe.mla import MultiHeadLatentAttention
from moe_platform.config import TrainConfig


class AttentionLogits:
    """The run's watch on attention logits: `after_step` after each applied step, `discard` after a withheld one,
    `record` in each log (the max per layer over the steps since the last log, and how many heads were clipped)."""

    def __init__(self, model: nn.Module, config: TrainConfig) -> None:
        self.tau = config.optim.qk_clip
        self.enabled = self.tau is not None or config.logging.attention_max_logit
        # every block's attention, the MTP modules' after the main layers (their blocks are numbered on from L)
        self.n_layers, self.n_heads = config.model.num_blocks, config.model.n_heads
        self.layers: dict[int, nn.Module] = {}
        if self.enabled:
            for module in model.modules():
                if isinstance(module, (Attention, MultiHeadLatentAttention)):
                    module.max_logit = MaxLogitRecorder()
                    self.layers[module.layer_idx] = module
        self.window_max_LH: torch.Tensor | None = None
        self.clipped_heads = 0

    def discard(self) -> None:
        for module in self.layers.values():
            module.max_logit.take()

    @torch.no_grad()
    def after_step(self) -> None:
        if not self.enabled:
            return
        max_LH = self._gathered_maxima()
        self.window_max_LH = max_LH if self.window_max_LH is None else torch.maximum(self.window_max_LH, max_LH)
        if self.tau is None:
            return
        self.clipped_heads += int((max_LH > self.tau).sum())  # every layer's, this rank's stages or not
        for layer, module in self.layers.items():
            over_H = max_LH[layer] > self.tau  # only those: a layer no forward ran holds -inf, and τ / -inf = -0
            if bool(over_H.any()):
                clip_heads_(module, torch.where(over_H, self.tau / max_LH[layer], 1.0))

    def record(self) -> dict[str, Any]:
        if self.window_max_LH is None:
            return {}
        per_layer = self.window_max_LH.amax(dim=1)
        record = {f"attn/max_logit/layer_{layer}": float(value) for layer, value in enumerate(per_layer)}
        record["attn/max_logit"] = float(per_layer.max())
        if self.tau is not None:
            record["attn/qk_clipped_heads"] = self.clipped_heads
        self.window_max_LH, self.clipped_heads = None, 0
        return record

    def _gathered_maxima(self) -> torch.Tensor:
        """[layer, head] S_max over every rank (a layer no rank ran this step stays -inf)."""
        device = next(iter(self.layers.values())).w_o.weight.device if self.layers else torch.device("cpu")
        max_LH = torch.full((self.n_layers, self.n_heads), float("-inf"), device=device)
        for layer, module in self.layers.items():
            seen_H = module.max_logit.take()
            if seen_H is not None:
                max_LH[layer] = seen_H
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(max_LH, op=dist.ReduceOp.MAX)
        return max_LH


def clip_heads_(module: nn.Module, gamma_H: torch.Tensor) -> None:
    """Fold γ_h into head h's query/key projections as the module docstring says (γ_h = 1: the head unchanged)."""
    root_H = gamma_H.sqrt()
    if isinstance(module, MultiHeadLatentAttention):
        w_uq = module.w_q if isinstance(module.w_q, nn.Linear) else module.w_q[-1]  # W_Q, or W_UQ after the latent
        _scale_rows_(w_uq, _per_head(torch.stack((root_H, gamma_H), 1), (module.nope_dim, module.rope_dim)))
        ones_H = torch.ones_like(gamma_H)
        _scale_rows_(module.w_kv_up, _per_head(torch.stack((root_H, ones_H), 1), (module.nope_dim, module.v_dim)))
        return
    if module.n_kv_heads == module.n_heads:
        _scale_rows_(module.w_q, _per_head(root_H[:, None], (module.head_dim,)))
        _scale_rows_(module.w_k, _per_head(root_H[:, None], (module.head_dim,)))
    else:
        _scale_rows_(module.w_q, _per_head(gamma_H[:, None], (module.head_dim,)))


def _per_head(factors_HP: torch.Tensor, widths: tuple[int, ...]) -> torch.Tensor:
    """One factor per output row of a projection laid out head by head, each head's rows in `widths` parts (e.g.
    MLA's [nope | rope]): part p of head h gets factors_HP[h, p]."""
    rows_HP = [factors_HP[:, p : p + 1].expand(-1, width) for p, width in enumerate(widths)]
    return torch.cat(rows_HP, dim=1).reshape(-1)


def _scale_rows_(linear: nn.Linear, factor_R: torch.Tensor) -> None:
    for param in (linear.weight, linear.bias):
        if param is None:
            continue
        factor = factor_R.to(param.dtype).reshape(-1, *([1] * (param.ndim - 1)))
        if isinstance(param, DTensor):  # rows sharded (FSDP2: dim 0): this rank's rows of the factors
            factor = factor.expand(param.shape).contiguous() if param.ndim > 1 else factor
            factor = distribute_tensor(factor.to(param.device_mesh.device_type), param.device_mesh,
                                       param.placements, src_data_rank=None)  # fmt: skip
        param.mul_(factor)
