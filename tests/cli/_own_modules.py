"""Small LightningModules of "one's own" for ``gpuopt`` CLI tests: named by class path, as a user names theirs."""

from __future__ import annotations

import os
import signal
from typing import Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from tests._module_shapes import VOCAB, HFCausalLM


def _regression(n: int, d_in: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d_in, generator=g)
    return TensorDataset(x, x.sum(-1, keepdim=True) * 0.1)


class NoLoaderRegressor(pl.LightningModule):
    """A regression module trained on a data module's loaders (it has none of its own)."""

    def __init__(self, d_in: int = 16, d: int = 16, lr: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(d_in, d), nn.ReLU(), nn.Linear(d, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class Regressor(NoLoaderRegressor):
    """With its own loader: 32 rows in batches of 8, 4 steps an epoch."""

    def train_dataloader(self):
        return DataLoader(_regression(32, self.hparams.d_in), batch_size=8, shuffle=True)


class PredictingRegressor(Regressor):
    """With predict data too, so `gpuopt predict` can run on it."""

    def predict_dataloader(self):
        return DataLoader(_regression(16, self.hparams.d_in), batch_size=8)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])


class LazyRegressor(Regressor):
    """Layers built in configure_model: no parameters before fit."""

    def __init__(self, d_in: int = 16, d: int = 16, lr: float = 0.01):
        super().__init__(d_in, d, lr)
        self.net = None

    def configure_model(self):
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(self.hparams.d_in, self.hparams.d), nn.ReLU(), nn.Linear(self.hparams.d, 1))


class _VariableRows(Dataset):
    """``n`` rows of random tokens, 8 to 32 long (fixed by the seed): a corpus of documents of their own lengths."""

    def __init__(self, n: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(8, 33, (n,), generator=g).tolist()
        self.rows = [torch.randint(1, vocab, (length,), generator=g) for length in lengths]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def pad_to_longest(rows: list) -> dict:
    """Dynamic padding, as Hugging Face's collators do: each batch padded to its longest row; ``input_ids``,
    ``attention_mask``, ``labels`` (-100 on padding)."""
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class PaddedHFLlama(pl.LightningModule):
    """A Hugging Face ``LlamaForCausalLM``-shaped model (SwiGLU, RMSNorm, the SDPA mask check that reads the mask
    on the host) with embedding dropout, on a loader of its own with dynamic padding: every batch has the length
    of its longest row. No ``flops_per_token``: ``MFUMonitor`` counts a real step at each new length.

    ``losses``: a file each micro-batch's ``epoch batch_idx global_step loss`` (loss as ``float.hex``) is
    appended to. ``sigterm_at``: the micro-batch (counted in this process, from 1) after which the process
    sends itself SIGTERM, as a scheduler does.
    """

    def __init__(self, losses: Optional[str] = None, sigterm_at: int = 0, lr: float = 3e-3):
        super().__init__()
        self.save_hyperparameters()
        self.model = HFCausalLM()
        self.model.embed_tokens.register_forward_hook(lambda m, args, out: F.dropout(out, 0.1, m.training))  # draws on the RNG
        self.seen = 0

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch)["loss"]
        self.log("train_loss", loss.item())  # a host read in the step, as Hugging Face-style modules do
        self.seen += 1
        if self.hparams.losses:
            with open(self.hparams.losses, "a") as f:
                f.write(f"{self.trainer.current_epoch} {batch_idx} {self.trainer.global_step} {loss.item().hex()}\n")
        if self.seen == self.hparams.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        return DataLoader(_VariableRows(32, VOCAB), batch_size=4, shuffle=True, collate_fn=pad_to_longest)


class EveryNSteps(pl.Callback):
    """A callback of one's own, with an option named like one of ``ModelCheckpoint``'s."""

    def __init__(self, every_n_train_steps: int = 10, message: str = "step"):
        self.every_n_train_steps, self.message = every_n_train_steps, message


class WaitAtStart(pl.Callback):
    """Writes ``<default_root_dir>/started`` (its pid) when training starts, then waits up to 60 s for a signal:
    a run that holds its folder while a test starts another."""

    def on_train_start(self, trainer, pl_module):
        import time
        from pathlib import Path

        (Path(trainer.default_root_dir) / "started").write_text(str(os.getpid()))
        time.sleep(60)
