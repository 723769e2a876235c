"""Gradient clipping with the fused AdamW GPTModule builds on CUDA (Lightning's MixedPrecision refuses it).

A fused AdamW on the CPU carries the same ``_step_supports_amp_scaling`` flag as on CUDA, so the
refusal, and the fix, show here.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_gpuopt.precision import BF16Precision
from tests.callbacks.test_nonfinite_guard import _loader
from tests.test_no_host_sync import FusedGPT


@pytest.mark.parametrize("precision", ["plugin", "bf16-mixed"])
def test_clipping_works_with_a_fused_optimizer_under_bf16(precision, tmp_path):
    norms = []

    class Norms(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            def after(optimizer, args, kwargs):  # after the step: the clipped gradients are still there
                grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
                norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

            trainer.optimizers[0].register_step_post_hook(after)

    kw = dict(plugins=[BF16Precision()]) if precision == "plugin" else dict(precision="bf16-mixed")
    trainer = pl.Trainer(
        max_steps=3, gradient_clip_val=0.05, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[Norms()], default_root_dir=tmp_path, **kw,
    )
    module = FusedGPT(preset="tiny", vocab_size=256, block_size=32, warmup_steps=0)
    trainer.fit(module, _loader())
    assert trainer.optimizers[0].defaults["fused"] is True and len(norms) == 3
    assert all(n <= 0.05 * 1.001 for n in norms), norms  # clipped (unclipped norms here are ~1)
