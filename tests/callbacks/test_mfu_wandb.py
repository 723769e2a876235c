"""MFUMonitor end to end with a real ``WandbLogger(offline=True)``: the perf/ and mem/ values reach the run file."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer

from lightning_gpuopt.callbacks import MFUMonitor
from lightning_gpuopt.perf import mfu as mfu_arithmetic
from tests.callbacks._mfu_helpers import ClockedGPTModule, FakeClock, TokenBatches, loader

wandb = pytest.importorskip("wandb")
from lightning.pytorch.loggers import WandbLogger  # noqa: E402

from tests.callbacks._wandb_reader import history_rows  # noqa: E402


def test_metrics_arrive_in_offline_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    # CPU has no CUDA memory stats: stand in known numbers to check the mem/ keys travel too.
    fake_mem = {"mem/allocated_gb": 1.5, "mem/reserved_gb": 2.0, "mem/peak_gb": 1.75, "mem/peak_pct": 2.1875}
    monkeypatch.setattr(mfu_arithmetic, "memory_stats", lambda facts: dict(fake_mem))

    clock = FakeClock()
    logger = WandbLogger(project="gpuopt-test", save_dir=str(tmp_path), offline=True)
    monitor = MFUMonitor(log_every_n_steps=2, warmup_steps=1, peak_flops=1e9, clock=clock)
    trainer = Trainer(
        default_root_dir=tmp_path, accelerator="cpu", max_steps=5, logger=logger, callbacks=[monitor],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        log_every_n_steps=1,
    )
    trainer.fit(ClockedGPTModule(clock, 0.05, preset="tiny"), loader(TokenBatches(8, 2, 32, clock=clock, fetch_s=0.01)))
    logger.experiment.finish()
    wandb.teardown()  # shut the wandb-core service down, so the run file is flushed and closed

    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    rows = [r for r in history_rows(run_file) if "perf/mfu" in r]
    assert len(rows) == 2 == len(monitor.history)
    assert [r["trainer/global_step"] for r in rows] == [3, 5]
    for row, expected in zip(rows, monitor.history):
        for key in ("perf/tokens_per_sec", "perf/tokens_per_sec_per_device", "perf/tflops_per_device", "perf/mfu",
                    "perf/step_time_ms", "perf/dataloader_wait_pct", *fake_mem):
            assert row[key] == pytest.approx(expected[key]), key
        assert row["perf/step_time_ms"] == pytest.approx(60.0)  # 50 ms step + 10 ms data, controlled clock
        assert row["mem/peak_pct"] == pytest.approx(2.1875)
    # the model's own loss arrived too: our logging does not disturb Lightning's
    assert any("train/loss" in r for r in history_rows(run_file))
