"""Configuration of multi-token prediction (`ModelConfig.mtp`; moe/mtp.py): how many future tokens beyond the next
one the model learns to predict, and how much that loss weighs against the LM loss.

Plain int/float fields so Hydra's structured configs can hold it; checked once, when the model config is built.
"""

from dataclasses import dataclass

from moe.errors import ModelConfigError

DEFAULT_LOSS_WEIGHT = 0.3  # DeepSeek-V3's λ for its first 10T tokens (0.1 for the last 4.8T)


@dataclass
class MTPConfig:
    """`depth` = D sequential MTP modules (0: none, the default; DeepSeek-V3 uses 1); module k predicts the token
    k + 1 positions ahead. The loss added to the LM loss is L_MTP = (loss_weight / D) · Σ_k L_k (moe/mtp.py)."""

    depth: int = 0
    loss_weight: float = DEFAULT_LOSS_WEIGHT

    def __post_init__(self) -> None:
        if not (isinstance(self.depth, int) and not isinstance(self.depth, bool) and self.depth >= 0):
            raise ModelConfigError(
                f"model.mtp.depth={self.depth!r} must be a non-negative integer: 0 turns multi-token prediction off"
            )
        if self.depth == 0 and self.loss_weight != DEFAULT_LOSS_WEIGHT:
            raise ModelConfigError(
                f"model.mtp.loss_weight={self.loss_weight} is set but model.mtp.depth=0 builds no MTP module: set "
                "model.mtp.depth>=1 or drop the loss_weight override"
            )
        if self.depth > 0 and not self.loss_weight > 0:
            raise ModelConfigError(
                f"model.mtp.loss_weight={self.loss_weight} must be positive with model.mtp.depth={self.depth} (its "
                "modules would learn nothing): use 0.3 as DeepSeek-V3 does, or model.mtp.depth=0"
            )
