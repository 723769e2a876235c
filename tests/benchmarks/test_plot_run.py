"""benchmarks.plot_run reads a real run's metrics.csv and draws loss and tokens/s."""

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger

from benchmarks.plot_run import find_metrics, main, read_metrics
from lightning_gpuopt import GPTModule, TextDataModule
from lightning_gpuopt.callbacks import MFUMonitor

pytest.importorskip("matplotlib")


def test_plot_of_a_real_run(tmp_path, text_dir, cache_dir):
    data = TextDataModule(source=str(text_dir), block_size=16, batch_size=4, vocab_size=300, num_workers=0)
    model = GPTModule(n_layer=1, n_embd=32, n_head=2, vocab_size=300, block_size=16, warmup_steps=1)
    trainer = pl.Trainer(max_steps=8, logger=CSVLogger(tmp_path / "run"), log_every_n_steps=1, limit_val_batches=2,
                         val_check_interval=4, enable_checkpointing=False, enable_progress_bar=False,
                         callbacks=[MFUMonitor(log_every_n_steps=2, warmup_steps=1)])
    trainer.fit(model, datamodule=data)
    path = find_metrics(tmp_path / "run")
    metrics = read_metrics(path)
    assert [step for step, _ in metrics["train/loss"]] == list(range(8))
    assert len(metrics["val/loss"]) == 2 and len(metrics["perf/tokens_per_sec"]) >= 2
    assert all(v > 0 for _, v in metrics["perf/tokens_per_sec"])
    out = main([str(tmp_path / "run"), "--out", str(tmp_path / "plot.png")])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    with pytest.raises(FileNotFoundError, match="No metrics.csv"):
        find_metrics(tmp_path / "nothing")
