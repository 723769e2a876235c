"""callbacks/progress_bar.py: a fit resumed inside an epoch shows its bar's total and counts from the resumed batch."""

from __future__ import annotations

import pytest
from lightning.pytorch.callbacks import Callback

from lightning_gpuopt import GPTModule, TextDataModule
from lightning_gpuopt.callbacks import ResumedRichProgressBar, ResumedTQDMProgressBar
from lightning_gpuopt.cli.main import GPTCLI


class _StopAt(Callback):
    def __init__(self, step: int, path):
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


class _ReadBar(Callback):
    """The training bar's (count, total, first count of this fit) after each batch."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, *args):
        bar = trainer.progress_bar_callback
        if isinstance(bar, ResumedTQDMProgressBar):
            tq = bar.train_progress_bar
            self.seen.append((tq.n, tq.total, tq.initial))
        else:
            task = bar.progress.tasks[bar.train_progress_bar_id]
            self.seen.append((task.completed, task.total, None))


@pytest.mark.parametrize("bar", [None, "lightning_gpuopt.callbacks.ResumedTQDMProgressBar"])
def test_resumed_fit_bar_has_the_total_and_starts_at_the_resumed_batch(text_dir, cache_dir, tmp_path, bar):
    args = ["--data.source", str(text_dir), "--data.vocab_size", "300", "--data.num_workers", "0",
            "--data.block_size", "16", "--data.batch_size", "2", "--model.preset", "tiny", "--model.warmup_steps", "1",
            "--trainer.max_steps", "8", "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false"]
    if bar is not None:
        args += ["--trainer.callbacks+=" + bar]
    ckpt = tmp_path / "step3.ckpt"
    first = GPTCLI(GPTModule, TextDataModule, run=False, args=args, save_config_callback=None)
    first.trainer.callbacks.append(_StopAt(3, ckpt))
    first.trainer.fit(first.model, first.datamodule)
    resumed = GPTCLI(GPTModule, TextDataModule, run=False, args=args, save_config_callback=None)
    read = _ReadBar()
    resumed.trainer.callbacks.append(read)
    resumed.trainer.fit(resumed.model, resumed.datamodule, ckpt_path=str(ckpt))
    expected = ResumedTQDMProgressBar if bar else (ResumedRichProgressBar, ResumedTQDMProgressBar)
    assert isinstance(resumed.trainer.progress_bar_callback, expected)
    assert resumed.trainer.global_step == 8
    # the bar totals 8 batches, as a fresh fit's, and counts 4..8 from 3: its rate and ETA cover this fit's 5
    assert [n for n, _, _ in read.seen] == [4, 5, 6, 7, 8]
    assert {total for _, total, _ in read.seen} == {8}
    if bar:
        assert {initial for _, _, initial in read.seen} == {3}


def test_rich_bar_names_no_epoch_total_for_a_step_bounded_run_and_shows_the_version_as_is(text_dir, cache_dir, tmp_path):
    pytest.importorskip("rich")
    import lightning.pytorch as pl

    descriptions, versions = [], []

    class _Read(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            bar = trainer.progress_bar_callback
            descriptions.append(bar.progress.tasks[bar.train_progress_bar_id].description)
            versions.append(bar.get_metrics(trainer, pl_module).get("v_num"))

    data = TextDataModule(source=str(text_dir), cache_dir=str(cache_dir), vocab_size=300, block_size=16, batch_size=2, num_workers=0)
    module = GPTModule(n_layer=1, n_head=2, n_embd=32, vocab_size=300, block_size=16, warmup_steps=1)
    for max_steps, max_epochs, described in ((2, None, "Epoch 0"), (-1, 1, "Epoch 0/0")):
        descriptions.clear()
        trainer = pl.Trainer(max_steps=max_steps, max_epochs=max_epochs, limit_train_batches=2, limit_val_batches=0,
                             callbacks=[ResumedRichProgressBar(), _Read()], default_root_dir=tmp_path,
                             enable_checkpointing=False, enable_model_summary=False)
        trainer.fit(module, datamodule=data)
        assert {d.strip() for d in descriptions} == {described}  # Lightning's own: "Epoch 0/-2" for the first
    assert versions and all(v == "0" for v in versions[:2])  # the CSV log's version_0, not "0.000"


def test_a_line_logged_during_training_is_on_its_own_line_above_the_bar(monkeypatch, tmp_path):
    """NonFiniteGuard says at the first step which mode it checks in: the line used to follow the bar's text."""
    import io
    import logging
    import re
    import sys

    import lightning.pytorch as pl

    from lightning_gpuopt.callbacks import NonFiniteGuard
    from tests.callbacks.test_nonfinite_guard import _loader, _model

    screen = io.StringIO()  # the terminal: the bars (stdout) and the log lines (stderr) on one screen
    monkeypatch.setattr(sys, "stdout", screen)
    logger, console = logging.getLogger("lightning.pytorch"), logging.StreamHandler(screen)
    monkeypatch.setattr(logger, "handlers", [console])  # as Lightning sets it up outside pytest (which has its own)
    monkeypatch.setattr(logger, "propagate", False)
    bar = ResumedTQDMProgressBar()
    trainer = pl.Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_model_summary=False,
                         limit_val_batches=0, default_root_dir=tmp_path, callbacks=[bar, NonFiniteGuard(mode="step")])
    trainer.fit(_model(), _loader())
    pieces = re.split(r"[\r\n]", screen.getvalue())  # what a terminal shows at the start of a line
    said = [p for p in pieces if "NonFiniteGuard: checking" in p]
    assert said == ["NonFiniteGuard: checking every optimizer step (one host sync per step)."]
    assert any(p.startswith("Epoch 0: 100%") for p in pieces)  # the bar, drawn again after the line
    assert logger.handlers == [console]  # put back at the end
    # A fit that ends in an error (Lightning calls no teardown then): the handler is put back and the bar ends its
    # line, so what is written next (gpuopt's one-line error) starts a line of its own.
    failing = _model(bad_steps={2}, mode="nan")
    with pytest.raises(Exception, match="NonFiniteGuard stopped the run"):
        pl.Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
                   default_root_dir=tmp_path, callbacks=[ResumedTQDMProgressBar(), NonFiniteGuard(policy="stop")]).fit(
            failing, _loader())
    assert logger.handlers == [console] and screen.getvalue().endswith("\n")


def test_whole_numbers_show_as_whole_numbers():
    from lightning_gpuopt.callbacks.progress_bar import whole_numbers_as_text

    shown = whole_numbers_as_text({"v_num": 0, "tok/s": 643, "train/loss": 7.57, "flag": True})
    assert shown == {"v_num": "0", "tok/s": "643", "train/loss": 7.57, "flag": True}
    # Rich formats what is not text with `.3f`: this is why the bar read "tok/s: 643.000".
    assert [f"{v:.3f}" if not isinstance(v, str) else v for v in shown.values()][:2] == ["0", "643"]
