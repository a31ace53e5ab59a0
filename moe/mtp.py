"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 §2.2): D modules after the main model, module k learning to
predict the token k + 1 positions ahead; the modules (moe/model.py's `MTPModule`) live here only as their targets
and loss, the architecture beside the blocks it reuses.

Legend: B batch, T tokens of a window, D model width, V vocabulary, k depth (1 … K = model.mtp.depth); the window
is t_0 … t_T, inputs t_0 … t_{T-1}, labels t_1 … t_T (data_pipeline/packing.py).

    h^0_i = FinalNorm(h^L_i)                                             what the main head reads
    h'^k_i = M_k [RMSNorm(h^{k-1}_i) ; RMSNorm(Emb(t_{i+k}))]             M_k: 2D → D, i < T - k
    h^k = Norm_k(Block_k(h'^k))                                          causal over the T - k positions
    P^k_i = softmax(Head(h^k_i)),  L_k = mean_i CE(P^k_i, t_{i+k+1})      Emb and Head shared with the main model
    L_MTP = (λ / K) Σ_k L_k                                              λ = model.mtp.loss_weight

Where the paper's h^{k-1} is "the representation" of depth k - 1, we take what that depth's head reads (after its
norm), as the DeepSeek-V3 checkpoints' MTP layer is run by transformers and vLLM. L_k is a mean over the positions
that have a target (the paper divides by T, a factor (T - k) / T apart), so that masked positions weigh nothing.

Which positions have a target, the LM loss's rule carried k tokens further: the LM loss at i predicts t_{i+1} from
t_i's document (t_{i+1} may open the next document when t_i is its EOS) and ignores a label equal to
IGNORE_INDEX. Depth k at i predicts t_{i+k+1} after the chain t_i … t_{i+k}, so it has a target when every label
t_{i+1} … t_{i+k+1} is kept and (with document ids) t_i and t_{i+k} are in one document; t_{i+k+1} may again open
the next document when t_{i+k} is the EOS.
"""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # F.cross_entropy's default, which the LM loss relies on


def mtp_targets(labels_BT: torch.Tensor, document_ids_BT: torch.Tensor | None, depth: int) -> list[torch.Tensor]:
    """For k = 1 … depth the (B, T - k) targets t_{i+k+1} = labels[i + k], IGNORE_INDEX where depth k at i has no
    target (module docstring)."""
    T = labels_BT.shape[1]
    if document_ids_BT is not None:
        document_ids_BT = document_ids_BT.to(labels_BT.device)  # batches arrive on the host
    kept_BT = labels_BT != IGNORE_INDEX  # depth 0: the LM loss's targets
    targets = []
    for k in range(1, depth + 1):
        n = T - k
        kept_BT = kept_BT[:, :n] & (labels_BT[:, k:] != IGNORE_INDEX)
        if document_ids_BT is not None:  # documents are contiguous: t_i's and t_{i+k}'s agree iff all between do
            kept_BT = kept_BT & (document_ids_BT[:, :n] == document_ids_BT[:, k:])
        targets.append(torch.where(kept_BT, labels_BT[:, k:], IGNORE_INDEX))
    return targets


def mtp_loss(logits: list[torch.Tensor], targets: list[torch.Tensor], *, loss_weight: float) -> torch.Tensor:
    """L_MTP = (λ / K) Σ_k L_k over the K depths' (B, T - k, V) logits, each L_k the fp32 cross-entropy averaged over
    the positions with a target (0 where none has one, rather than 0/0)."""
    per_depth = []
    for logits_BNV, targets_BN in zip(logits, targets, strict=True):
        total = F.cross_entropy(logits_BNV.float().flatten(0, 1), targets_BN.flatten(), reduction="sum")
        per_depth.append(total / (targets_BN != IGNORE_INDEX).sum().clamp(min=1))
    return loss_weight / len(per_depth) * torch.stack(per_depth).sum()
