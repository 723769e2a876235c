"""Checkpoint safety: NaN/Inf weights are never written, temporary files of killed saves are removed, a full disk
is reported."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gpuopt import GPTModule, TextDataModule
from lightning_gpuopt.callbacks.resumed_optimizer import ResumedOptimizerSettings
from lightning_gpuopt.model.checkpoint import CheckpointError, load_gpt, read_checkpoint
from lightning_gpuopt.checkpoint import AtomicCheckpointIO, NonFiniteCheckpointError
from tests._paths import REPO, SCRIPTS


def test_a_diverged_run_never_replaces_the_good_checkpoints(tmp_path, cache_dir, text_dir):
    """No NonFiniteGuard, a learning rate of 1000: the writer refuses the NaN weights, the last good files stay."""
    data = TextDataModule(source=str(text_dir), block_size=32, batch_size=4, vocab_size=300, num_workers=0, cache_dir=str(cache_dir))
    model = GPTModule(preset="tiny", vocab_size=300, block_size=32, warmup_steps=0, learning_rate=1000.0)
    trainer = pl.Trainer(
        max_steps=20, logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        plugins=[AtomicCheckpointIO()], callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)],
    )
    # AdamW's exp_avg_sq overflows before the weights do: the optimizer state is checked too.
    with pytest.raises(NonFiniteCheckpointError, match=r"tensors hold NaN/Inf .*the run has diverged") as refused:
        trainer.fit(model, datamodule=data)
    # The file kept is finite, which does not make it good: the message does not say it is, and names the guard.
    assert "finite, but not necessarily good" in str(refused.value) and "last good" not in str(refused.value)
    assert "Add lightning_gpuopt.callbacks.NonFiniteGuard" in str(refused.value)
    assert 1 <= trainer.global_step < 20
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "last.ckpt" in files and len(files) == 2  # last.ckpt and the top-1 file of the same (last good) step
    for name in files:
        ckpt = read_checkpoint(tmp_path / "ckpt" / name)
        assert ckpt["global_step"] == trainer.global_step - 1
        assert all(bool(torch.isfinite(t).all()) for t in ckpt["state_dict"].values() if t.is_floating_point())
        moments = [t for s in ckpt["optimizer_states"][0]["state"].values() for t in s.values()]
        assert moments and all(bool(torch.isfinite(t).all()) for t in moments)
    load_gpt(tmp_path / "ckpt" / "last.ckpt")  # loads
    # Why it is not called good: resumed at a 10^6 times lower learning rate, its next save is refused again.
    stopped_at = trainer.global_step - 1

    def resume(learning_rate, ckpt_path):
        model = GPTModule(preset="tiny", vocab_size=300, block_size=32, warmup_steps=0, learning_rate=learning_rate)
        trainer = pl.Trainer(
            max_steps=stopped_at + 2, logger=False, enable_progress_bar=False, enable_model_summary=False,
            limit_val_batches=0, plugins=[AtomicCheckpointIO()], default_root_dir=tmp_path / str(learning_rate),
            callbacks=[ResumedOptimizerSettings(),  # applies the new learning rate, as `gpuopt fit --ckpt_path` does
                       ModelCheckpoint(dirpath=tmp_path / str(learning_rate), save_last=True, every_n_train_steps=1)],
        )
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
        return trainer, model

    with pytest.raises(NonFiniteCheckpointError):
        resume(1e-3, tmp_path / "ckpt" / "last.ckpt")
    # The other way out it names, followed: a new run with a lower learning rate saves finite checkpoints.
    trainer, model = resume(1e-3, None)
    assert trainer.global_step == stopped_at + 2
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert read_checkpoint(tmp_path / "0.001" / "last.ckpt")["global_step"] == stopped_at + 2


def test_nonfinite_weights_can_be_written_when_asked(tmp_path):
    nan = {"state_dict": {"w": torch.full((4,), float("nan"))}}
    with pytest.raises(NonFiniteCheckpointError, match="Not writing"):
        AtomicCheckpointIO().save_checkpoint(nan, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()
    AtomicCheckpointIO(allow_nonfinite=True).save_checkpoint(nan, tmp_path / "a.ckpt")
    assert torch.isnan(read_checkpoint(tmp_path / "a.ckpt")["state_dict"]["w"]).all()


def test_nonfinite_optimizer_state_is_neither_written_nor_read(tmp_path):
    """Finite weights with an Inf in AdamW's exp_avg_sq (a learning rate of 1000): a resume would be NaN at once."""
    good = {"state_dict": {"w": torch.ones(4)},
            "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4),
                                                "exp_avg_sq": torch.ones(4)}}, "param_groups": [{"lr": 0.1}]}]}
    AtomicCheckpointIO().save_checkpoint(good, tmp_path / "last.ckpt")
    bad = {**good, "optimizer_states": [{"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.zeros(4),
                                                       "exp_avg_sq": torch.tensor([1.0, float("inf"), 1.0, 1.0])}}}]}
    with pytest.raises(NonFiniteCheckpointError, match=r"1 of 3 optimizer-state tensors hold NaN/Inf .*exp_avg_sq"):
        AtomicCheckpointIO().save_checkpoint(bad, tmp_path / "last.ckpt")
    assert AtomicCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")["optimizer_states"][0]["state"][0]["step"] == 3
    AtomicCheckpointIO(allow_nonfinite=True).save_checkpoint(bad, tmp_path / "bad.ckpt")
    with pytest.raises(CheckpointError, match=r"refused: 'optimizer_states.0.state.0.exp_avg_sq' holds NaN/Inf \(1 of 3 optimizer-state tensors do\)"):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "bad.ckpt")
    nan = {"state_dict": {"w": torch.tensor([float("nan"), 1.0])}}
    AtomicCheckpointIO(allow_nonfinite=True).save_checkpoint(nan, tmp_path / "nan.ckpt")
    with pytest.raises(CheckpointError, match="Use an earlier checkpoint of that run"):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "nan.ckpt")
    assert torch.isnan(AtomicCheckpointIO(allow_nonfinite=True).load_checkpoint(tmp_path / "nan.ckpt")["state_dict"]["w"][0])


def test_the_temp_file_of_a_killed_save_is_removed_by_the_next_save(tmp_path):
    path = tmp_path / "epoch=0-step=4.ckpt"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "stalled_writer.py"), str(path)],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "stalled"  # half-way through writing its temporary file
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    orphans = list(tmp_path.glob(".epoch=0-step=4.ckpt.tmp-*"))
    assert len(orphans) == 1 and not path.exists()
    # Files that are not ours, and a save in progress in a live process, stay.
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ours_alive = orphans[0].name.replace(f"-{proc.pid}-", f"-{live.pid}-")
        keep = [".last.ckpt.tmp-123", "notes.tmp", ".x.ckpt.tmp-zz-1-abcdefgh", ours_alive]
        for name in keep:
            (tmp_path / name).write_text("not a leftover")
        AtomicCheckpointIO().save_checkpoint({"global_step": 8, "state_dict": {"w": torch.ones(3)}}, tmp_path / "last.ckpt")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep + ["last.ckpt"])
    finally:
        live.kill()
        live.wait(timeout=30)


def test_a_full_disk_is_reported_with_the_space_needed_and_the_old_checkpoint_kept(tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a small tmpfs in a private mount namespace")
    mount = tmp_path / "small"
    mount.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(["unshare", "-rm", sys.executable, str(SCRIPTS / "disk_full_save.py"), str(mount)],
                         capture_output=True, text=True, env=env, timeout=120)
    if out.returncode != 0 and "mount" in out.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip().splitlines()[-1]}")
    assert out.returncode == 0, out.stderr
    assert f"ERROR OSError errno=28: [Errno 28] No space left on device at {mount} (needs ~0.00 GB for last.ckpt" in out.stdout
    assert "The previous last.ckpt is kept" in out.stdout
    assert "STEP 1" in out.stdout and "FILES ['last.ckpt']" in out.stdout  # the old one, and no temporary file
