"""AutoBatchSize: the search functions, and the callback in real Trainer runs with GPU-like OOM errors on CPU."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from lightning_gpuopt.callbacks import AutoBatchSize
from tests._auto_batch_helpers import OOMAbove, StepRecorder, TokenData

SCRIPT = Path(__file__).parent / "scripts" / "ddp_auto_batch.py"


def _trainer(callbacks, max_steps=4, **kw) -> pl.Trainer:
    kw.setdefault("logger", False)
    kw.setdefault("enable_checkpointing", False)
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **kw,
    )


# --------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(global_batch_size=0), "global_batch_size must be >= 1"),
        (dict(max_micro_batch_size=-2), "max_micro_batch_size must be >= 1"),
        (dict(memory_margin=-0.1), r"memory_margin .* in \[0, 1\)"),
        (dict(memory_margin=1.0), r"memory_margin .* in \[0, 1\)"),
        (dict(mode="linear"), "mode must be 'binsearch' or 'power'"),
        (dict(steps_per_trial=0), "steps_per_trial must be >= 1"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutoBatchSize(**kwargs)


# --------------------------------------------------------------------------- in a real Trainer
def test_cpu_requires_max_micro_batch_size():
    trainer = _trainer([AutoBatchSize(global_batch_size=16)])
    with pytest.raises(ValueError, match=r"AutoBatchSize\(max_micro_batch_size=\.\.\.\)"):
        trainer.fit(OOMAbove(limit=4), datamodule=TokenData())


def test_missing_batch_size_attribute_is_named():
    class NoBatchSize(TokenData):
        def __init__(self):
            super().__init__()
            del self.batch_size

        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.dataset, batch_size=4)

    trainer = _trainer([AutoBatchSize(max_micro_batch_size=8)])
    with pytest.raises(ValueError, match="batch_size_attr"):
        trainer.fit(OOMAbove(), datamodule=NoBatchSize())


def test_chooses_largest_divisor_that_fits_and_keeps_global_batch():
    search = AutoBatchSize(global_batch_size=48, max_micro_batch_size=32)
    recorder = StepRecorder()
    data = TokenData(batch_size=4)
    trainer = _trainer([search, recorder], max_steps=2)
    trainer.fit(OOMAbove(limit=13), datamodule=data)
    # divisors of 48 up to 32: 1 2 3 4 6 8 12 16 24; 16 fails, 12 is the largest that fits
    assert search.micro_batch_size == 12 and search.accumulate_grad_batches == 4
    assert data.batch_size == 12 and trainer.accumulate_grad_batches == 4
    assert recorder.micro_batches == [12] * 8  # 2 optimizer steps x 4 micro-batches, all of 12
    assert [len(s) for s in recorder.samples] == [48, 48]
    assert [(t.micro_batch_size, t.fits) for t in search.trials] == [
        (1, True), (2, True), (4, True), (8, True), (16, False), (12, True)
    ]


def test_without_global_batch_keeps_the_configured_one():
    search = AutoBatchSize(max_micro_batch_size=16)
    data = TokenData(batch_size=8)
    trainer = _trainer([search], max_steps=1, accumulate_grad_batches=2)
    trainer.fit(OOMAbove(limit=5), datamodule=data)
    assert (search.micro_batch_size, search.accumulate_grad_batches) == (4, 4)  # 8 x 2 = 16 = 4 x 4


def test_integer_val_check_interval_keeps_the_samples_between_validations():
    search = AutoBatchSize(global_batch_size=32, max_micro_batch_size=32)
    trainer = _trainer([search], max_steps=1, val_check_interval=12)  # every 12 x 4 = 48 samples
    trainer.fit(OOMAbove(limit=10), datamodule=TokenData(batch_size=4))
    assert search.micro_batch_size == 8 and trainer.val_check_interval == 6  # 6 x 8 = 48 samples
    search = AutoBatchSize(global_batch_size=32, max_micro_batch_size=32)
    trainer = _trainer([search], max_steps=1, val_check_interval=3)  # 3 x 4 = 12 samples: no whole count of 8
    with pytest.warns(UserWarning, match="val_check_interval=3 .* multiple of 2"):
        trainer.fit(OOMAbove(limit=10), datamodule=TokenData(batch_size=4))
    assert trainer.val_check_interval == 3


def test_nothing_fits_names_the_fixes():
    trainer = _trainer([AutoBatchSize(global_batch_size=8, max_micro_batch_size=8)])
    with pytest.raises(RuntimeError, match="even a micro-batch of 1 runs out of memory.*activation_checkpointing"):
        trainer.fit(OOMAbove(limit=0), datamodule=TokenData())


class _Probe(pl.Callback):
    """Snapshots everything the search must leave alone, at on_fit_start."""

    def __init__(self):
        self.snapshot = None
        self.hooks = 0

    def on_fit_start(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        self.snapshot = dict(
            weights={k: v.clone() for k, v in pl_module.state_dict().items()},
            optimizer=repr(opt.state_dict()),
            scheduler=repr(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
            torch_rng=torch.get_rng_state().clone(),
            numpy_rng=np.random.get_state()[1].copy(),
            python_rng=random.getstate(),
            global_step=trainer.global_step,
            logged=dict(trainer.logged_metrics),
            callback_metrics=dict(trainer.callback_metrics),
            training=[m.training for m in pl_module.modules()],
        )

    def on_before_backward(self, trainer, pl_module, loss):
        self.hooks += 1


def test_search_leaves_no_trace():
    before, after = _Probe(), _Probe()
    search = AutoBatchSize(global_batch_size=32, max_micro_batch_size=32)
    trainer = _trainer([before, search, after], max_steps=1)
    torch.manual_seed(7)
    module = OOMAbove(limit=10, dropout=0.1)  # dropout: the trial steps draw random numbers
    trainer.fit(module, datamodule=TokenData())
    assert search.micro_batch_size == 8 and len(search.trials) >= 4
    a, b = before.snapshot, after.snapshot
    assert a["weights"].keys() == b["weights"].keys()
    for key in a["weights"]:
        assert torch.equal(a["weights"][key], b["weights"][key]), key
    for key in ("optimizer", "scheduler", "global_step", "logged", "callback_metrics", "python_rng", "training"):
        assert a[key] == b[key], key
    assert torch.equal(a["torch_rng"], b["torch_rng"])
    assert np.array_equal(a["numpy_rng"], b["numpy_rng"])
    assert after.hooks == 4  # only the real step's 4 micro-batches reached other callbacks


def test_search_then_train_is_bit_identical_to_training_at_that_size():
    def run(callbacks, batch_size, accumulate):
        recorder = StepRecorder()
        torch.manual_seed(3)
        module = OOMAbove(limit=10, dropout=0.1)
        _trainer([*callbacks, recorder], max_steps=3, accumulate_grad_batches=accumulate).fit(
            module, datamodule=TokenData(batch_size=batch_size)
        )
        return recorder.losses, module.model.state_dict()

    searched_losses, searched = run([AutoBatchSize(global_batch_size=32, max_micro_batch_size=32)], 4, 1)
    plain_losses, plain = run([], 8, 4)
    assert searched_losses == plain_losses
    for key in plain:
        assert torch.equal(searched[key], plain[key]), key


def test_oom_mid_training_redoes_the_step_with_a_smaller_micro_batch():
    def run(max_micro, later_limit):
        recorder = StepRecorder()
        torch.manual_seed(5)
        module = OOMAbove(limit=None, later_step=3, later_limit=later_limit)
        search = AutoBatchSize(global_batch_size=16, max_micro_batch_size=max_micro)
        with pytest.warns(UserWarning, match="out of memory at step 3") if later_limit else _nothing():
            _trainer([search, recorder], max_steps=6).fit(module, datamodule=TokenData())
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
        _trainer([search, recorder], max_steps=4).fit(module, datamodule=data)
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
    trainer = _trainer([search], max_steps=5, default_root_dir=tmp_path)
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
    trainer = _trainer([search], max_steps=5, default_root_dir=tmp_path)
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
    trainer = _trainer([search], max_steps=2, plugins=[fp16])
    trainer.fit(OOMInOptimizerStep(), datamodule=TokenData())
    assert [(t.micro_batch_size, t.fits) for t in search.trials] == [(1, True), (2, True), (4, True), (8, False)]
    assert search.micro_batch_size == 4 and trainer.global_step == 2


class _IterableTokens(TokenData):
    def train_dataloader(self):
        dataset = self.dataset

        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                return (dataset[i] for i in range(len(dataset)))

        return torch.utils.data.DataLoader(Stream(), batch_size=self.batch_size)


def test_search_over_an_iterable_dataset_leaves_the_rng_untouched():
    before, after = _Probe(), _Probe()
    search = AutoBatchSize(global_batch_size=16, max_micro_batch_size=16)
    trainer = _trainer([before, search, after], max_steps=1)
    trainer.fit(OOMAbove(limit=5), datamodule=_IterableTokens(batch_size=16))
    assert search.micro_batch_size == 4
    assert torch.equal(before.snapshot["torch_rng"], after.snapshot["torch_rng"])


def test_resume_reuses_the_decision_without_searching(tmp_path):
    search, counter = AutoBatchSize(global_batch_size=16, max_micro_batch_size=16), _CountSteps()
    trainer = _trainer([counter, search], max_steps=2, enable_checkpointing=True, default_root_dir=tmp_path)
    trainer.fit(OOMAbove(limit=5), datamodule=TokenData())
    assert search.micro_batch_size == 4
    # steps_per_trial=2 steps per size that fits; a size that runs out of memory stops at its first
    assert counter.count == sum(2 if t.fits else 1 for t in search.trials) == 7
    ckpt = next(tmp_path.rglob("*.ckpt"))
    resumed, counter = AutoBatchSize(global_batch_size=16, max_micro_batch_size=16), _CountSteps()
    data = TokenData(batch_size=1)
    trainer = _trainer([counter, resumed], max_steps=3, default_root_dir=tmp_path)
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
    _trainer([first], max_steps=2, enable_checkpointing=True, default_root_dir=tmp_path).fit(
        OOMAbove(limit=5), datamodule=TokenData()
    )
    assert first.micro_batch_size == 4
    resumed = AutoBatchSize(global_batch_size=16, max_micro_batch_size=16)
    trainer = _trainer([resumed], max_steps=3, strategy=_restores_after_setup())
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
        trainer = _trainer([search, ExactResume(), checkpoints, recorder], max_steps=4, enable_checkpointing=True,
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


def test_logs_the_decision_to_the_logger(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path)
    _trainer([AutoBatchSize(global_batch_size=16, max_micro_batch_size=16)], max_steps=1, logger=logger).fit(
        OOMAbove(limit=6), datamodule=TokenData()
    )
    import csv

    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    logged = {k: v for row in rows for k, v in row.items() if k.startswith("auto_batch_size/") and v}
    assert float(logged["auto_batch_size/micro_batch_size"]) == 4
    assert float(logged["auto_batch_size/accumulate_grad"]) == 4
    assert float(logged["auto_batch_size/global_batch_size"]) == 16
    hparams = (Path(logger.log_dir) / "hparams.yaml").read_text()
    assert "auto_batch_size/search: 1 fits; 2 fits; 4 fits; 8 no (out of memory)" in hparams


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_agree_on_the_smaller_limit(tmp_path, strategy):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), strategy], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for res in results:
        # global 16 over 2 ranks = 8 per rank; rank 0 holds 6, rank 1 holds 3: both use 2 (x 4 accumulation)
        assert (res["micro"], res["accumulate"], res["batch_size"]) == (2, 4, 2)
        assert res["global_step"] == 2
        assert res["micro_batches"] == [2] * 8
    assert results[0]["trials"] == results[1]["trials"] == [[1, True], [2, True], [4, False]]
    assert results[0]["weights_sum"] == pytest.approx(results[1]["weights_sum"], rel=0, abs=0)  # replicas in sync


def test_epoch_based_schedule_is_rebuilt_for_a_new_global_batch():
    module = OOMAbove(limit=None, warmup_steps=0, min_lr_ratio=0.1)
    search = AutoBatchSize(global_batch_size=64, max_micro_batch_size=16)
    trainer = _trainer([search], max_steps=-1, max_epochs=1)
    trainer.fit(module, datamodule=TokenData(batch_size=4, n=256))  # configured: 4 per step, 64 steps/epoch
    assert trainer.global_step == 4  # 256 samples / 64 per step
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    # the cosine schedule was sized for the 4 real steps, so it ends at the minimum LR
    assert scheduler.get_last_lr()[0] == pytest.approx(module.hparams.learning_rate * 0.1, rel=1e-6)


def test_yaml_config_through_the_gpuopt_cli(text_dir, cache_dir, tmp_path):
    """The README's YAML: AutoBatchSize in trainer.callbacks, with the real TextDataModule."""
    from lightning_gpuopt.cli import GPTCLI
    from lightning_gpuopt.data import TextDataModule
    from lightning_gpuopt.model import GPTModule

    config = tmp_path / "auto.yaml"
    config.write_text(
        f"""
trainer:
  accelerator: cpu
  default_root_dir: {tmp_path}
  max_steps: 2
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  callbacks:
    - class_path: lightning_gpuopt.callbacks.AutoBatchSize
      init_args:
        global_batch_size: 12
        max_micro_batch_size: 4
model:
  preset: tiny
  warmup_steps: 1
data:
  source: {text_dir}
  vocab_size: 300
  block_size: 32
  batch_size: 2
  num_workers: 0
"""
    )
    cli = GPTCLI(GPTModule, TextDataModule, args=["fit", "--config", str(config)])
    search = next(c for c in cli.trainer.callbacks if isinstance(c, AutoBatchSize))
    assert (search.micro_batch_size, search.accumulate_grad_batches) == (4, 3)  # largest divisor of 12 <= 4
    assert cli.datamodule.batch_size == 4 and cli.trainer.global_step == 2


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
        trainer = _trainer(callbacks, max_steps=max_steps, enable_checkpointing=True, default_root_dir=tmp_path)
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        return recorder, data

    full, _ = run(max_steps=4)
    step2 = next((tmp_path / "ckpt").glob("*step=2.ckpt"))
    resumed, data = run(max_steps=4, ckpt_path=step2)
    assert data.batch_size == 4  # the saved decision (4 x 2), not the configured 1
    assert resumed.samples == full.samples[2:]
    assert resumed.losses == full.losses[2:]
