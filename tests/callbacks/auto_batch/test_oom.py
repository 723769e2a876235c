"""AutoBatchSize when a step runs out of memory mid-training: redone smaller, data order kept, or stopped with a
checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_gpuopt.callbacks import AutoBatchSize
from tests.callbacks.auto_batch._helpers import OOMAbove, StepRecorder, TokenData, cpu_trainer


def test_oom_mid_training_redoes_the_step_with_a_smaller_micro_batch():
    def run(max_micro, later_limit):
        recorder = StepRecorder()
        torch.manual_seed(5)
        module = OOMAbove(limit=None, later_step=3, later_limit=later_limit)
        search = AutoBatchSize(global_batch_size=16, max_micro_batch_size=max_micro)
        with pytest.warns(UserWarning, match="out of memory at step 3") if later_limit else _nothing():
            cpu_trainer([search, recorder], max_steps=6).fit(module, datamodule=TokenData())
        return search, recorder, module.model.state_dict()

    recovered, rec_a, weights_a = run(max_micro=8, later_limit=5)  # 8 fits until step 3, then only <= 5
    reference, rec_b, weights_b = run(max_micro=4, later_limit=None)  # 4 x 4 from the start
    assert recovered.recoveries == [{"step": 3, "from": 8, "to": 4}]
    assert (recovered.micro_batch_size, recovered.accumulate_grad_batches) == (4, 4)
    assert rec_a.micro_batches[:6] == [8] * 6 and set(rec_a.micro_batches[6:]) == {4}
    assert rec_a.samples == rec_b.samples  # same samples in every optimizer step: data order kept
    assert len(rec_a.losses) == 6
    np.testing.assert_allclose(rec_a.losses, rec_b.losses, rtol=1e-5)
    for key in weights_b:
        torch.testing.assert_close(weights_a[key], weights_b[key], rtol=1e-4, atol=1e-5)


def test_oom_recovery_keeps_the_data_order_of_text_datamodule(text_dir, cache_dir):
    """TextDataModule positions its own loaders (resumable sampler): the redone step reads the same samples."""
    from lightning_gpuopt.data import TextDataModule

    def run(max_micro, later_limit):
        recorder = StepRecorder()
        torch.manual_seed(5)
        data = TextDataModule(source=str(text_dir), vocab_size=300, block_size=16, batch_size=2, num_workers=0)
        module = OOMAbove(limit=None, later_step=2, later_limit=later_limit, vocab_size=320)
        search = AutoBatchSize(global_batch_size=8, max_micro_batch_size=max_micro)
        with pytest.warns(UserWarning, match="out of memory at step 2") if later_limit else _nothing():
            cpu_trainer([search, recorder], max_steps=4).fit(module, datamodule=data)
        return search, recorder

    recovered, rec_a = run(max_micro=8, later_limit=3)
    _, rec_b = run(max_micro=2, later_limit=None)
    # 8 fails at step 2, then 4 (over the limit of 3) too: the same step is redone twice
    assert recovered.recoveries == [{"step": 2, "from": 8, "to": 4}, {"step": 2, "from": 4, "to": 2}]
    assert rec_a.samples == rec_b.samples
    np.testing.assert_allclose(rec_a.losses, rec_b.losses, rtol=1e-5)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_oom_at_micro_batch_one_stops_with_a_checkpoint_of_the_last_step(tmp_path):
    module = OOMAbove(limit=None, later_step=2, later_limit=0)
    search = AutoBatchSize(global_batch_size=2, max_micro_batch_size=1)
    trainer = cpu_trainer([search], max_steps=5, default_root_dir=tmp_path)
    with pytest.raises(RuntimeError, match=r"micro-batch 1.*Saved the last completed step \(global step 2\)") as err:
        trainer.fit(module, datamodule=TokenData())
    assert "activation_checkpointing=True" in str(err.value) and "ckpt_path=" in str(err.value)
    saved = list(tmp_path.glob("oom-step=2-rank=0.ckpt"))
    assert len(saved) == 1
    checkpoint = torch.load(saved[0], weights_only=True)
    assert checkpoint["global_step"] == 2
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    assert progress["current"]["completed"] == 4  # 2 steps x 2 micro-batches: the failed one is not counted
    assert checkpoint["callbacks"]["AutoBatchSize"]["micro_batch_size"] == 1


class _OOMInBatch(OOMAbove):
    """Runs out of memory in micro-batch ``batch`` of optimizer step ``step`` (never in a trial step)."""

    def __init__(self, step: int, batch: int, **kw):
        super().__init__(**kw)
        self.oom_step, self.oom_batch = step, batch

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.oom_step and batch_idx == self.oom_batch and not self.trainer.sanity_checking:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return super().training_step(batch, batch_idx)


def test_emergency_checkpoint_is_at_the_step_boundary_without_in_process_recovery(tmp_path):
    """recover_oom=False (as in every multi-process run): the OOM in the 2nd micro-batch of step 3 is
    not redone, and the checkpoint holds the loop position of the end of step 2, not of the half step."""
    search = AutoBatchSize(global_batch_size=4, max_micro_batch_size=2, recover_oom=False)
    trainer = cpu_trainer([search], max_steps=5, default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"Saved the last completed step \(global step 2\)"):
        with pytest.raises(torch.OutOfMemoryError):
            trainer.fit(_OOMInBatch(step=2, batch=5), datamodule=TokenData())
    assert (search.micro_batch_size, search.accumulate_grad_batches) == (2, 2)
    checkpoint = torch.load(tmp_path / "oom-step=2-rank=0.ckpt", weights_only=True)
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
    assert checkpoint["global_step"] == 2
    assert progress == {"ready": 4, "started": 4, "processed": 4, "completed": 4}  # batch 4 is redone on resume


def test_oom_in_the_fp16_optimizer_step_is_a_failed_trial_not_a_crash():
    """Under fp16 Lightning unscales the gradients before the optimizer step; an OOM in the step
    (Adam allocating its state) must not leave the scaler unusable for the next trial."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    class OOMInOptimizerStep(OOMAbove):
        def training_step(self, batch, batch_idx):
            self.micro_batch = batch[0].size(0)
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            config = super().configure_optimizers()

            def step_pre_hook(optimizer, args, kwargs):
                if self.micro_batch > 4:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

            config["optimizer"].register_step_pre_hook(step_pre_hook)
            return config

    search = AutoBatchSize(global_batch_size=16, max_micro_batch_size=16)
    fp16 = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = cpu_trainer([search], max_steps=2, plugins=[fp16])
    trainer.fit(OOMInOptimizerStep(), datamodule=TokenData())
    assert [(t.micro_batch_size, t.fits) for t in search.trials] == [(1, True), (2, True), (4, True), (8, False)]
    assert search.micro_batch_size == 4 and trainer.global_step == 2
