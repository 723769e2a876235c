"""Gradient clipping with the fused AdamW GPTModule builds on CUDA (Lightning's MixedPrecision refuses it).

A fused AdamW on the CPU carries the same ``_step_supports_amp_scaling`` flag as on CUDA, so the
refusal, and the fix, show here.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_gpuopt.model import GPTModule
from lightning_gpuopt.perf.device import REFERENCE_DEVICES
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


class _ClipRecorder(FusedGPT):
    """GPTModule with the fused AdamW, recording the gradient norm right after GPTModule's own clipping."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.clipped_norms, self.losses = [], []

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.clipped_norms.append(float(torch.nn.utils.get_total_norm(grads)))

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss))
        return loss


def _fp16_fit(module, plugin, tmp_path, steps=6, clip=0.05):
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, gradient_clip_val=clip, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
        plugins=[plugin],
    )
    trainer.fit(module, _loader())
    return trainer


def _v100_plugin():
    plugin = BF16Precision()
    with pytest.warns(UserWarning, match="float16 autocast with a GradScaler"):
        plugin.bind(torch.device("cpu"), REFERENCE_DEVICES["V100"])
    return plugin


@pytest.mark.parametrize("plugin", ["fallback", "16-mixed"])
def test_clipping_a_fused_optimizer_under_a_grad_scaler_unscales_first(plugin, tmp_path):
    # BF16Precision's fp16 fallback (a V100's facts, on the CPU) or Lightning's own fp16 MixedPrecision, with
    # GPTModule's fused AdamW and gradient clipping, as every recipe clips: Lightning refused to clip at step 1.
    make = _v100_plugin if plugin == "fallback" else lambda: MixedPrecision("16-mixed", "cpu")
    kw = dict(preset="tiny", vocab_size=256, block_size=32, warmup_steps=0, learning_rate=1e-3)
    torch.manual_seed(0)
    fused = _ClipRecorder(**kw)
    trainer = _fp16_fit(fused, make(), tmp_path)
    scaler = trainer.precision_plugin.scaler
    assert isinstance(scaler, torch.amp.GradScaler) and trainer.optimizers[0].defaults["fused"] is True
    assert trainer.global_step == 6 and all(math.isfinite(x) for x in fused.losses)
    # Clipped on unscaled gradients: the norm is the clip value (unclipped ~1; still scaled, it would be ~65536x).
    finite = [n for n in fused.clipped_norms if math.isfinite(n)]  # a step with inf gradients is skipped by the scaler
    assert len(finite) >= 4 and all(n == pytest.approx(0.05, rel=1e-3) for n in finite), fused.clipped_norms

    # Exact: the same steps as the non-fused AdamW, which Lightning unscales before clipping. AdamW's moments
    # are sums of the gradients the steps saw (scaled twice, or clipped while scaled, they would be orders of
    # magnitude off). The weights are not compared: Adam's m/sqrt(v) turns rounding in near-zero gradients
    # into a full step either way.
    torch.manual_seed(0)
    reference = GPTModule(**kw)
    reference_trainer = _fp16_fit(reference, make(), tmp_path)
    assert reference_trainer.optimizers[0].defaults["fused"] is not True
    assert reference_trainer.precision_plugin.scaler.get_scale() == scaler.get_scale()  # the same steps skipped
    states = trainer.optimizers[0].state, reference_trainer.optimizers[0].state
    for got, want in zip(fused.parameters(), reference.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            expected = states[1][want][key]
            tolerance = 1e-2 * float(expected.abs().max())  # 1%: the weights drift apart by rounding over the steps
            torch.testing.assert_close(states[0][got][key], expected, rtol=1e-2, atol=tolerance)
