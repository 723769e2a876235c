"""For AutoBatchSize tests: a tiny GPT that runs out of memory like a GPU would, deterministic token data,
a quiet CPU Trainer."""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt.model import GPTModule

VOCAB, BLOCK = 256, 16


class OOMAbove(GPTModule):
    """Raises the CUDA caching allocator's error when a micro-batch is larger than the device "holds".

    ``limit`` applies from the start; ``later_limit`` from optimizer step ``later_step`` on
    (longer sequences or fragmentation late in a run). ``None`` means no limit.
    """

    def __init__(self, limit: Optional[int] = None, later_step: int = 0, later_limit: Optional[int] = None, **kw):
        kw.setdefault("preset", "tiny")
        kw.setdefault("vocab_size", VOCAB)
        kw.setdefault("block_size", BLOCK)
        kw.setdefault("warmup_steps", 1)  # no longer than the shortest run here (max_steps=1): no warm-up-cut warning
        super().__init__(**kw)
        self.limit, self.later_step, self.later_limit = limit, later_step, later_limit

    def _limit(self) -> Optional[int]:
        if self.later_limit is not None and self._trainer is not None and self.trainer.global_step >= self.later_step:
            return self.later_limit
        return self.limit

    def training_step(self, batch, batch_idx):
        limit = self._limit()
        if limit is not None and batch[0].size(0) > limit:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB"
            )
        return super().training_step(batch, batch_idx)


class _Windows(Dataset):
    def __init__(self, tokens: torch.Tensor, n: int, block: int) -> None:
        self.tokens, self.n, self.block = tokens, n, block

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        chunk = self.tokens[i : i + self.block + 1]
        return chunk[:-1].clone(), chunk[1:].clone()


class TokenData(pl.LightningDataModule):
    """``n`` overlapping windows of a fixed random token stream, in a fixed order (no shuffling)."""

    def __init__(self, batch_size: int = 8, n: int = 256, seed: int = 0, block: int = BLOCK) -> None:
        super().__init__()
        self.batch_size = batch_size
        generator = torch.Generator().manual_seed(seed)
        self.dataset = _Windows(torch.randint(0, VOCAB, (n + block + 1,), generator=generator), n, block)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False, drop_last=True)


class StepRecorder(pl.Callback):
    """Per optimizer step: the mean loss of its micro-batches and the samples it saw (first 8 tokens of each)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.samples: list[list[int]] = []
        self.micro_batches: list[int] = []
        self._buffer: list[float] = []
        self._seen: list[int] = []
        self.batch_ends = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % trainer.accumulate_grad_batches == 0:  # a (re)started optimizer step
            self._buffer, self._seen = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batch_ends += 1
        self._buffer.append(float(outputs["loss"]))  # Lightning's loss here is divided by the accumulation
        self._seen.extend(tuple(row) for row in batch[0][:, :8].tolist())
        self.micro_batches.append(batch[0].size(0))
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.losses.append(sum(self._buffer))
            self.samples.append(sorted(self._seen))


def cpu_trainer(callbacks, max_steps=4, **kw) -> pl.Trainer:
    """A quiet one-device CPU Trainer (no logger, no checkpoints unless asked)."""
    kw.setdefault("logger", False)
    kw.setdefault("enable_checkpointing", False)
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **kw,
    )
