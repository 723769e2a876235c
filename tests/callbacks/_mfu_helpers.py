"""Small pieces shared by the MFUMonitor tests: a controlled clock and token datasets."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt.model import GPTModule


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class TokenBatches(Dataset):
    """``n`` ready-made ``(input_ids, targets)`` batches of shape (B, T); fetching one advances ``clock``."""

    def __init__(self, n: int, batch_size: int, seq_len: int, vocab: int = 512, clock=None, fetch_s: float = 0.0):
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (n, batch_size, seq_len + 1), generator=g)
        self.clock, self.fetch_s = clock, fetch_s

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        if self.clock is not None:
            self.clock.advance(self.fetch_s)
        return self.data[i, :, :-1], self.data[i, :, 1:]


def loader(dataset: Dataset) -> DataLoader:
    return DataLoader(dataset, batch_size=None, shuffle=False, num_workers=0)


class ClockedGPTModule(GPTModule):
    """Tiny GPT whose every training step takes exactly ``step_s`` seconds on ``clock``."""

    def __init__(self, clock: FakeClock, step_s: float, **kwargs) -> None:
        super().__init__(**{"warmup_steps": 1, **kwargs})  # runs of a few steps: a warm-up that fits them
        self._clock, self._step_s = clock, step_s

    def training_step(self, batch, batch_idx):
        self._clock.advance(self._step_s)
        return super().training_step(batch, batch_idx)
