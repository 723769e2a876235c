"""SigtermCheckpoint: a real SIGTERM saves last.ckpt where ckpt_path="last" finds it; other exceptions save nothing."""

import os
import signal

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_gpuopt import GPTModule, TextDataModule
from lightning_gpuopt.callbacks import ExactResume, SigtermCheckpoint


class _At(Callback):
    def __init__(self, step, action):
        self.step, self.action = step, action

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.action()


def _fit(tmp_path, text_dir, action, ckpt_path=None, max_steps=20, checkpoint=True):
    data = TextDataModule(source=str(text_dir), block_size=16, batch_size=2, vocab_size=300, num_workers=0)
    model = GPTModule(n_layer=1, n_embd=32, n_head=2, vocab_size=300, block_size=16, warmup_steps=1)
    callbacks = [ExactResume(), SigtermCheckpoint(), _At(5, action)]
    if checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=100))
    trainer = pl.Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, limit_val_batches=0,
                         enable_checkpointing=checkpoint, callbacks=callbacks)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def test_sigterm_saves_last_and_resume_finds_it(tmp_path, text_dir, cache_dir):
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SIGTERMException):
            _fit(tmp_path, text_dir, lambda: os.kill(os.getpid(), signal.SIGTERM))
    finally:
        signal.signal(signal.SIGTERM, previous)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 5
    trainer = _fit(tmp_path, text_dir, lambda: None, ckpt_path="last")
    assert trainer.ckpt_path == str(last) and trainer.global_step == 20


def test_ctrl_c_saves_like_sigterm_and_puts_the_handler_back(tmp_path, text_dir, cache_dir, caplog):
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SIGTERMException), caplog.at_level("INFO"):
            _fit(tmp_path, text_dir, lambda: os.kill(os.getpid(), signal.SIGINT))
    finally:
        signal.signal(signal.SIGTERM, previous)
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 5 and saved["optimizer_states"]  # the full training state
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # a later Ctrl-C stops at once again
    assert "received Ctrl-C; saved" in caplog.text
    assert "`weights_only` was not set" not in caplog.text  # the save says what it keeps
    # One account of the Ctrl-C: ours, not also Lightning's "Received SIGTERM: 15" for the signal it was turned into.
    assert caplog.text.count("Ctrl-C; saving last.ckpt after this batch") == 1 and "Received SIGTERM" not in caplog.text


def test_other_exceptions_save_nothing(tmp_path, text_dir, cache_dir):
    def fail():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _fit(tmp_path, text_dir, fail)
    assert not (tmp_path / "ckpt" / "last.ckpt").exists()


def test_warns_without_a_model_checkpoint(tmp_path, text_dir, cache_dir):
    with pytest.warns(UserWarning, match="SigtermCheckpoint: the Trainer has no ModelCheckpoint"):
        _fit(tmp_path, text_dir, lambda: None, max_steps=6, checkpoint=False)
    with pytest.raises(ValueError, match="plain file name"):
        SigtermCheckpoint(filename="a/b")


class _Rows(Logger):
    """Keeps every logged dict, across fits (a resumed fit logs into the same list)."""

    def __init__(self, rows):
        super().__init__()
        self.rows = rows

    name, version = "rows", 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


class _TermInValidation(GPTModule):
    """Sends itself SIGTERM from the second validation batch of the validation at ``term_at`` (a global step)."""

    term_at = None

    def validation_step(self, batch, batch_idx):
        if not self.trainer.sanity_checking and self.trainer.global_step == self.term_at and batch_idx == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().validation_step(batch, batch_idx)


def _fit_validating(tmp_path, text_dir, rows, term_at=None, ckpt_path=None):
    data = TextDataModule(source=str(text_dir), block_size=16, batch_size=2, vocab_size=300, num_workers=0)
    model = _TermInValidation(n_layer=1, n_embd=32, n_head=2, vocab_size=300, block_size=16, warmup_steps=1)
    model.term_at = term_at
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=100)
    trainer = pl.Trainer(max_steps=6, val_check_interval=2, limit_val_batches=3, num_sanity_val_steps=0,
                         logger=_Rows(rows), enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[ExactResume(), SigtermCheckpoint(), checkpoint])
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def test_validation_interrupted_by_sigterm_runs_again_on_resume(tmp_path, text_dir, cache_dir):
    rows = []
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SIGTERMException):
            _fit_validating(tmp_path, text_dir, rows, term_at=4)
    finally:
        signal.signal(signal.SIGTERM, previous)
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 4
    trainer = _fit_validating(tmp_path, text_dir, rows, ckpt_path="last")
    assert trainer.global_step == 6
    validated = [step for step, metrics in rows if "val/loss" in metrics]
    # Logged at the batches trained before each validation (after steps 2, 4 and 6), each exactly once.
    assert validated == [1, 3, 5]
    assert saved["callbacks"].get("SigtermCheckpoint") == {"validation_step": 4}  # what the resume read
    # Three whole validations of 3 batches this epoch, none left looking unfinished for a later checkpoint.
    total = trainer.fit_loop.epoch_loop.val_loop.batch_progress.total
    assert (total.ready, total.started, total.processed, total.completed) == (9, 9, 9, 9)


class _SigtermAtValidationBatch(Callback):
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_during_validate_leaves_the_checkpoint_it_reads_alone(tmp_path, text_dir, cache_dir):
    """Outside fit there is no training progress to keep: a save would replace last.ckpt with step 0."""
    _fit(tmp_path, text_dir, lambda: None, max_steps=2)
    last = tmp_path / "ckpt" / "last.ckpt"
    before = last.read_bytes()
    data = TextDataModule(source=str(text_dir), block_size=16, batch_size=2, vocab_size=300, num_workers=0)
    model = GPTModule(n_layer=1, n_embd=32, n_head=2, vocab_size=300, block_size=16, warmup_steps=1)
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, limit_val_batches=2, callbacks=[
        SigtermCheckpoint(), ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True), _SigtermAtValidationBatch()])
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SIGTERMException):
            trainer.validate(model, datamodule=data, ckpt_path=str(last))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert last.read_bytes() == before
