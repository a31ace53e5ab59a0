"""Key/value cache for incremental decoding (seed 001 §1.5, "用前缀等价性约束缓存优化").

Stores only the n_kv_heads heads each layer really has, so a GQA/MQA model keeps its cache saving:
bytes = 2 · B · L · S · H_kv · d_h · s. Query heads are mapped onto KV heads at attention time, never by
writing repeated K/V here.
"""

import torch


class _PrefixCache:
    """What every cache shares: `max_len` preallocated positions, of which the first `length` are filled."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0  # positions already written, i.e. the absolute position of the next token

    def _end_of_step(self, n_positions: int) -> int:
        """Where a step of `n_positions` written after the cached prefix ends; refuses one that does not fit."""
        end = self.length + n_positions
        if end > self.max_len:
            raise ValueError(
                f"KV cache holds {self.max_len} positions but this step needs {end}: "
                "allocate a longer cache or generate fewer tokens"
            )
        return end

    def advance(self, n_positions: int) -> None:
        """Called once per forward, after every layer has written its step."""
        self.length += n_positions


class KVCache(_PrefixCache):
    """Preallocated K and V for every layer, shape (L, B, H_kv, S_max, d_h); `length` positions are filled."""

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(max_len)
        shape = (n_layers, batch_size, n_kv_heads, max_len, head_dim)
        self.k_LBKSd = torch.zeros(shape, dtype=dtype, device=device)
        self.v_LBKSd = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_bytes(self) -> int:
        return self.k_LBKSd.numel() * self.k_LBKSd.element_size() * 2

    def update(self, layer: int, k_BKTd: torch.Tensor, v_BKTd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's K/V for `layer` after the cached prefix; return views of prefix + step."""
        end = self._end_of_step(k_BKTd.shape[2])
        self.k_LBKSd[layer, :, :, self.length : end] = k_BKTd
        self.v_LBKSd[layer, :, :, self.length : end] = v_BKTd
        return self.k_LBKSd[layer, :, :, :end], self.v_LBKSd[layer, :, :, :end]


class LatentKVCache(_PrefixCache):
    """Multi-head latent attention's cache (moe/mla.py): per layer only the content latent c (d_c) and the shared
    position key k_r (d_r) of each position, shapes (L, B, S_max, d_c) and (L, B, S_max, d_r):

        bytes = B · L · S · (d_c + d_r) · s        (seed 001; the per-head keys and values are never stored)
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        latent_dim: int,
        rope_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(max_len)
        self.latent_LBSC = torch.zeros((n_layers, batch_size, max_len, latent_dim), dtype=dtype, device=device)
        self.k_rope_LBSr = torch.zeros((n_layers, batch_size, max_len, rope_dim), dtype=dtype, device=device)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.latent_LBSC, self.k_rope_LBSr))

    def update(
        self, layer: int, latent_BTC: torch.Tensor, k_rope_BTr: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's latents for `layer` after the cached prefix; return views of prefix + step."""
        end = self._end_of_step(latent_BTC.shape[1])
        self.latent_LBSC[layer, :, self.length : end] = latent_BTC
        self.k_rope_LBSr[layer, :, self.length : end] = k_rope_BTr
        return self.latent_LBSC[layer, :, :end], self.k_rope_LBSr[layer, :, :end]
