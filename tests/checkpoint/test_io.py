"""AtomicCheckpointIO: a failed or killed write keeps the old file whole; the gpuopt CLI writes through it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from lightning_gpuopt import GPTModule, TextDataModule
from lightning_gpuopt.cli.main import GPTCLI
from lightning_gpuopt.model.checkpoint import read_checkpoint
from lightning_gpuopt.checkpoint import AtomicCheckpointIO
from tests._paths import REPO, SCRIPTS


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
    script = SCRIPTS / "atomic_writer.py"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
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


def test_gpuopt_cli_writes_checkpoints_atomically(text_dir, cache_dir):
    cli = GPTCLI(GPTModule, TextDataModule, run=False, args=["--data.source", str(text_dir), "--data.vocab_size", "300"])
    assert type(cli.trainer.strategy.checkpoint_io) is AtomicCheckpointIO
