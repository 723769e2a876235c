"""Soak: 2-process DDP on CPU for 3,000 tiny steps (30 epochs of the resumable sampler), a checkpoint
every 500 steps. Bound: each rank's resident memory grows by less than 50 MB between step 200 and the
end, and every checkpoint loads with ``weights_only=True`` and holds what a resume needs.

The default run makes the same checks over 600 steps (6 epochs, a checkpoint every 200); the 3,000-step
soak is an ``extended`` run (``-m extended``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_gpuopt.data import TextDataModule

SCRIPT = Path(__file__).parent / "scripts" / "soak_ddp.py"
RSS_GROWTH_BOUND = 50 * 2**20  # bytes; measured ~4 MB on a 2-core CPU machine


@pytest.mark.parametrize(("steps", "every"), [(600, 200), pytest.param(3000, 500, marks=pytest.mark.extended)],
                         ids=["600-steps", "3000-steps"])
def test_two_process_ddp_soak_memory_bound_and_loadable_checkpoints(tmp_path, text_dir, steps, every):
    data = tmp_path / "data"
    data.mkdir()
    (data / "texts").symlink_to(text_dir)
    TextDataModule(source=str(data / "texts"), cache_dir=str(data / "cache"), block_size=16, vocab_size=300).prepare_data()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), str(data), str(steps), str(every)],
        env=env, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        rss = json.loads((tmp_path / f"rss_rank{rank}.json").read_text())
        assert rss["steps"] == steps
        assert rss["end"] - rss["warm"] < RSS_GROWTH_BOUND, f"rank {rank} RSS grew {(rss['end'] - rss['warm']) / 2**20:.1f} MB"
    ckpts = sorted((tmp_path / "ckpt").glob("*.ckpt"), key=lambda p: int(p.stem.split("step=")[1]))
    assert [int(p.stem.split("step=")[1]) for p in ckpts] == list(range(every, steps + 1, every))
    for path in ckpts:
        ckpt = torch.load(path, weights_only=True, map_location="cpu")
        step = int(path.stem.split("step=")[1])
        assert ckpt["global_step"] == step
        assert all(torch.isfinite(t).all() for t in ckpt["state_dict"].values())
        assert ckpt["optimizer_states"][0]["state"]  # AdamW moments are there
        assert len(ckpt["callbacks"]["ExactResume"]["rng"]) == 2  # one RNG state per rank
        position = ckpt["TextDataModule"]
        # 200 samples per rank and epoch, 2 per step: both ranks consume 4 samples a step, 400 an epoch
        assert 400 * position["train_epoch"] + position["train_position"] == 4 * step
