"""Causal multi-head attention with grouped K/V (MHA, GQA, MQA) — seed 001 §1.2 and seed 000 "GQA".

Legend: B batch, T query positions, S key positions (T = S without a cache), D model width,
H query heads, K key/value heads (H_kv), d head width, G = H / K query heads per KV head.

    A = softmax_S(Q Kᵀ / √d + M),  Z = A V,  out = concat_heads(Z) W_O

Query head h reads KV head h // G. The grouping is handed to scaled_dot_product_attention (`enable_gqa`),
so K and V stay at K heads in memory and in the cache; no repeated copy is kept.
"""

import torch
import torch.nn.functional as F
from torch import nn

from moe.config import ModelConfig
from moe.kv_cache import KVCache
from moe.max_logit import MaxLogitRecorder
from moe.rope import apply_rope


def build_attention_mask(
    query_positions_T: torch.Tensor,
    key_length: int,
    key_valid_BS: torch.Tensor | None = None,
    document_ids_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask (B or 1, 1, T, S), True = may attend: causal on absolute positions, valid keys only, and,
    with `document_ids_BS`, keys of the query's own document only (block-diagonal causal over packed documents):

        M[b, i, j] = (j ≤ p_i) ∧ valid[b, j] ∧ (doc[b, j] = doc[b, p_i])

    Query i sits at absolute position query_positions_T[i] (the cached prefix length plus its index in the
    step), so it sees keys 0 … that position, not a top-left triangle of the step's own length.
    """
    key_positions_S = torch.arange(key_length, device=query_positions_T.device)
    allowed_TS = key_positions_S[None, :] <= query_positions_T[:, None]
    if key_valid_BS is None and document_ids_BS is None:
        return allowed_TS[None, None]
    allowed_BTS = allowed_TS[None]
    if document_ids_BS is not None:
        query_documents_BT = document_ids_BS[:, query_positions_T]
        allowed_BTS = allowed_BTS & (query_documents_BT[:, :, None] == document_ids_BS[:, None, :])
    if key_valid_BS is None:
        return allowed_BTS[:, None]
    allowed_BTS = allowed_BTS & key_valid_BS[:, None, :].bool()
    # A padding query has no valid key to its left under left padding. Its output is discarded by the caller,
    # so let it attend to itself to stay finite; real queries keep exactly the mask above.
    query_is_padding_BT = ~key_valid_BS[:, -query_positions_T.numel() :].bool()
    self_TS = key_positions_S[None, :] == query_positions_T[:, None]
    allowed_BTS = allowed_BTS | (query_is_padding_BT[:, :, None] & self_TS[None])
    return allowed_BTS[:, None]


def require_a_visible_key(mask: torch.Tensor) -> None:
    """Raise unless every query row of a boolean (True = may attend) or additive (-inf = may not) mask allows a key."""
    allowed = mask if mask.dtype == torch.bool else mask > float("-inf")
    if not bool(allowed.any(dim=-1).all()):
        raise ValueError("attention mask leaves a query row with no visible key: every real query must see a key")


def grouped_attention(
    q_BHTd: torch.Tensor,
    k_BKSd: torch.Tensor,
    v_BKSd: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    check_mask: bool = True,
) -> torch.Tensor:
    """softmax(QKᵀ·scale + M)V with query head h reading KV head h // (H / K); returns (B, H, T, d_v).

    `mask` is boolean (True = may attend) or additive (a float bias, -inf = may not attend: ALiBi); `scale`
    defaults to 1/√d of the query width. A query row whose mask allows no key has no softmax distribution; it is
    an error, not a silent NaN or a uniform average. `check_mask=False`: the caller has checked this mask already,
    as the Transformer does once per forward rather than in every layer (the check reads the device to the host,
    which also splits a compiled block's graph).
    """
    n_heads, n_kv_heads = q_BHTd.shape[1], k_BKSd.shape[1]
    if n_heads % n_kv_heads != 0:
        raise ValueError(f"{n_heads} query heads cannot be grouped over {n_kv_heads} KV heads: use a divisor")
    if mask is not None and check_mask:
        require_a_visible_key(mask)
    return F.scaled_dot_product_attention(
        q_BHTd,
        k_BKSd,
        v_BKSd,
        attn_mask=mask,
        is_causal=is_causal and mask is None,
        dropout_p=dropout_p,
        enable_gqa=n_kv_heads != n_heads,
        scale=scale,
    )


class Attention(nn.Module):
    """Q/K/V/O projections around `grouped_attention`; RoPE (if any) rotates Q and K at absolute positions."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.dropout = config.dropout
        bias = config.attention_bias
        self.w_q = nn.Linear(config.d_model, self.n_heads * self.head_dim, bias=bias)
        self.w_k = nn.Linear(config.d_model, self.n_kv_heads * self.head_dim, bias=bias)
        self.w_v = nn.Linear(config.d_model, self.n_kv_heads * self.head_dim, bias=bias)
        self.w_o = nn.Linear(self.n_heads * self.head_dim, config.d_model, bias=bias)
        self.max_logit: MaxLogitRecorder | None = None  # set while a run watches S_max (moe/max_logit.py)

    def forward(
        self,
        x_BTD: torch.Tensor,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BHTd = self.w_q(x_BTD).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k_BKTd = self.w_k(x_BTD).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v_BKTd = self.w_v(x_BTD).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if rope_cos_sin is not None:
            q_BHTd, k_BKTd = apply_rope(q_BHTd, *rope_cos_sin), apply_rope(k_BKTd, *rope_cos_sin)
        if kv_cache is not None:
            k_BKSd, v_BKSd = kv_cache.update(self.layer_idx, k_BKTd, v_BKTd)
        else:
            k_BKSd, v_BKSd = k_BKTd, v_BKTd
        if self.max_logit is not None and self.training:
            self.max_logit.observe(q_BHTd, k_BKSd, mask, scale=self.head_dim**-0.5)
        # Without a mask and without a prefix, plain causal attention takes SDPA's fused causal path.
        is_causal = mask is None and k_BKSd.shape[2] == T and T > 1
        z_BHTd = grouped_attention(
            q_BHTd,
            k_BKSd,
            v_BKSd,
            mask=mask,
            is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0,
            check_mask=False,  # Transformer.forward checked it once
        )
        z_BTD = z_BHTd.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # heads back beside each other
        return self.w_o(z_BTD)
