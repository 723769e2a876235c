"""`KVCache`: keys and values of past positions for one attention layer, row by row, for incremental decoding.

Rows may be at different lengths (continuous batching refills a finished row while the others go on);
while every row holds the same columns, all real, no mask is built. How: ``docs/generation.md``. Its own
module because ``model/gpt.py`` fills it and ``sampling.py`` / ``batched.py`` create it; it lives with generation,
below the model, since the generation loops create it and import nothing of the model."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["KVCache", "padded_causal_mask"]


def padded_causal_mask(valid: Tensor, columns: Tensor) -> Tensor:
    """Boolean attention mask (B, 1, T, S): the query at column ``columns[b, i]`` sees the valid columns up to its
    own, and always its own (a pad query, whose output is never used, would otherwise see nothing and give NaN).

    Args:
        valid: (B, S) bool, ``True`` where a column holds a real token.
        columns: (B, T) long, the column of each query.
    """
    j = torch.arange(valid.size(1), device=valid.device)  # (S,)
    own = columns[..., None]  # (B, T, 1)
    return ((valid[:, None, :] & (j <= own)) | (j == own))[:, None]  # (B, 1, T, S)


class KVCache:
    """Keys and values of past positions for one attention layer, row by row, allocated on the first ``update`` (or
    :meth:`load_rows`) in that call's device and dtype.

    Args:
        max_len: Most columns a row holds (the model's ``block_size``).

    Example::

        caches = [KVCache(model.config.block_size) for _ in range(model.config.n_layer)]
        logits = model(prompt_ids, caches)            # fills every layer's cache
        logits = model(next_ids, caches)              # attends over the cached positions
        # prompts of different lengths, left-padded, mask True on real tokens:
        logits = model(padded_ids, caches, key_padding_mask=mask)
    """

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.k: Optional[Tensor] = None  # (B, nh, max_len, hs)
        self.v: Optional[Tensor] = None  # (B, nh, max_len, hs)
        self.valid: Optional[Tensor] = None  # (B, max_len) bool: column holds a real token
        self.lengths: Optional[Tensor] = None  # (B,) long: columns filled per row
        self.seen: Optional[Tensor] = None  # (B,) long: real tokens per row (the next position)
        self._lengths: list[int] = []  # host copy of `lengths`: slicing to filled columns never waits for the device
        self.dense = True  # every row holds the same columns, all valid: no mask needed

    @property
    def pos(self) -> int:
        """Columns filled in the longest row (for a dense cache: in every row)."""
        return max(self._lengths, default=0)

    @property
    def batch_size(self) -> int:
        return len(self._lengths)

    def reset(self) -> None:
        """Forget every cached position (the storage is kept)."""
        self._lengths = [0] * len(self._lengths)
        if self.lengths is not None:
            self.lengths.zero_()
            self.seen.zero_()
            self.valid.zero_()
        self.dense = True

    def _allocate(self, like: Tensor, batch_size: int) -> None:
        """Storage for ``batch_size`` rows with the heads, head size, dtype and device of ``like`` (B, nh, T, hs)."""
        _, nh, _, hs = like.shape
        self.k = like.new_zeros(batch_size, nh, self.max_len, hs)
        self.v = like.new_zeros(batch_size, nh, self.max_len, hs)
        self.valid = torch.zeros(batch_size, self.max_len, dtype=torch.bool, device=like.device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=like.device)
        self.seen = torch.zeros(batch_size, dtype=torch.long, device=like.device)
        self._lengths = [0] * batch_size
        self.dense = True

    def _fresh(self, batch_size: int) -> bool:
        """Nothing cached for a batch of ``batch_size`` rows (no storage yet, or an emptied one of another size)."""
        return self.lengths is None or (self.pos == 0 and self.lengths.size(0) != batch_size)

    def _columns(self, T: int, device: torch.device) -> Tensor:
        """(B, T) columns the next ``T`` tokens of each row go to."""
        return self.lengths[:, None] + torch.arange(T, device=device)

    def _check_room(self, T: int) -> None:
        if self.pos + T > self.max_len:
            raise ValueError(f"KVCache holds {self.max_len} positions; cannot append up to {self.pos + T}.")

    def next_positions(
        self, batch_size: int, T: int, key_padding_mask: Optional[Tensor], device: torch.device
    ) -> Tensor:
        """Positions of the next ``T`` tokens, (T,) for a dense cache without padding, else (B, T): a row's real
        tokens before each, what the prompt alone would have (a pad token gets the next real one's)."""
        fresh = self._fresh(batch_size)
        if key_padding_mask is None and (self.dense or fresh):
            start = 0 if fresh else self.pos
            return torch.arange(start, start + T, dtype=torch.long, device=device)  # (T,)
        seen = torch.zeros(batch_size, dtype=torch.long, device=device) if fresh else self.seen
        steps = (
            key_padding_mask.long().cumsum(-1) - 1 if key_padding_mask is not None else torch.arange(T, device=device)
        )
        return (seen[:, None] + steps).clamp(min=0)  # (B, T)

    def attention_mask(
        self, batch_size: int, T: int, key_padding_mask: Optional[Tensor], device: torch.device
    ) -> Optional[Tensor]:
        """Boolean mask (B, 1, T, S) of the keys each of the next ``T`` queries sees (:func:`padded_causal_mask`);
        ``None`` when the cache is dense and there is no padding (causal attention as usual)."""
        fresh = self._fresh(batch_size)
        if key_padding_mask is None and (self.dense or fresh):
            return None
        if fresh:  # nothing cached yet
            cols = torch.arange(T, device=device).expand(batch_size, T)  # (B, T)
            valid = torch.zeros(batch_size, T, dtype=torch.bool, device=device)
        else:
            cols = self._columns(T, device)  # (B, T)
            valid = self.valid[:, : self.pos + T].clone()  # (B, S)
        new = key_padding_mask if key_padding_mask is not None else torch.ones_like(cols, dtype=torch.bool)
        valid.scatter_(1, cols, new)
        return padded_causal_mask(valid, cols)  # (B, 1, T, S)

    def update(self, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """Write ``k``/``v`` (B, n_kv_head, T, hs) after each row's filled columns and return those of all filled
        columns, (B, n_kv_head, S, hs); ``key_padding_mask`` (B, T) is ``False`` on padding (``None``: all real)."""
        B, _, T, _ = k.shape
        stale = self.k is None or (self.k.shape[0], self.k.dtype, self.k.device) != (B, k.dtype, k.device)
        if stale and self.pos == 0:
            self._allocate(k, B)
        self._check_room(T)
        if self.dense and key_padding_mask is None:  # every row at the same column: one slice
            start = self._lengths[0]
            self.k[:, :, start : start + T] = k
            self.v[:, :, start : start + T] = v
            self.valid[:, start : start + T] = True
            self.seen += T
        else:
            cols = self._columns(T, k.device)  # (B, T)
            rows = torch.arange(B, device=k.device)[:, None]  # (B, 1)
            self.k[rows, :, cols] = k.transpose(1, 2)  # indexed (B, T, nh, hs)
            self.v[rows, :, cols] = v.transpose(1, 2)
            new = (
                key_padding_mask
                if key_padding_mask is not None
                else torch.ones(B, T, dtype=torch.bool, device=k.device)
            )
            self.valid[rows, cols] = new
            self.seen += new.sum(-1)
            if key_padding_mask is not None:
                self.dense = False
        self.lengths += T
        self._lengths = [n + T for n in self._lengths]
        end = self.pos
        return self.k[:, :, :end], self.v[:, :, :end]

    def load_rows(self, rows: list[int], other: "KVCache", batch_size: int) -> None:
        """Put every row of ``other`` (a cache just prefilled with new prompts) into rows ``rows`` of this one, whose
        storage is allocated for ``batch_size`` rows on first use."""
        if len(rows) != other.batch_size:
            raise ValueError(f"load_rows got {len(rows)} row indices for a cache of {other.batch_size} rows.")
        if self.k is None:
            self._allocate(other.k, batch_size)
        width = other.pos
        if width > self.max_len:
            raise ValueError(f"KVCache holds {self.max_len} positions; cannot load rows of {width}.")
        index = torch.tensor(rows, dtype=torch.long, device=self.k.device)
        self.k[index, :, :width] = other.k[:, :, :width]
        self.v[index, :, :width] = other.v[:, :, :width]
        self.valid[index] = False
        self.valid[index, :width] = other.valid[:, :width]
        self.lengths[index] = other.lengths
        self.seen[index] = other.seen
        for row, n in zip(rows, other._lengths):
            self._lengths[row] = n
        self.dense = False

    def keep(self, rows: list[int]) -> None:
        """Keep only rows ``rows`` (in that order): the batch shrinks to them (finished rows leave)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.k.device)
        self.k, self.v = self.k[index], self.v[index]
        self.valid, self.lengths, self.seen = self.valid[index], self.lengths[index], self.seen[index]
        self._lengths = [self._lengths[r] for r in rows]
