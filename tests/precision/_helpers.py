"""Small shared pieces of the precision-plugin tests: learnable token data, a loss recorder, a Trainer,
a GPT module that records what the plugin did, and a GPT-2-like model with Conv1D layers."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt.model import GPT, GPTConfig

__all__ = [
    "TINY",
    "Conv1D",
    "GPT2Like",
    "LossRecorder",
    "ProbeGPT",
    "markov_tokens",
    "plugin_trainer",
    "token_loader",
    "tiny_gpt_module",
]


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

    args = dict(preset="tiny", vocab_size=256, block_size=32, warmup_steps=1, learning_rate=3e-3)  # warm-up within the runs of a few steps
    return GPTModule(**{**args, **kwargs})


class LossRecorder(pl.Callback):
    """Keeps every training loss."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


TINY = dict(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=256)


def plugin_trainer(plugin, max_steps=4, **kwargs) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return pl.Trainer(max_steps=max_steps, plugins=[plugin], **{**defaults, **kwargs})


class ProbeGPT(pl.LightningModule):
    """A GPT LightningModule that records what the precision plugin did inside the training step."""

    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(**TINY))
        self.seen: dict = {}

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self.model(idx)
        self.seen.update(
            autocast=torch.is_autocast_enabled("cpu"),
            autocast_dtype=torch.get_autocast_dtype("cpu"),
            logits_dtype=logits.dtype,
        )
        return self.model.loss(logits, targets)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        params = [p for p in self.parameters() if p.grad is not None]
        self.seen["norm_before_clip"] = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.seen["norm_after_clip"] = float(torch.nn.utils.get_total_norm([p.grad for p in params]))

    def on_before_optimizer_step(self, optimizer):
        self.seen["param_dtypes"] = {p.dtype for p in self.parameters()}
        self.seen["grad_dtypes"] = {p.grad.dtype for p in self.parameters() if p.grad is not None}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Conv1D(nn.Module):
    """Hugging Face GPT-2's Conv1D, written out: weight stored in x out, ``x @ weight + bias``."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, self.nx), self.weight).view(*x.shape[:-1], self.nf)


class GPT2Like(pl.LightningModule):
    """GPT-2 projections as Conv1D, an nn.Linear head tied to the embedding (as in GPT2LMHeadModel)."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(256, 64)
        self.c_fc, self.c_proj = Conv1D(8 * 64, 64), Conv1D(64, 8 * 64)
        self.lm_head = nn.Linear(64, 256, bias=False)
        self.lm_head.weight = self.wte.weight

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self.lm_head(self.c_proj(self.c_fc(self.wte(idx))))
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
