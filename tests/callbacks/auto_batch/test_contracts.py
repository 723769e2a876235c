"""AutoBatchSize's contracts with the rest of a run: it works with ExactResume through an emergency
save, it honours the SavesAlone hook of any callback, and it refuses a loader that ignores its size."""

from __future__ import annotations

import contextlib
import logging

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_gpuopt.callbacks import AutoBatchSize, ExactResume
from lightning_gpuopt.data import TextDataModule
from lightning_gpuopt.protocols import ResumableData, SavesAlone, TakesMicroBatch
from tests.callbacks.auto_batch._helpers import OOMAbove, StepRecorder, TokenData, cpu_trainer


def _trainer(callbacks, max_steps, tmp_path) -> pl.Trainer:
    return cpu_trainer(callbacks, max_steps, default_root_dir=tmp_path)


class _AloneRecorder(pl.Callback):
    """A user's callback implementing SavesAlone: records whether each save ran inside saving_alone()."""

    def __init__(self):
        self.alone, self.saves = False, []

    @contextlib.contextmanager
    def saving_alone(self):
        self.alone = True
        try:
            yield
        finally:
            self.alone = False

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.saves.append(self.alone)


def test_emergency_save_with_exact_resume_resumes_exactly_and_saves_alone(text_dir, cache_dir, tmp_path):
    """Out of memory at micro-batch 1 in step 2: AutoBatchSize saves the last step from this rank alone (every
    SavesAlone callback is told), ExactResume adds its RNG state, and a resume from that file repeats the
    uninterrupted run's losses bit for bit."""

    def run(module, ckpt_path=None, extra=()):
        recorder = StepRecorder()
        torch.manual_seed(5)
        data = TextDataModule(source=str(text_dir), vocab_size=300, block_size=16, batch_size=2, num_workers=0)
        search = AutoBatchSize(global_batch_size=2, max_micro_batch_size=1)
        trainer = _trainer([search, ExactResume(), recorder, *extra], 4, tmp_path)
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        return recorder

    full = run(OOMAbove(dropout=0.1, vocab_size=320))
    alone = _AloneRecorder()
    with pytest.raises(RuntimeError, match=r"Saved the last completed step \(global step 2\)"):
        run(OOMAbove(later_step=2, later_limit=0, dropout=0.1, vocab_size=320), extra=[alone])
    assert alone.saves == [True]  # the emergency save, inside saving_alone()
    path = tmp_path / "oom-step=2-rank=0.ckpt"
    state = torch.load(path, weights_only=True)["callbacks"]["ExactResume"]
    assert len(state["rng"]) == 1 and state["rng"][0] is not None
    resumed = run(OOMAbove(dropout=0.1, vocab_size=320), ckpt_path=path)
    assert resumed.samples == full.samples[2:]
    assert resumed.losses == full.losses[2:]


def test_exact_resume_gathers_only_its_own_state_when_saving_alone():
    callback = ExactResume()
    assert isinstance(callback, SavesAlone) and not callback._alone
    with callback.saving_alone():
        assert callback._alone
    assert not callback._alone


class _BuiltOnce(OOMAbove):
    """A module whose DataLoader is built once in setup(): it ignores the batch size set afterwards."""

    def __init__(self):
        super().__init__()
        self.batch_size = 8

    def setup(self, stage):
        super().setup(stage)
        self.loader = DataLoader(TokenData(n=64).dataset, batch_size=self.batch_size, drop_last=True)

    def train_dataloader(self):
        return self.loader


def test_a_loader_that_ignores_the_chosen_size_stops_the_run_with_the_fix(tmp_path):
    search = AutoBatchSize(max_micro_batch_size=4)
    trainer = _trainer([search], 2, tmp_path)
    with pytest.raises(ValueError, match=r"micro-batch to 4 through `batch_size`.*DataLoader's batch_size is 8.*8 x 2 x 1 = 16 "
                                         r"samples instead of the global batch 8.*build it inside train_dataloader\(\)"):
        trainer.fit(_BuiltOnce())
    assert trainer.global_step == 0  # stopped at the first batch, before any optimizer step


def test_a_short_last_batch_is_not_taken_for_a_loader_that_ignores_the_size(tmp_path):
    """A dataset smaller than the micro-batch gives short last batches: that is the loader honouring the size."""
    search = AutoBatchSize(global_batch_size=4, max_micro_batch_size=4)

    class Short(TokenData):
        def train_dataloader(self):
            return DataLoader(self.dataset, batch_size=self.batch_size, drop_last=False)

    trainer = _trainer([search], 2, tmp_path)
    trainer.fit(OOMAbove(), datamodule=Short(batch_size=4, n=3))
    assert search.micro_batch_size == 4 and trainer.global_step == 2


def test_text_datamodule_is_resumable_data_and_plain_ones_are_not():
    assert isinstance(TextDataModule(source="stdlib"), ResumableData)
    assert not isinstance(TokenData(), ResumableData)


class _Told(TokenData):
    """A datamodule of one's own that takes the micro-batch by a call (TakesMicroBatch)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.told = []

    def use_micro_batch(self, size):
        self.told.append(size)
        self.batch_size = size


def test_a_datamodule_that_takes_the_micro_batch_is_told_by_a_call_and_others_get_the_attribute(tmp_path, caplog):
    assert isinstance(TextDataModule(source="stdlib"), TakesMicroBatch) and not isinstance(TokenData(), TakesMicroBatch)
    fallback = "does not take the micro-batch by a call"
    told = _Told(batch_size=8)
    search = AutoBatchSize(max_micro_batch_size=4, steps_per_trial=1, batch_size_attr="rows")  # no such attribute:
    with caplog.at_level(logging.INFO):  # the call alone hands the size over
        _trainer([search], 1, tmp_path / "a").fit(OOMAbove(limit=2), datamodule=told)
    assert told.told == [2] and not any(fallback in r.getMessage() for r in caplog.records)
    caplog.clear()
    plain = TokenData(batch_size=8)
    with caplog.at_level(logging.INFO):
        _trainer([AutoBatchSize(max_micro_batch_size=4, steps_per_trial=1)], 1, tmp_path / "b").fit(
            OOMAbove(limit=2), datamodule=plain
        )
    assert plain.batch_size == 2 and sum(fallback in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("shape", ["nanogpt", "llama", "litgpt", "noforward", "iterable-collate"])
def test_contract_with_modules_written_elsewhere(shape, tmp_path):
    """tests/test_contract.py's checks for AutoBatchSize, which needs a loader it can resize (a datamodule's):
    the micro-batch it claims is the one every training batch holds, the global batch is kept, two fits in a
    row with the same instance, a weights_only checkpoint and a state_dict round trip. With the module's own
    loader there is no batch size to set: the clear error, before any step."""
    from tests._module_shapes import SHAPES, LoaderData, NoForwardModule, shape_loader

    make = {**SHAPES, "noforward": NoForwardModule, "iterable-collate": SHAPES["litgpt"]}[shape]
    data_shape = "litgpt" if shape == "noforward" else shape

    class Sizes(pl.Callback):
        def __init__(self):
            self.sizes = set()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.sizes.add(len(batch["input_ids"]) if isinstance(batch, dict) else len(batch[0]))

    search = AutoBatchSize(max_micro_batch_size=2)
    for attempt in range(2):
        sizes = Sizes()
        trainer = _trainer([search, sizes], 2, tmp_path / str(attempt))
        torch.manual_seed(0)
        trainer.fit(make(), datamodule=LoaderData(data_shape, batch_size=4))
        assert (search.micro_batch_size, search.accumulate_grad_batches) == (2, 2) and sizes.sizes == {2}
        assert trainer.global_step == 2 and trainer.accumulate_grad_batches == 2
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    saved = torch.load(tmp_path / "a.ckpt", weights_only=True)["callbacks"]["AutoBatchSize"]
    again = AutoBatchSize(max_micro_batch_size=2)
    again.load_state_dict(saved)
    assert again.state_dict() == search.state_dict() == saved

    with pytest.raises(ValueError, match=r"name yours with AutoBatchSize\(batch_size_attr=\.\.\.\)"):
        _trainer([AutoBatchSize(max_micro_batch_size=2)], 2, tmp_path / "own").fit(make(), shape_loader(data_shape, 4))


class _Packed(OOMAbove):
    """Packs each micro-batch into one row (1, B*T), as sequence-packing collates do: the loader honours the size."""

    def __init__(self, batch_sampler=False):
        super().__init__()
        self.batch_size, self.use_batch_sampler = 4, batch_sampler

    def train_dataloader(self):
        def collate(items):
            x = torch.stack([i[0] for i in items]).reshape(1, -1)
            return x[:, : x.size(1) // 16 * 16].reshape(-1, 16), torch.stack([i[1] for i in items]).reshape(-1, 16)

        dataset = TokenData(n=64).dataset
        if self.use_batch_sampler:  # a batch sampler without a batch_size attribute, that ignores the module's
            batches = [list(range(i, i + 8)) for i in range(0, 64, 8)]
            return DataLoader(dataset, batch_sampler=batches, collate_fn=collate)
        packed = DataLoader(dataset, batch_size=self.batch_size, drop_last=True, collate_fn=collate)
        return packed


def test_the_loaders_batch_size_is_trusted_over_the_batch_shape(tmp_path):
    search = AutoBatchSize(global_batch_size=4, max_micro_batch_size=2)
    trainer = _trainer([search], 2, tmp_path)
    trainer.fit(_Packed())
    assert search.micro_batch_size == 2 and trainer.global_step == 2


def test_a_loader_without_batch_size_is_judged_by_its_first_batch(tmp_path):
    search = AutoBatchSize(global_batch_size=8, max_micro_batch_size=4)
    with pytest.raises(ValueError, match=r"micro-batch to 4 through `batch_size`, but the training batch holds 8"):
        _trainer([search], 2, tmp_path).fit(_Packed(batch_sampler=True))


def test_own_loader_with_auto_batch_size_and_an_epoch_schedule_resumes_exactly(tmp_path):
    """ExactResume(rebuild_loaders=True) with AutoBatchSize and max_epochs: Lightning builds the loader for
    estimated_stepping_batches, AutoBatchSize drops it, the fit loop builds it again; every build starts at
    the checkpoint's position."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Own(OOMAbove):
        def __init__(self):
            super().__init__(dropout=0.1)
            self.batch_size = 8

        def train_dataloader(self):
            return DataLoader(TokenData(n=48).dataset, batch_size=self.batch_size, shuffle=True)

    def run(ckpt=None):
        torch.manual_seed(3)
        recorder = StepRecorder()
        trainer = pl.Trainer(
            accelerator="cpu", max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=tmp_path, callbacks=[
                AutoBatchSize(max_micro_batch_size=4), ExactResume(rebuild_loaders=True), recorder,
                ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)])
        trainer.fit(Own(), ckpt_path=ckpt)
        return recorder

    full = run()
    assert len(full.losses) == 12  # 6 steps of 8 samples (4 x 2) per epoch
    resumed = run(next((tmp_path / "ckpt").glob("*step=2.ckpt")))
    assert resumed.samples == full.samples[2:]
    assert resumed.losses == full.losses[2:]
