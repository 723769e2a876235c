"""What MFUMonitor says: its counted FLOPs once per fit, however many sequence lengths the batches have."""

from __future__ import annotations

import logging

import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_gpuopt.callbacks import MFUMonitor


def test_the_counted_flops_per_token_are_said_once_under_dynamic_padding(tmp_path, caplog):
    from tests._module_shapes import SHAPES

    torch.manual_seed(0)
    module = SHAPES["nanogpt"]()
    lengths = [8, 16, 24, 12, 20, 28]  # a new padded length at every batch, as dynamic padding gives
    batches = [torch.randint(0, 64, (2, t + 1)) for t in lengths]
    loader = DataLoader([(b[:, :-1], b[:, 1:]) for b in batches], batch_size=None)
    monitor = MFUMonitor(log_every_n_steps=2, warmup_steps=1, peak_flops=1e12)
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=1, max_steps=len(lengths), logger=False,
                      enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                      limit_val_batches=0, callbacks=[monitor])
    with caplog.at_level(logging.INFO):
        trainer.fit(module, loader)
    said = [r.getMessage() for r in caplog.records if "MFLOPs per token" in r.getMessage()]
    assert len(said) == 1 and "at sequence length 8," in said[0] and "each new length is counted once" in said[0]
    assert monitor.flops_source == "NanoGPTModule.training_step, counted over a real step"
