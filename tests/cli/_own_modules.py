"""Small LightningModules of "one's own" for ``gpuopt`` CLI tests: named by class path, as a user names theirs."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


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
