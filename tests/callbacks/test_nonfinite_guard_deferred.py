"""NonFiniteGuard(mode="deferred"): bad steps skipped on the device, read at logging steps and saves."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gpuopt.callbacks import NonFiniteError, NonFiniteGuard
from tests.callbacks.test_nonfinite_guard import PoisonedGPT, Snapshots, _equal, _loader, _trainer
from tests.test_no_host_sync import fused_optimizers


class FusedPoisonedGPT(PoisonedGPT):
    """The poisoned tiny GPT with a fused AdamW (what GPTModule builds on CUDA) on the CPU."""

    def configure_optimizers(self):
        return fused_optimizers(self)


def _model(**kw):
    return FusedPoisonedGPT(preset="tiny", vocab_size=256, block_size=32, learning_rate=1e-2, warmup_steps=0, **kw)


@pytest.mark.parametrize("poison", ["nan", "grad"])
def test_bad_step_is_skipped_on_the_device_and_reported_at_the_logging_step(poison):
    guard, snap = NonFiniteGuard(mode="auto"), Snapshots()
    trainer = _trainer(callbacks=[guard, snap], max_steps=8, log_every_n_steps=4)
    with pytest.warns(UserWarning, match=r"1 optimizer step\(s\) .* skipped .* first at global step 2; 0 in a row now "
                                         r"\(read at logging step 4\)"):
        trainer.fit(_model(bad_steps={2}, mode=poison), _loader())
    assert guard.active_mode == "deferred" and guard.skipped_steps == 1 and trainer.global_step == 8
    # The bad step changed nothing: weights and AdamW moments as before it (the fused kernel read found_inf).
    assert _equal(snap.before[2], snap.before[3])
    assert not _equal(snap.before[3], snap.before[4])  # and training went on
    assert not hasattr(trainer.optimizers[0], "found_inf")  # removed at teardown


def test_stop_raises_before_the_next_checkpoint_is_written(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last=True)
    guard = NonFiniteGuard(policy="stop", mode="deferred")
    trainer = _trainer(tmp_path, callbacks=[guard, ckpt], enable_checkpointing=True, max_steps=8, log_every_n_steps=50)
    with pytest.raises(NonFiniteError, match=r"first at global step 3; 1 in a row now \(read before a checkpoint save\)"):
        trainer.fit(_model(bad_steps={3}), _loader())
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 2  # the save at 4 was refused


def test_consecutive_bad_steps_stop_at_the_read():
    guard = NonFiniteGuard(max_consecutive_skips=2, mode="deferred")
    trainer = _trainer(callbacks=[guard], max_steps=8, log_every_n_steps=4)
    with pytest.raises(NonFiniteError, match=r"3 in a row >= max_consecutive_skips=2"):
        trainer.fit(_model(bad_steps={1, 2, 3}), _loader())
    assert trainer.global_step == 4  # read at the logging step after the run of bad steps


def test_deferred_needs_a_fused_optimizer():
    from tests.callbacks.test_nonfinite_guard import _model as plain_model

    trainer = _trainer(callbacks=[NonFiniteGuard(mode="deferred")], max_steps=2)
    with pytest.raises(ValueError, match=r"mode='deferred'.*fused torch.optim optimizer.*got AdamW.*Use mode='step'"):
        trainer.fit(plain_model(), _loader())


def test_auto_checks_every_step_with_a_plain_optimizer():
    from tests.callbacks.test_nonfinite_guard import _model as plain_model

    guard = NonFiniteGuard()
    trainer = _trainer(callbacks=[guard], max_steps=4)
    with pytest.warns(UserWarning, match="skipped non-finite loss at global step 2"):
        trainer.fit(plain_model(bad_steps={2}), _loader())
    assert guard.active_mode == "step" and guard.skipped_steps == 1
