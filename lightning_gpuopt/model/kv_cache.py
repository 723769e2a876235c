"""`KVCache`: keys and values of past positions for one attention layer, for incremental decoding.

Its own module because two others use it and neither should import the other for it: attention in
``gpt.py`` fills it, and ``generation.py`` creates one per block.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of past positions for one attention layer, for incremental decoding.

    The storage is allocated on the first ``update`` with that call's device and dtype (the dtype
    attention runs in, e.g. bf16 under autocast).

    Args:
        max_len: Most positions the cache holds (the model's ``block_size``).

    Example::

        caches = [KVCache(model.config.block_size) for _ in range(model.config.n_layer)]
        logits = model(prompt_ids, caches)            # fills every layer's cache
        logits = model(next_ids, caches)              # attends over the cached positions
    """

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.k: Optional[Tensor] = None
        self.v: Optional[Tensor] = None
        self.pos = 0  # number of positions filled

    def reset(self) -> None:
        """Forget every cached position (the storage is kept)."""
        self.pos = 0

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k``/``v`` of shape (B, nh, T, hs) (nh: the key/value heads, ``n_kv_head``); return all so far."""
        start, end = self.pos, self.pos + k.size(2)
        if end > self.max_len:
            raise ValueError(f"KVCache holds {self.max_len} positions; cannot append up to {end}.")
        stale = self.k is None or (self.k.shape[0], self.k.dtype, self.k.device) != (k.shape[0], k.dtype, k.device)
        if stale and start == 0:
            B, nh, _, hs = k.shape
            self.k = k.new_zeros(B, nh, self.max_len, hs)
            self.v = v.new_zeros(B, nh, self.max_len, hs)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.pos = end
        return self.k[:, :, :end], self.v[:, :, :end]
