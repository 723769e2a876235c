"""Small shared pieces of the precision-plugin tests: learnable token data and a loss recorder."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["LossRecorder", "markov_tokens", "token_loader", "tiny_gpt_module"]


def markov_tokens(n_seq: int, seq_len: int, vocab: int = 256, noise: float = 0.1, seed: int = 0) -> torch.Tensor:
    """(n_seq, seq_len + 1) tokens where the next token is a fixed function of the current one,
    except with probability ``noise``: a model can learn it, so the loss falls well below ln(vocab)."""
    g = torch.Generator().manual_seed(seed)
    step = torch.randperm(vocab, generator=g)
    x = torch.empty(n_seq, seq_len + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (n_seq,), generator=g)
    for t in range(seq_len):
        rand = torch.randint(0, vocab, (n_seq,), generator=g)
        keep = torch.rand(n_seq, generator=g) >= noise
        x[:, t + 1] = torch.where(keep, step[x[:, t]], rand)
    return x


def token_loader(n_seq: int = 256, seq_len: int = 32, batch_size: int = 8, seed: int = 0) -> DataLoader:
    data = markov_tokens(n_seq, seq_len, seed=seed)
    ds = TensorDataset(data[:, :-1].contiguous(), data[:, 1:].contiguous())
    return DataLoader(ds, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))


def tiny_gpt_module(**kwargs):
    from lightning_gpuopt.model import GPTModule

    args = dict(preset="tiny", vocab_size=256, block_size=32, warmup_steps=10, learning_rate=3e-3)
    return GPTModule(**{**args, **kwargs})


class LossRecorder(pl.Callback):
    """Keeps every training loss."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
