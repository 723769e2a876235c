"""AutoBatchSize across a resume: the decision is reused without a search, checked when restored late, and the
run continues exactly."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_gpuopt.callbacks import AutoBatchSize
from tests.callbacks.auto_batch._helpers import OOMAbove, StepRecorder, TokenData, cpu_trainer


def test_resume_reuses_the_decision_without_searching(tmp_path):
    search, counter = AutoBatchSize(global_batch_size=16, max_micro_batch_size=16), _CountSteps()
    trainer = cpu_trainer([counter, search], max_steps=2, enable_checkpointing=True, default_root_dir=tmp_path)
    trainer.fit(OOMAbove(limit=5), datamodule=TokenData())
    assert search.micro_batch_size == 4
    # steps_per_trial=2 steps per size that fits; a size that runs out of memory stops at its first
    assert counter.count == sum(2 if t.fits else 1 for t in search.trials) == 7
    ckpt = next(tmp_path.rglob("*.ckpt"))
    resumed, counter = AutoBatchSize(global_batch_size=16, max_micro_batch_size=16), _CountSteps()
    data = TokenData(batch_size=1)
    trainer = cpu_trainer([counter, resumed], max_steps=3, default_root_dir=tmp_path)
    trainer.fit(OOMAbove(limit=5), datamodule=data, ckpt_path=ckpt)
    assert (resumed.micro_batch_size, resumed.accumulate_grad_batches, data.batch_size) == (4, 4, 4)
    assert counter.count == 0  # no trial steps: the checkpoint's decision was used
    assert trainer.global_step == 3


def _restores_after_setup():
    """A one-device strategy that restores checkpoints as FSDP/FSDP2/DeepSpeed do: after on_fit_start."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class RestoresAfterSetup(SingleDeviceStrategy):
        @property
        def restore_checkpoint_after_setup(self) -> bool:
            return True

    return RestoresAfterSetup(torch.device("cpu"))


def test_a_decision_restored_after_the_search_that_does_not_fit_is_not_used(tmp_path):
    """FSDP/FSDP2/DeepSpeed restore callbacks after on_fit_start (restore_checkpoint_after_setup):
    there the resumed run has searched already; a checkpoint micro-batch larger than what fits now is not used."""
    first = AutoBatchSize(global_batch_size=16, max_micro_batch_size=16)
    cpu_trainer([first], max_steps=2, enable_checkpointing=True, default_root_dir=tmp_path).fit(
        OOMAbove(limit=5), datamodule=TokenData()
    )
    assert first.micro_batch_size == 4
    resumed = AutoBatchSize(global_batch_size=16, max_micro_batch_size=16)
    trainer = cpu_trainer([resumed], max_steps=3, strategy=_restores_after_setup())
    expected = r"checkpoint's micro-batch \(4\).*keeping the search's micro-batch 2.*4 is larger than what fits here"
    with pytest.warns(UserWarning, match=expected):
        trainer.fit(OOMAbove(limit=3), datamodule=TokenData(), ckpt_path=next(tmp_path.rglob("*.ckpt")))
    assert trainer.global_step == 3 and resumed.micro_batch_size == 2
    assert [(t.micro_batch_size, t.fits) for t in resumed.trials] == [(1, True), (2, True), (4, False)]


def test_a_decision_restored_after_the_search_that_fits_is_used_and_resumes_exactly(text_dir, cache_dir, tmp_path):
    """Restored after the search (as under FSDP2), a checkpoint micro-batch no larger than what the search
    found to fit is adopted, so the resumed run continues exactly as the uninterrupted one."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_gpuopt.callbacks import ExactResume
    from lightning_gpuopt.data import TextDataModule

    def run(limit, ckpt_path=None, strategy="auto"):
        recorder = StepRecorder()
        torch.manual_seed(11)
        data = TextDataModule(source=str(text_dir), vocab_size=300, block_size=16, batch_size=1, num_workers=0)
        module = OOMAbove(limit=limit, dropout=0.1, vocab_size=320)
        search = AutoBatchSize(global_batch_size=8, max_micro_batch_size=8)
        checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
        trainer = cpu_trainer([search, ExactResume(), checkpoints, recorder], max_steps=4, enable_checkpointing=True,
                           default_root_dir=tmp_path, strategy=strategy)
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        return search, recorder, data

    _, full, _ = run(limit=5)  # micro-batch 4 x 2
    step2 = next((tmp_path / "ckpt").glob("*step=2.ckpt"))
    search, resumed, data = run(limit=9, ckpt_path=step2, strategy=_restores_after_setup())
    assert [(t.micro_batch_size, t.fits) for t in search.trials][-1] == (8, True)  # 8 fits on this "device"
    assert (search.micro_batch_size, search.accumulate_grad_batches, data.batch_size) == (4, 2, 4)
    assert resumed.micro_batches == [4] * 4
    assert resumed.samples == full.samples[2:]
    assert resumed.losses == full.losses[2:]  # bit for bit


class _CountSteps(pl.Callback):
    def __init__(self):
        self.count = None

    def on_fit_start(self, trainer, pl_module):
        self.module_step = pl_module.training_step
        self.calls = 0

        def counted(*args, **kwargs):
            self.calls += 1
            return self.module_step(*args, **kwargs)

        pl_module.training_step = counted

    def on_train_start(self, trainer, pl_module):
        self.count = self.calls


def test_resumed_run_with_auto_batch_size_continues_exactly(text_dir, cache_dir, tmp_path):
    """Stop after step 2, resume: the AutoBatchSize decision, data position and RNG come back, losses match."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_gpuopt.callbacks import ExactResume
    from lightning_gpuopt.data import TextDataModule

    def run(max_steps, ckpt_path=None):
        recorder = StepRecorder()
        torch.manual_seed(11)
        data = TextDataModule(source=str(text_dir), vocab_size=300, block_size=16, batch_size=1, num_workers=0)
        module = OOMAbove(limit=5, dropout=0.1, vocab_size=320)
        checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
        callbacks = [AutoBatchSize(global_batch_size=8, max_micro_batch_size=8), ExactResume(), checkpoints, recorder]
        trainer = cpu_trainer(callbacks, max_steps=max_steps, enable_checkpointing=True, default_root_dir=tmp_path)
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        return recorder, data

    full, _ = run(max_steps=4)
    step2 = next((tmp_path / "ckpt").glob("*step=2.ckpt"))
    resumed, data = run(max_steps=4, ckpt_path=step2)
    assert data.batch_size == 4  # the saved decision (4 x 2), not the configured 1
    assert resumed.samples == full.samples[2:]
    assert resumed.losses == full.losses[2:]
