"""Multi-head latent attention (MLA, DeepSeek-V2/V3) — seed 001, "DeepSeek-V2 的 MLA…" and the absorption identity.

Legend: B batch, T query positions, S key positions (cached prefix + step), D model width, H heads,
n = d_nope content width of a query/key head, r = d_rope width of the decoupled position branch, v = d_v value
width, C = d_c the KV latent, Q = d_q the query latent (q_lora_rank).

Keys and values of all heads are reconstructed from one low-rank latent per token, c = RMSNorm(x W_DKV) (C dims),
beside a single position key k_r = RoPE(x W_KR) (r dims) shared by every head:

    q_h = [q_h^C ; RoPE(q_h^R)]         from x W_Q, or RMSNorm(x W_DQ) W_UQ with a query latent
    k_h = [W_UK_h c ; k_r]               v_h = W_UV_h c
    z_h = softmax(q_h · k_h / √(n + r) + M) v_h,      out = concat_h(z_h) W_O

The cache holds only c and k_r: B·L·S·(C + r)·s bytes (seed 001), not the GQA formula with C plugged in.

Decode with absorption (seed: qᵀWc = (Wᵀq)ᵀc, content branch only). The content score q_h^C · W_UK_h c equals
(W_UK_hᵀ q_h^C) · c, so each head's query moves into the latent space and meets the cached c directly; the RoPE
branch is not absorbed (a rotation that depends on the key's position sits between W_KR and the score). The value
side uses the same linearity: Σ_s a_s W_UV_h c_s = W_UV_h Σ_s a_s c_s. Attention then runs as multi-query attention
over one latent "head" of C + r dims, and W_UK, W_UV are applied to H queries instead of S cached positions.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from moe.attention import grouped_attention
from moe.kv_cache import LatentKVCache
from moe.max_logit import MaxLogitRecorder
from moe.mla_config import LATENT_NORM_EPS
from moe.rope import apply_rope

if TYPE_CHECKING:
    from moe.config import ModelConfig


class MultiHeadLatentAttention(nn.Module):
    """MLA with DeepSeek-V3's parameter layout. `w_kv_down` [D → C + r] is W_DKV and W_KR stacked (one matmul);
    `w_kv_up` [C → H·(n + v)] holds W_UK_h and W_UV_h head by head."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        mla = config.mla
        self.layer_idx = layer_idx
        self.n_heads = config.n_heads
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.latent_dim = mla.kv_lora_rank
        self.absorb_decode = mla.absorb_decode
        self.dropout = config.dropout
        bias = config.attention_bias
        q_width = self.n_heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.w_q: nn.Module = nn.Linear(config.d_model, q_width, bias=False)
        else:
            self.w_q = nn.Sequential(
                nn.Linear(config.d_model, mla.q_lora_rank, bias=bias),  # W_DQ
                nn.RMSNorm(mla.q_lora_rank, eps=LATENT_NORM_EPS),
                nn.Linear(mla.q_lora_rank, q_width, bias=False),  # W_UQ
            )
        self.w_kv_down = nn.Linear(config.d_model, self.latent_dim + self.rope_dim, bias=bias)
        self.kv_norm = nn.RMSNorm(self.latent_dim, eps=LATENT_NORM_EPS)
        self.w_kv_up = nn.Linear(self.latent_dim, self.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.w_o = nn.Linear(self.n_heads * self.v_dim, config.d_model, bias=bias)
        self.max_logit: MaxLogitRecorder | None = None  # set while a run watches S_max (moe/max_logit.py)

    def forward(
        self,
        x_BTD: torch.Tensor,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        kv_cache: LatentKVCache | None = None,
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        H = self.n_heads
        q_BHTq = self.w_q(x_BTD).view(B, T, H, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope_BHTn, q_rope_BHTr = q_BHTq.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope_BHTr = apply_rope(q_rope_BHTr, *rope_cos_sin)

        latent_BTC, k_rope_BTr = self.w_kv_down(x_BTD).split([self.latent_dim, self.rope_dim], dim=-1)
        latent_BTC = self.kv_norm(latent_BTC)
        k_rope_BTr = apply_rope(k_rope_BTr, *rope_cos_sin)  # one position key for all heads
        if kv_cache is not None:
            latent_BSC, k_rope_BSr = kv_cache.update(self.layer_idx, latent_BTC, k_rope_BTr)
        else:
            latent_BSC, k_rope_BSr = latent_BTC, k_rope_BTr

        attend = self._attend_absorbed if kv_cache is not None and self.absorb_decode else self._attend_expanded
        z_BHTv = attend(q_nope_BHTn, q_rope_BHTr, latent_BSC, k_rope_BSr, mask)
        return self.w_o(z_BHTv.transpose(1, 2).reshape(B, T, H * self.v_dim))

    def _attention(self, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
        T, S = q.shape[2], k.shape[2]
        v_width, qk_width = v.shape[-1], q.shape[-1]
        # SDPA's fused kernels want one head width for Q, K and V; DeepSeek's values are narrower (128 vs 192), and
        # the math fallback would keep the S×S probabilities for backward. Zero columns added to V add zero columns
        # to the output, which are cut off again.
        if v_width < qk_width:
            v = F.pad(v, (0, qk_width - v_width))
        # Without a mask and without a prefix, plain causal attention takes SDPA's fused causal path.
        z = grouped_attention(
            q,
            k,
            v,
            mask=mask,
            is_causal=mask is None and S == T and T > 1,
            dropout_p=self.dropout if self.training else 0.0,
            scale=1.0 / math.sqrt(self.nope_dim + self.rope_dim),
            check_mask=False,  # Transformer.forward checked it once
        )
        return z[..., :v_width]

    def _attend_expanded(self, q_nope_BHTn, q_rope_BHTr, latent_BSC, k_rope_BSr, mask) -> torch.Tensor:
        """Reconstruct every head's K and V from the latents, then ordinary attention over H heads."""
        B, S, _ = latent_BSC.shape
        kv_BHSx = self.w_kv_up(latent_BSC).view(B, S, self.n_heads, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope_BHSn, v_BHSv = kv_BHSx.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope_BHSr = k_rope_BSr[:, None].expand(B, self.n_heads, S, self.rope_dim)
        q_BHTq = torch.cat((q_nope_BHTn, q_rope_BHTr), dim=-1)
        k_BHSq = torch.cat((k_nope_BHSn, k_rope_BHSr), dim=-1)
        if self.max_logit is not None and self.training:
            self.max_logit.observe(q_BHTq, k_BHSq, mask, scale=1.0 / math.sqrt(self.nope_dim + self.rope_dim))
        return self._attention(q_BHTq, k_BHSq, v_BHSv, mask)

    def _attend_absorbed(self, q_nope_BHTn, q_rope_BHTr, latent_BSC, k_rope_BSr, mask) -> torch.Tensor:
        """Attention in the latent space: query heads absorb W_UK, one shared key [c ; k_r] and value c (MQA), and
        W_UV is applied to each head's attended latent."""
        w_up_HxC = self.w_kv_up.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.latent_dim)
        w_uk_HnC, w_uv_HvC = w_up_HxC.split([self.nope_dim, self.v_dim], dim=1)
        q_latent_BHTC = torch.einsum("bhtn,hnc->bhtc", q_nope_BHTn, w_uk_HnC)  # (W_UK_hᵀ q_h^C)
        q_BHTx = torch.cat((q_latent_BHTC, q_rope_BHTr), dim=-1)
        k_B1Sx = torch.cat((latent_BSC, k_rope_BSr), dim=-1)[:, None]
        z_latent_BHTC = self._attention(q_BHTx, k_B1Sx, latent_BSC[:, None], mask)
        return torch.einsum("bhtc,hvc->bhtv", z_latent_BHTC, w_uv_HvC)
