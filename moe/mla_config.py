"""Configuration of multi-head latent attention (`ModelConfig.mla`, used when `model.attention=mla`; moe/mla.py).

Plain int/bool/Optional fields so Hydra's structured configs can hold it; `resolve` fills the shapes left unset
from the model's head width and checks them, once, when the model config is built.
"""

from dataclasses import dataclass
from typing import Optional

from moe.errors import ModelConfigError

# DeepSeek's reference code normalises both latents with RMSNorm's default ε, whatever the model's norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass
class MLAConfig:
    """Shapes of multi-head latent attention (`model.attention=mla`); None fields take DeepSeek-V2's ratios to
    the model's head_dim d_h when the model is built: d_nope = d_v = d_h, d_rope = d_h / 2, kv_lora_rank = 4·d_h.

    q_lora_rank=None projects queries at full rank (DeepSeek-V2-Lite); an int compresses them through a latent of
    that width with its own RMSNorm (DeepSeek-V2/V3). absorb_decode runs cached forwards with the absorbed weights
    (module docstring); the two paths give the same logits up to rounding.
    """

    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    absorb_decode: bool = True

    def resolve(self, head_dim: int) -> None:
        """Fill the None shapes from the model's head_dim, then check them."""
        if self.qk_nope_head_dim is None:
            self.qk_nope_head_dim = head_dim
        if self.qk_rope_head_dim is None:
            self.qk_rope_head_dim = max(2, head_dim // 2 // 2 * 2)
        if self.v_head_dim is None:
            self.v_head_dim = head_dim
        if self.kv_lora_rank is None:
            self.kv_lora_rank = 4 * head_dim
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ModelConfigError(f"model.mla.{name}={value!r} must be a positive integer")
        if self.q_lora_rank is not None and not (isinstance(self.q_lora_rank, int) and self.q_lora_rank >= 1):
            raise ModelConfigError(
                f"model.mla.q_lora_rank={self.q_lora_rank!r} must be a positive integer, or null for a full-rank query"
            )
        if self.qk_rope_head_dim % 2 != 0:
            raise ModelConfigError(
                f"model.mla.qk_rope_head_dim={self.qk_rope_head_dim} is odd but RoPE rotates coordinate pairs: "
                "use an even width"
            )

    @property
    def qk_head_dim(self) -> int:
        """Width of a query/key head: content plus position branch, n + r."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim
