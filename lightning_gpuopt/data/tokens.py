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
    """Write token-id chunks to a flat binary file, whole or not at all (a temporary file renamed); return the count."""
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
    """Tokens ``[start, end)`` of a memory-mapped file, opened lazily in each worker; with ``answers`` (a byte per
    token, 1 for answer tokens) the other targets are -1, which the loss ignores."""

    def __init__(self, path: str | Path, dtype: str, start: int, end: int, block_size: int,
                 answers: Optional[str | Path] = None) -> None:
        if end - start < block_size + 1:
            raise ValueError(
                f"it holds {end - start} tokens, fewer than one training window of "
                f"block_size + 1 = {block_size + 1}: use a larger corpus or a smaller data.block_size."
            )
        self.path, self.dtype, self.start, self.end, self.block_size = str(path), dtype, start, end, block_size
        self.answers = None if answers is None else str(answers)
        self._tokens: Optional[np.memmap] = None
        self._answers: Optional[np.memmap] = None

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def _window(self, offset: int) -> tuple[Tensor, Tensor]:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        lo = self.start + offset
        chunk = torch.from_numpy(self._tokens[lo : lo + self.block_size + 1].astype(np.int64))
        if self.answers is None:
            return chunk[:-1], chunk[1:]  # inputs, next-token targets
        learnt = torch.from_numpy(self._answer_bytes(lo + 1, lo + self.block_size + 1).astype(np.bool_))
        return chunk[:-1], chunk[1:].masked_fill(~learnt, -1)  # only answer tokens are targets

    def _answer_bytes(self, lo: int, hi: int) -> np.ndarray:
        if self._answers is None:
            self._answers = np.memmap(self.answers, dtype=np.uint8, mode="r")
        return self._answers[lo:hi]

    def __getstate__(self) -> dict:  # memmaps are reopened, not pickled, in worker processes
        return {**self.__dict__, "_tokens": None, "_answers": None}


_DRAWS = 100  # windows drawn for one index before a corpus is called too sparse in answers


class RandomWindows(_TokenSpan):
    """Windows of ``block_size + 1`` tokens for training: window ``i >= 0`` at an offset drawn from ``(seed, i)``, a
    pure function of its index (``docs/data.md``).

    Args:
        path: Token file of dtype ``dtype``; the span ``[start, end)`` is sampled.
        block_size: Model context length; each item is ``(x, y)`` of that length.
        length: Windows per epoch; ``None``: ``(end - start) // block_size``.
        answers: The file marking answer tokens, for a loss on them only; a window is then drawn again (from
            ``(seed, i, attempt)``) until it holds one.
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
        answers: Optional[str | Path] = None,
    ) -> None:
        super().__init__(path, dtype, start, end, block_size, answers)
        self.length = length if length is not None else max(1, self.num_tokens // block_size)
        self.seed = seed
        self._high = self.num_tokens - block_size  # exclusive upper bound of an offset

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if i < 0:
            raise IndexError(i)
        offset = int(np.random.default_rng((self.seed, i)).integers(0, self._high))
        if self.answers is not None:
            offset = self._with_answer(i, offset)
        return self._window(offset)

    def _with_answer(self, i: int, offset: int) -> int:
        """``offset``, or the first window drawn after it from ``(seed, i, attempt)`` that holds an answer token."""
        for attempt in range(1, _DRAWS + 1):
            if self._answer_bytes(self.start + offset + 1, self.start + offset + self.block_size + 1).any():
                return offset
            offset = int(np.random.default_rng((self.seed, i, attempt)).integers(0, self._high))
        raise ValueError(
            f"{_DRAWS} windows of {self.block_size} tokens drawn from {Path(self.path).parent} held no answer token: "
            "the completions are too rare in this corpus for a loss on them only. Use data.loss_on='all', a larger "
            "data.block_size, or a corpus with more completions."
        )


class SequentialWindows(_TokenSpan):
    """Consecutive non-overlapping windows covering the span (for validation and test)."""

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._window(i * self.block_size)
