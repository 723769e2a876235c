"""Token streams on disk (memory-mapped ``.bin`` files) and the datasets that read windows from them."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["RandomWindows", "SequentialWindows", "token_dtype", "write_tokens"]


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id: ``uint16`` up to 65,536 tokens, else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def write_tokens(path: str | Path, chunks: Iterable[np.ndarray], dtype: np.dtype) -> int:
    """Write token-id chunks to a flat binary file, atomically; return the number of tokens.

    The file appears under its name only once complete (written to ``path.tmp``, then renamed),
    so an interrupted run never leaves a truncated token file behind.
    """
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    count = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                chunk = np.asarray(chunk)
                if chunk.size and int(chunk.max()) > np.iinfo(dtype).max:
                    raise ValueError(f"token id {int(chunk.max())} does not fit in {dtype}.")
                f.write(chunk.astype(dtype, copy=False).tobytes())
                count += chunk.size
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return count


class _TokenSpan(Dataset):
    """Tokens ``[start, end)`` of a memory-mapped file; the map is opened lazily in each worker."""

    def __init__(self, path: str | Path, dtype: str, start: int, end: int, block_size: int) -> None:
        if end - start < block_size + 1:
            raise ValueError(
                f"{Path(path).name} holds {end - start} tokens in this split, fewer than one training window of "
                f"block_size + 1 = {block_size + 1}: use a larger corpus, a smaller data.block_size, or a larger "
                "data.val_fraction."
            )
        self.path, self.dtype, self.start, self.end, self.block_size = str(path), dtype, start, end, block_size
        self._tokens: Optional[np.memmap] = None

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def _window(self, offset: int) -> tuple[Tensor, Tensor]:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        lo = self.start + offset
        chunk = torch.from_numpy(self._tokens[lo : lo + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]  # inputs, next-token targets

    def __getstate__(self) -> dict:  # memmaps are reopened, not pickled, in worker processes
        return {**self.__dict__, "_tokens": None}


class RandomWindows(_TokenSpan):
    """Windows of ``block_size + 1`` tokens at random offsets (for training); ``length`` per epoch.

    Window ``i`` starts at an offset drawn from a generator seeded with ``(seed, i)``: the
    dataset is a pure function of its index, so shuffling, distributed samplers and resuming
    all see the same windows. Any index ``i >= 0`` is valid: ``ResumableSampler`` reads indices
    ``epoch * length + position``, so every epoch draws new windows.

    Args:
        path: Token file.
        dtype: Its dtype (``uint16`` or ``uint32``).
        start: First token of the span to sample from.
        end: One past its last token.
        block_size: Model context length; each item is ``(x, y)`` of that length.
        length: Number of windows (an "epoch"); defaults to ``(end - start) // block_size``.
        seed: Seed of the offsets.
    """

    def __init__(
        self,
        path: str | Path,
        dtype: str,
        start: int,
        end: int,
        block_size: int,
        length: Optional[int] = None,
        seed: int = 0,
    ) -> None:
        super().__init__(path, dtype, start, end, block_size)
        self.length = length if length is not None else max(1, self.num_tokens // block_size)
        self.seed = seed
        self._high = self.num_tokens - block_size  # exclusive upper bound of an offset

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if i < 0:
            raise IndexError(i)
        offset = int(np.random.default_rng((self.seed, i)).integers(0, self._high))
        return self._window(offset)


class SequentialWindows(_TokenSpan):
    """Consecutive non-overlapping windows covering the span (for validation and test)."""

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._window(i * self.block_size)
