"""The largest attention logit each head produces — the stability signal QK-clip acts on (Kimi K2, MuonClip).

Legend: B batch, H query heads, K key/value heads, T queries, S keys, d the query/key width of a head.

    S_max^h = max_{b, i, j ≤ i} q_{b,h,i} · k_{b,h//G,j} · scale        (scale = 1/√d, the softmax's own)

over the keys a query may see (the causal/document/padding mask), without the additive bias an ALiBi mask carries:
the bias is fixed, the clip controls what training learns in W_Q and W_K. SDPA never materialises the scores, so
the recorder computes them again beside it, under no_grad, CHUNK query rows at a time: one more Q·Kᵀ per forward
(2·B·H·T·S·d FLOPs, half of attention's) and at most B·H·CHUNK·S floats at once.
"""

import torch

CHUNK = 256  # query rows per block of recomputed scores


@torch.no_grad()
def max_logit_per_head(
    q_BHTd: torch.Tensor, k_BKSd: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """S_max^h for every head h, fp32 (H,); `mask` as grouped_attention takes it (None: causal, the T queries
    being the last T of the S positions), boolean True = may attend or additive -inf = may not."""
    B, H, T, _ = q_BHTd.shape
    S, group = k_BKSd.shape[2], H // k_BKSd.shape[1]
    k_BHSd = k_BKSd.float().repeat_interleave(group, dim=1) if group > 1 else k_BKSd.float()
    key_positions_S = torch.arange(S, device=q_BHTd.device)
    best_H = torch.full((H,), float("-inf"), device=q_BHTd.device)
    for start in range(0, T, CHUNK):
        rows = slice(start, min(start + CHUNK, T))
        scores_BHcS = (q_BHTd[:, :, rows].float() @ k_BHSd.mT) * scale
        if mask is None:
            query_positions_c = torch.arange(rows.start, rows.stop, device=q_BHTd.device) + (S - T)
            allowed = key_positions_S[None, :] <= query_positions_c[:, None]
        else:
            block = mask[:, :, rows]
            allowed = block if block.dtype == torch.bool else block > float("-inf")
        scores_BHcS = scores_BHcS.masked_fill(~allowed, float("-inf"))
        best_H = torch.maximum(best_H, scores_BHcS.amax(dim=(0, 2, 3)))
    return best_H


class MaxLogitRecorder:
    """Held by an attention module while a run asks for S_max (QK-clip, or logging.attention_max_logit): the
    running max per head over the training forwards since the last `take()`."""

    def __init__(self) -> None:
        self.max_H: torch.Tensor | None = None

    def observe(self, q_BHTd: torch.Tensor, k_BKSd: torch.Tensor, mask: torch.Tensor | None, scale: float) -> None:
        seen_H = max_logit_per_head(q_BHTd, k_BKSd, mask, scale)
        self.max_H = seen_H if self.max_H is None else torch.maximum(self.max_H, seen_H)

    def take(self) -> torch.Tensor | None:
        """The max since the last take (None if no training forward ran), and a fresh start."""
        seen, self.max_H = self.max_H, None
        return seen
