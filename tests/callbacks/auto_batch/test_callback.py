"""AutoBatchSize in real Trainer runs on CPU (GPU-like OOM errors): arguments, the search, its decision logged,
DDP/FSDP2 agreement, the CLI."""

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
from tests._paths import SCRIPTS
from tests.callbacks.auto_batch._helpers import OOMAbove, StepRecorder, TokenData, cpu_trainer

SCRIPT = SCRIPTS / "ddp_auto_batch.py"


# --------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(global_batch_size=0), "global_batch_size must be an integer >= 1 or None, got 0"),
        (dict(max_micro_batch_size=-2), "max_micro_batch_size must be an integer >= 1 or None, got -2"),
        (dict(memory_margin=-0.1), r"memory_margin .* in \[0, 1\)"),
        (dict(memory_margin=1.0), r"memory_margin .* in \[0, 1\)"),
        (dict(mode="linear"), "mode must be 'binsearch' or 'power'"),
        (dict(steps_per_trial=0), "steps_per_trial must be an integer >= 1, got 0"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutoBatchSize(**kwargs)


# --------------------------------------------------------------------------- in a real Trainer
def test_cpu_requires_max_micro_batch_size():
    trainer = cpu_trainer([AutoBatchSize(global_batch_size=16)])
    with pytest.raises(ValueError, match=r"AutoBatchSize\(max_micro_batch_size=\.\.\.\)"):
        trainer.fit(OOMAbove(limit=4), datamodule=TokenData())


def test_missing_batch_size_attribute_is_named():
    class NoBatchSize(TokenData):
        def __init__(self):
            super().__init__()
            del self.batch_size

        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.dataset, batch_size=4)

    trainer = cpu_trainer([AutoBatchSize(max_micro_batch_size=8)])
    with pytest.raises(ValueError, match="batch_size_attr"):
        trainer.fit(OOMAbove(), datamodule=NoBatchSize())


def test_a_datamodule_with_use_micro_batch_but_no_batch_size_is_named():
    """It means to take the micro-batch by a call; the attribute fallback would skip its use_micro_batch (or find no
    batch_size at all and name batch_size_attr): the protocol's missing half is named instead."""
    class CallOnly(TokenData):
        def __init__(self):
            super().__init__()
            self.rows = self.batch_size
            del self.batch_size

        def use_micro_batch(self, size):
            self.rows = size

        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.dataset, batch_size=self.rows)

    trainer = cpu_trainer([AutoBatchSize(max_micro_batch_size=8)])
    with pytest.raises(ValueError, match=r"CallOnly has use_micro_batch\(\) but no `batch_size`, the micro-batch it uses now"):
        trainer.fit(OOMAbove(), datamodule=CallOnly())


def test_chooses_largest_divisor_that_fits_and_keeps_global_batch():
    search = AutoBatchSize(global_batch_size=48, max_micro_batch_size=32)
    recorder = StepRecorder()
    data = TokenData(batch_size=4)
    trainer = cpu_trainer([search, recorder], max_steps=2)
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
    trainer = cpu_trainer([search], max_steps=1, accumulate_grad_batches=2)
    trainer.fit(OOMAbove(limit=5), datamodule=data)
    assert (search.micro_batch_size, search.accumulate_grad_batches) == (4, 4)  # 8 x 2 = 16 = 4 x 4


def test_integer_val_check_interval_keeps_the_samples_between_validations():
    search = AutoBatchSize(global_batch_size=32, max_micro_batch_size=32)
    trainer = cpu_trainer([search], max_steps=1, val_check_interval=12)  # every 12 x 4 = 48 samples
    trainer.fit(OOMAbove(limit=10), datamodule=TokenData(batch_size=4))
    assert search.micro_batch_size == 8 and trainer.val_check_interval == 6  # 6 x 8 = 48 samples
    search = AutoBatchSize(global_batch_size=32, max_micro_batch_size=32)
    trainer = cpu_trainer([search], max_steps=1, val_check_interval=3)  # 3 x 4 = 12 samples: no whole count of 8
    with pytest.warns(UserWarning, match="val_check_interval=3 .* multiple of 2"):
        trainer.fit(OOMAbove(limit=10), datamodule=TokenData(batch_size=4))
    assert trainer.val_check_interval == 3


def test_nothing_fits_names_the_fixes():
    trainer = cpu_trainer([AutoBatchSize(global_batch_size=8, max_micro_batch_size=8)])
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
    trainer = cpu_trainer([before, search, after], max_steps=1)
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
        cpu_trainer([*callbacks, recorder], max_steps=3, accumulate_grad_batches=accumulate).fit(
            module, datamodule=TokenData(batch_size=batch_size)
        )
        return recorder.losses, module.model.state_dict()

    searched_losses, searched = run([AutoBatchSize(global_batch_size=32, max_micro_batch_size=32)], 4, 1)
    plain_losses, plain = run([], 8, 4)
    assert searched_losses == plain_losses
    for key in plain:
        assert torch.equal(searched[key], plain[key]), key


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
    trainer = cpu_trainer([before, search, after], max_steps=1)
    trainer.fit(OOMAbove(limit=5), datamodule=_IterableTokens(batch_size=16))
    assert search.micro_batch_size == 4
    assert torch.equal(before.snapshot["torch_rng"], after.snapshot["torch_rng"])


class _StreamWithCollate(TokenData):
    """An IterableDataset of raw token rows batched by the loader's own collate_fn (rows -> shifted (x, y))."""

    def __init__(self, batch_size: int = 16, batched_by_dataset: bool = False):
        super().__init__(batch_size=batch_size)
        self.batched_by_dataset = batched_by_dataset

    def train_dataloader(self):
        dataset, size = self.dataset, self.batch_size

        class Rows(torch.utils.data.IterableDataset):
            def __iter__(self):
                return (torch.cat([dataset[i][0], dataset[i][1][-1:]]) for i in range(len(dataset)))

        def collate(rows):
            stacked = torch.stack(rows)
            return stacked[:, :-1], stacked[:, 1:]

        if self.batched_by_dataset:  # the dataset yields whole batches of its own: the loader does not batch
            class Batches(torch.utils.data.IterableDataset):
                def __iter__(self):
                    rows = list(Rows())
                    return (collate(rows[i : i + size]) for i in range(0, len(rows), size))

            return torch.utils.data.DataLoader(Batches(), batch_size=None)
        return torch.utils.data.DataLoader(Rows(), batch_size=size, collate_fn=collate)


def test_search_over_an_iterable_dataset_with_its_own_collate():
    class Sizes(pl.Callback):
        def __init__(self):
            self.sizes = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.sizes.append(len(batch[0]))

    search, sizes = AutoBatchSize(global_batch_size=16, max_micro_batch_size=16), Sizes()
    trainer = cpu_trainer([search, sizes], max_steps=2)
    trainer.fit(OOMAbove(limit=5), datamodule=_StreamWithCollate(batch_size=16))
    # the trials collated raw rows with the loader's collate at each size; training got the chosen size
    assert [t.micro_batch_size for t in search.trials][:3] == [1, 2, 4] and search.micro_batch_size == 4
    assert sizes.sizes == [4] * 8 and trainer.global_step == 2
    with pytest.raises(ValueError, match=r"batch_size=None.*yields whole batches.*DataLoader\(dataset, batch_size=self.batch_size"):
        cpu_trainer([AutoBatchSize(global_batch_size=16, max_micro_batch_size=16)], max_steps=1).fit(
            OOMAbove(limit=5), datamodule=_StreamWithCollate(batched_by_dataset=True)
        )


def test_logs_the_decision_to_the_logger(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path)
    cpu_trainer([AutoBatchSize(global_batch_size=16, max_micro_batch_size=16)], max_steps=1, logger=logger).fit(
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
    trainer = cpu_trainer([search], max_steps=-1, max_epochs=1)
    trainer.fit(module, datamodule=TokenData(batch_size=4, n=256))  # configured: 4 per step, 64 steps/epoch
    assert trainer.global_step == 4  # 256 samples / 64 per step
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    # the cosine schedule was sized for the 4 real steps, so it ends at the minimum LR
    assert scheduler.get_last_lr()[0] == pytest.approx(module.hparams.learning_rate * 0.1, rel=1e-6)


def test_yaml_config_through_the_gpuopt_cli(text_dir, cache_dir, tmp_path):
    """The README's YAML: AutoBatchSize in trainer.callbacks, with the real TextDataModule."""
    from lightning_gpuopt.cli.main import GPTCLI
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
