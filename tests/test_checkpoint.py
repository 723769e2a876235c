"""Safe checkpoints: atomic writes (also under SIGKILL), weights_only loading, load_gpt, and clear errors."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gpuopt import GPT, GPTConfig, GPTModule, TextDataModule
from lightning_gpuopt.callbacks import MFUMonitor, NonFiniteGuard
from lightning_gpuopt.cli import GPTCLI
from lightning_gpuopt.model.checkpoint import CheckpointError, gpt_state_dict, load_gpt, read_checkpoint
from lightning_gpuopt.plugins import AtomicCheckpointIO, NonFiniteCheckpointError

ROOT = Path(__file__).resolve().parents[1]


def _fit(tmp_path, cache_dir, text_dir, max_steps=4, ckpt_path=None, **fit_kw):
    data = TextDataModule(source=str(text_dir), block_size=32, batch_size=4, vocab_size=300, num_workers=0, cache_dir=str(cache_dir))
    model = GPTModule(preset="tiny", vocab_size=300, block_size=32, warmup_steps=0)
    trainer = pl.Trainer(
        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=tmp_path, plugins=[AtomicCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True), NonFiniteGuard(), MFUMonitor(log_every_n_steps=2)],
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path, **fit_kw)
    return trainer, model


@pytest.fixture
def package_ckpt(tmp_path, cache_dir, text_dir):
    trainer, model = _fit(tmp_path, cache_dir, text_dir)
    return tmp_path / "ckpt" / "last.ckpt", model


def test_package_checkpoint_loads_weights_only_and_into_a_plain_gpt(package_ckpt, tmp_path, cache_dir, text_dir):
    path, module = package_ckpt
    raw = torch.load(path, weights_only=True)  # everything the package writes is weights_only-safe
    assert raw["global_step"] == 4 and raw["hyper_parameters"]["preset"] == "tiny"
    assert any("NonFiniteGuard" in k for k in raw["callbacks"])
    gpt = load_gpt(path)
    assert type(gpt) is GPT and not gpt.training and gpt.config.vocab_size == 300 and gpt.config.block_size == 32
    assert gpt.lm_head.weight is gpt.transformer.wte.weight  # still tied
    idx = torch.randint(0, 300, (2, 16))
    module.model.eval()
    with torch.no_grad():
        assert torch.equal(gpt(idx), module.model(idx))
    # Resuming through the Trainer with weights_only=True works as well.
    trainer, _ = _fit(tmp_path, cache_dir, text_dir, max_steps=6, ckpt_path=str(path), weights_only=True)
    assert trainer.global_step == 6


def test_compiled_keys_are_stripped():
    gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    compiled = torch.compile(gpt)  # an OptimizedModule wrapper: keys gain "_orig_mod."
    ckpt = {"state_dict": {f"model.{k}": v for k, v in compiled.state_dict().items()}}
    assert all("_orig_mod" in k for k in ckpt["state_dict"])
    assert gpt_state_dict(ckpt).keys() == gpt.state_dict().keys()


class _Boom:
    def __reduce__(self):
        raise RuntimeError("pickling failed half-way")


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "w": torch.ones(1000)}, path)
    before = path.read_bytes()
    with pytest.raises(RuntimeError, match="half-way"):
        io.save_checkpoint({"global_step": 2, "w": torch.zeros(1000), "x": _Boom()}, path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["last.ckpt"]
    assert io.load_checkpoint(path)["global_step"] == 1


def test_failed_flush_keeps_the_old_file(tmp_path, monkeypatch):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1}, path)

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"global_step": 2, "w": torch.zeros(10_000)}, path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["last.ckpt"] and read_checkpoint(path)["global_step"] == 1


@pytest.mark.slow
def test_sigkill_while_saving_never_leaves_a_broken_file(tmp_path):
    path = tmp_path / "last.ckpt"
    script = ROOT / "tests" / "scripts" / "atomic_writer.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE, text=True, env=env)
    seen = []
    try:
        for delay in (0.0, 0.013, 0.029, 0.047):  # read, then kill: mid-write or between writes
            seen.append(int(proc.stdout.readline()))
            time.sleep(delay)
            ckpt = read_checkpoint(path)  # a concurrent reader always sees a complete file, too
            assert bool((ckpt["state_dict"]["w"] == ckpt["global_step"]).all())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    ckpt = read_checkpoint(path)
    step, w = ckpt["global_step"], ckpt["state_dict"]["w"]
    assert step >= seen[-1] and w.numel() == 4_000_000 and bool((w == step).all())
    assert {p.name for p in tmp_path.iterdir()} - {"last.ckpt"} <= {p.name for p in tmp_path.glob(".last.ckpt.tmp-*")}


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p, good: p.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2]), "truncated or corrupt"),
        (lambda p, good: p.write_text("model:\n  preset: tiny\n"), "not a PyTorch checkpoint"),
        (lambda p, good: p.write_bytes(b""), "is empty"),
        (lambda p, good: torch.save({"weights": torch.ones(2)}, p), "not a GPTModule checkpoint"),
        (lambda p, good: torch.save({"x": GPTConfig()}, p), "weights_only=False"),
        (lambda p, good: None, "does not exist"),
        (lambda p, good: p.mkdir(), "is a directory"),
    ],
    ids=["truncated", "foreign-text", "empty", "foreign-torch", "unsafe-pickle", "missing", "directory"],
)
def test_broken_or_foreign_files_give_clear_errors(tmp_path, make, match):
    good = tmp_path / "good.ckpt"
    ckpt = {"hyper_parameters": {"preset": "tiny"}, "state_dict": {f"model.{k}": v for k, v in GPT(GPTConfig.from_name("tiny")).state_dict().items()}}
    torch.save(ckpt, good)
    bad = tmp_path / "bad.ckpt"
    make(bad, good)
    with pytest.raises(CheckpointError, match=match):
        load_gpt(bad)
    assert isinstance(CheckpointError("x"), ValueError)


def test_missing_weights_are_named(tmp_path):
    state = {f"model.{k}": v for k, v in GPT(GPTConfig.from_name("tiny")).state_dict().items()}
    del state["model.transformer.h.1.mlp.c_fc.weight"]
    torch.save({"hyper_parameters": {"preset": "tiny"}, "state_dict": state}, tmp_path / "m.ckpt")
    with pytest.raises(CheckpointError, match=r"missing \['transformer.h.1.mlp.c_fc.weight'\]"):
        load_gpt(tmp_path / "m.ckpt")


def test_gpuopt_cli_writes_checkpoints_atomically(text_dir, cache_dir):
    cli = GPTCLI(GPTModule, TextDataModule, run=False, args=["--data.source", str(text_dir), "--data.vocab_size", "300"])
    assert type(cli.trainer.strategy.checkpoint_io) is AtomicCheckpointIO


def test_a_diverged_run_never_replaces_the_good_checkpoints(tmp_path, cache_dir, text_dir):
    """No NonFiniteGuard, a learning rate of 1000: the writer refuses the NaN weights, the last good files stay."""
    data = TextDataModule(source=str(text_dir), block_size=32, batch_size=4, vocab_size=300, num_workers=0, cache_dir=str(cache_dir))
    model = GPTModule(preset="tiny", vocab_size=300, block_size=32, warmup_steps=0, learning_rate=1000.0)
    trainer = pl.Trainer(
        max_steps=20, logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        plugins=[AtomicCheckpointIO()], callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)],
    )
    with pytest.raises(NonFiniteCheckpointError, match=r"weight tensors hold NaN/Inf .*the run has diverged"):
        trainer.fit(model, datamodule=data)
    assert 1 <= trainer.global_step < 20
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "last.ckpt" in files and len(files) == 2  # last.ckpt and the top-1 file of the same (last good) step
    for name in files:
        ckpt = read_checkpoint(tmp_path / "ckpt" / name)
        assert ckpt["global_step"] == trainer.global_step - 1
        assert all(bool(torch.isfinite(t).all()) for t in ckpt["state_dict"].values() if t.is_floating_point())
    load_gpt(tmp_path / "ckpt" / "last.ckpt")  # loads: the good model


def test_nonfinite_weights_can_be_written_when_asked(tmp_path):
    nan = {"state_dict": {"w": torch.full((4,), float("nan"))}}
    with pytest.raises(NonFiniteCheckpointError, match="Not writing"):
        AtomicCheckpointIO().save_checkpoint(nan, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()
    AtomicCheckpointIO(allow_nonfinite=True).save_checkpoint(nan, tmp_path / "a.ckpt")
    assert torch.isnan(read_checkpoint(tmp_path / "a.ckpt")["state_dict"]["w"]).all()


def test_the_temp_file_of_a_killed_save_is_removed_by_the_next_save(tmp_path):
    path = tmp_path / "epoch=0-step=4.ckpt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "scripts" / "stalled_writer.py"), str(path)],
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
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(["unshare", "-rm", sys.executable, str(ROOT / "tests" / "scripts" / "disk_full_save.py"), str(mount)],
                         capture_output=True, text=True, env=env, timeout=120)
    if out.returncode != 0 and "mount" in out.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip().splitlines()[-1]}")
    assert out.returncode == 0, out.stderr
    assert f"ERROR OSError errno=28: [Errno 28] No space left on device at {mount} (needs ~0.00 GB for last.ckpt" in out.stdout
    assert "The previous last.ckpt is kept" in out.stdout
    assert "STEP 1" in out.stdout and "FILES ['last.ckpt']" in out.stdout  # the old one, and no temporary file
