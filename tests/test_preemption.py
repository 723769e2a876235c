"""The preemption recipe of docs/reliability.md, in real processes: SIGTERM -> checkpoint -> exit 143 -> resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent / "scripts" / "preempt_plain.py"
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_in_a_plain_trainer_leaves_a_checkpoint_exits_143_and_resumes(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(tmp_path), "--pause-at", "7"], env=ENV,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 240
    while not (tmp_path / "paused").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-4000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-4000:]
    ckpt = tmp_path / "checkpoints" / "on_exception.ckpt"
    assert ckpt.exists() and not (tmp_path / "end_step").exists()
    # micro-batch 7 of 2 per step: saved mid-accumulation after step 3; ExactResume rolls back to it
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert saved["global_step"] == 3

    resumed = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], env=ENV, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert (tmp_path / "start_step").read_text() == "3"  # ckpt_path="last" found on_exception.ckpt
    assert (tmp_path / "end_step").read_text() == "8"
    assert not ckpt.exists()  # a fit that finishes removes the on-exception checkpoint
