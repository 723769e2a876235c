"""No host-device synchronisation from this package on training steps that do not log.

A real fit (GPTModule with a fused AdamW, MFUMonitor, NonFiniteGuard in its default mode, the
progress bar on, gradient accumulation) with every way a tensor reaches the host counted: ``item``,
``tolist``, ``__float__``/``__int__``/``__bool__`` and ``torch.cuda.synchronize``. A call counts as
ours when a frame of ``lightning_gpuopt`` is on its stack. On CPU these calls cost nothing, but they
are the same calls that wait for the GPU on CUDA.
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_gpuopt.callbacks import MFUMonitor, NonFiniteGuard
from lightning_gpuopt.model import GPTModule
from lightning_gpuopt.model.optim import build_adamw
from tests.callbacks.test_nonfinite_guard import _loader

PACKAGE = "/lightning_gpuopt/"
LOG_EVERY, ACCUMULATE = 5, 2


def fused_optimizers(module: GPTModule) -> dict:
    """GPTModule's optimizer and schedule with the fused AdamW it builds on CUDA, here on the CPU."""
    config = GPTModule.configure_optimizers(module)
    fused = build_adamw(module.model, module.hparams.learning_rate, module.hparams.weight_decay, fused=True)
    config["lr_scheduler"]["scheduler"].optimizer = fused
    return {"optimizer": fused, "lr_scheduler": config["lr_scheduler"]}


class FusedGPT(GPTModule):
    def configure_optimizers(self):
        return fused_optimizers(self)


class Where(Callback):
    """Knows which micro-batch runs, and whether its on_train_batch_end follows a logging optimizer step."""

    def __init__(self):
        self.batch_idx = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch_idx = batch_idx

    def on_train_end(self, trainer, pl_module):
        self.batch_idx = None


def _origin() -> str:
    """``"ours"`` if a frame of the package is on the stack, ``"loader"`` for a DataLoader starting an
    epoch (it draws its base seed with ``.item()``), else ``"other"`` (Lightning, torch)."""
    frame, origin = sys._getframe(2), "other"
    while frame is not None:
        name = frame.f_code.co_filename
        if PACKAGE in name and "/tests/" not in name:
            return "ours"
        if name.endswith("torch/utils/data/dataloader.py") and frame.f_code.co_name == "__iter__":
            origin = "loader"
        frame = frame.f_back
    return origin


def test_no_sync_from_us_on_steps_that_do_not_log(monkeypatch, tmp_path):
    where, trainer_ref, calls = Where(), {}, []

    def counted(name, original):
        def wrapper(*args, **kwargs):
            trainer = trainer_ref.get("t")
            if where.batch_idx is not None:
                step_done = (where.batch_idx + 1) % ACCUMULATE == 0
                logging = step_done and trainer.global_step % LOG_EVERY == 0
                calls.append((name, trainer.global_step, where.batch_idx, _origin(), logging))
            return original(*args, **kwargs)

        return wrapper

    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.cuda, "synchronize", counted("cuda.synchronize", torch.cuda.synchronize))

    guard = NonFiniteGuard()
    trainer = pl.Trainer(
        max_steps=12, accumulate_grad_batches=ACCUMULATE, log_every_n_steps=LOG_EVERY, limit_val_batches=0,
        logger=pl.loggers.CSVLogger(tmp_path), enable_checkpointing=False, enable_model_summary=False,
        callbacks=[where, guard, MFUMonitor(warmup_steps=LOG_EVERY)], default_root_dir=tmp_path,
    )
    trainer_ref["t"] = trainer
    module = FusedGPT(preset="tiny", vocab_size=256, block_size=32, warmup_steps=0)
    trainer.fit(module, _loader(n=128))
    assert trainer.global_step == 12 and guard.active_mode == "deferred"
    # Our reads at logging steps (the progress bar's loss, the guard's counters) are seen: the count works.
    assert {c[0] for c in calls if c[3] == "ours" and c[-1]} >= {"item", "tolist"}
    # On the other steps nothing reaches the host: not from us, and not from Lightning on our behalf
    # (a `self.log(..., prog_bar=True)` would show here as Lightning's `.item()` on every batch).
    assert [c for c in calls if not c[-1] and c[3] != "loader"] == []
