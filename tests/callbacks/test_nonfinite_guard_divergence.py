"""NonFiniteGuard on a run that really diverges: it stops before AdamW's state overflows, and its advice works."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gpuopt import GPTModule
from lightning_gpuopt.callbacks import NonFiniteError, NonFiniteGuard
from lightning_gpuopt.checkpoint import AtomicCheckpointIO
from lightning_gpuopt.model.checkpoint import read_checkpoint
from torch.utils.data import DataLoader

from tests.callbacks.test_nonfinite_guard import _loader, _model


def _learnable_loader():
    """Sequences counting up from random starts: a loss a few steps can lower below the untrained model's."""
    starts = torch.randint(0, 256, (64, 1), generator=torch.Generator().manual_seed(0))
    data = (starts + torch.arange(33)) % 256
    return DataLoader(list(zip(data[:, :-1], data[:, 1:])), batch_size=4)


def _fit(tmp_path, model, max_steps, ckpt_path=None, policy="skip", loader=None):
    guard = NonFiniteGuard(policy=policy, max_consecutive_skips=2)
    trainer = pl.Trainer(
        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=tmp_path, plugins=[AtomicCheckpointIO()],
        callbacks=[guard, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=1)],
    )
    trainer.fit(model, loader or _loader(n=256), ckpt_path=ckpt_path)
    return trainer, guard


def _finite(checkpoint) -> bool:
    tensors = [t for t in checkpoint["state_dict"].values() if t.is_floating_point()]
    tensors += [t for s in checkpoint["optimizer_states"][0]["state"].values() for t in s.values() if t.is_floating_point()]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _gpt(learning_rate):
    return GPTModule(preset="tiny", vocab_size=256, block_size=32, learning_rate=learning_rate, warmup_steps=0)


def test_learning_rate_1000_is_stopped_before_adamw_overflows_and_the_advice_works(tmp_path):
    with pytest.warns(UserWarning, match="gradients too large to square"), pytest.raises(NonFiniteError) as stopped:
        _fit(tmp_path / "run", _gpt(1000.0), max_steps=8)
    message = str(stopped.value)
    # The guard saw what AdamW would have turned into an Inf exp_avg_sq, and says the checkpoint is no start.
    assert "their squares overflow, so AdamW's exp_avg_sq would turn Inf" in message
    assert "above the" in message and "Start a new run with a lower GPTModule(learning_rate=...)" in message
    last = read_checkpoint(tmp_path / "run" / "ckpt" / "last.ckpt")
    assert _finite(last)  # every save was finite: the writer never had to refuse one

    # What the message says of the checkpoint is true: its weights fail again at a 10^6 times lower rate.
    resumed = _gpt(1e-3)
    resumed.configure_model()
    resumed.load_state_dict(last["state_dict"])
    with pytest.raises(NonFiniteError, match="gradients too large to square"):
        _fit(tmp_path / "resumed", resumed, max_steps=2, policy="stop")

    # The advice, followed: a new run with a lower learning rate (1e-2, 10^5 times lower) trains to the end, with
    # every checkpoint finite and its loss below where it started.
    trainer, guard = _fit(tmp_path / "new", _gpt(1e-2), max_steps=6, loader=_learnable_loader())
    assert trainer.global_step == 6 and guard.skipped_steps == 0
    assert _finite(read_checkpoint(tmp_path / "new" / "ckpt" / "last.ckpt"))
    assert guard.saved_at[0] == 6 and guard.saved_at[1] < guard.initial_loss


def test_a_checkpoint_written_while_the_loss_fell_is_named_for_resuming(tmp_path):
    with pytest.raises(NonFiniteError) as stopped:
        _fit(tmp_path, _model(bad_steps={6}), max_steps=10, policy="stop")
    assert "Resume from the last checkpoint (step 6, written at train loss" in str(stopped.value)
    assert "below the" in str(stopped.value)
    # Followed: the run resumes from it and trains on (the poison was at step 6 only in that run).
    trainer, guard = _fit(tmp_path, _model(), max_steps=10, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert trainer.global_step == 10 and guard.skipped_steps == 0 and guard.initial_loss is not None
