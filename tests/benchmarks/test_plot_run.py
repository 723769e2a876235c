"""benchmarks.plot_run reads a real run's metrics.csv and draws loss and tokens/s."""

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger

from benchmarks.plot_run import find_metrics, main, read_metrics, resumed_at
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
    paths = find_metrics(tmp_path / "run")
    metrics = read_metrics(paths)
    assert [step for step, _ in metrics["train/loss"]] == list(range(8))
    assert len(metrics["val/loss"]) == 2 and len(metrics["perf/tokens_per_sec"]) >= 2
    assert all(v > 0 for _, v in metrics["perf/tokens_per_sec"])
    out = main([str(tmp_path / "run"), "--out", str(tmp_path / "plot.png")])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    with pytest.raises(FileNotFoundError, match="No metrics.csv"):
        find_metrics(tmp_path / "nothing")


def test_a_resumed_run_is_plotted_whole_each_part_in_order(tmp_path, text_dir, cache_dir):
    """Stopped at step 6 with a checkpoint of step 4, continued to 8 in a new version_1: steps 0-7, once each."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(max_steps, ckpt_path=None):
        data = TextDataModule(source=str(text_dir), block_size=16, batch_size=4, vocab_size=300, num_workers=0)
        model = GPTModule(n_layer=1, n_embd=32, n_head=2, vocab_size=300, block_size=16, warmup_steps=1)
        trainer = pl.Trainer(max_steps=max_steps, logger=CSVLogger(tmp_path / "run"), log_every_n_steps=1,
                             limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)])
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)

    fit(6)
    fit(8, ckpt_path=tmp_path / "ckpt" / "epoch=0-step=4.ckpt")
    paths = find_metrics(tmp_path / "run")
    assert [p.parent.name for p in paths] == ["version_0", "version_1"]
    first, second = (read_metrics(p)["train/loss"] for p in paths)
    joined = read_metrics(paths)["train/loss"]
    assert [step for step, _ in joined] == list(range(8))  # the last version alone started at step 4
    assert joined == first[:4] + second  # steps 4 and 5 as trained again, not as first trained
    assert resumed_at(paths) == [4]
    out = main([str(tmp_path / "run"), "--out", str(tmp_path / "plot.png")])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
