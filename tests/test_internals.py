"""The private names of other libraries this package touches are where internals.py expects them (fails loudly on an upgrade)."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest

from tests._module_shapes import NanoGPTModule, shape_loader
from lightning_gpuopt.internals import show_in_progress_bar, wrap_train_dataloader


class _Wrapping(pl.Callback):
    def __init__(self):
        self.seen = []

    def setup(self, trainer, pl_module, stage):
        self.undo = wrap_train_dataloader(trainer, lambda loaders: self.seen.append(loaders) or loaders)

    def teardown(self, trainer, pl_module, stage):
        self.undo()


def test_train_dataloader_wrap_sees_the_loader_and_undoes():
    loader = shape_loader("nanogpt", batch_size=2, n=8)
    wrapping = _Wrapping()
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[wrapping])
    trainer.fit(NanoGPTModule(), loader)
    assert wrapping.seen == [loader]
    assert "dataloader" not in vars(trainer.fit_loop._data_source)  # undone


def test_missing_private_state_fails_loudly():
    with pytest.raises(RuntimeError, match="_data_source.dataloader is gone"):
        wrap_train_dataloader(SimpleNamespace(fit_loop=SimpleNamespace()), lambda x: x)
    with pytest.raises(RuntimeError, match="_progress_bar_metrics is gone"):
        show_in_progress_bar(SimpleNamespace(), {"a": 1.0})


def test_progress_bar_dict_is_where_we_write():
    trainer = pl.Trainer(logger=False, enable_checkpointing=False)
    show_in_progress_bar(trainer, {"loss": 1.5})
    assert trainer.progress_bar_metrics["loss"] == 1.5  # Lightning's public view of the same dict


def test_every_private_name_we_touch_exists_in_this_lightning():
    """The upgrade check: fails, listing them, when Lightning renames any name in TOUCHED."""
    from lightning_gpuopt.internals import missing_internals

    assert missing_internals(pl.Trainer(logger=False, enable_checkpointing=False)) == []


def test_a_renamed_private_name_stops_auto_batch_size_at_setup_naming_it(monkeypatch, tmp_path):
    from lightning.pytorch.loops import _TrainingEpochLoop

    from lightning_gpuopt.callbacks import AutoBatchSize
    from lightning_gpuopt.internals import missing_internals

    monkeypatch.delattr(_TrainingEpochLoop, "_num_ready_batches_reached")  # as an upgrade that renames it would
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                         callbacks=[AutoBatchSize(max_micro_batch_size=2)])
    assert missing_internals(trainer) == ["trainer.fit_loop.epoch_loop._num_ready_batches_reached"]
    module = NanoGPTModule()
    module.batch_size = 2
    with pytest.raises(RuntimeError, match=r"_num_ready_batches_reached is gone in this version.*"
                                           r"AutoBatchSize cannot run with it"):
        trainer.fit(module, shape_loader("nanogpt", batch_size=2, n=8))
    assert trainer.global_step == 0


def test_loop_surgery_functions_in_a_real_fit():
    """move_batch_position, throwaway_results, dump_checkpoint and last_batch_ready on a real fit loop."""
    from lightning_gpuopt.internals import (
        dump_checkpoint,
        last_batch_ready,
        move_batch_position,
        throwaway_results,
    )

    seen = {}

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx != 1:
                return
            seen["last"] = last_batch_ready(trainer)
            results = trainer.fit_loop.epoch_loop._results
            with throwaway_results(trainer):
                assert trainer.fit_loop.epoch_loop._results is not results
            assert trainer.fit_loop.epoch_loop._results is results
            seen["checkpoint"] = dump_checkpoint(trainer)
            progress = trainer.fit_loop.epoch_loop.batch_progress
            total = progress.total.processed
            move_batch_position(trainer, 1)
            seen["moved"] = (progress.current.processed, progress.total.processed, total)
            move_batch_position(trainer, 2)

    trainer = pl.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[Probe()])
    trainer.fit(NanoGPTModule(), shape_loader("nanogpt", batch_size=2, n=8))
    assert seen["last"] is False
    assert seen["checkpoint"]["global_step"] == 2 and "loops" in seen["checkpoint"]
    assert seen["moved"] == (1, 1, 2)


def test_a_renamed_torch_or_stdlib_name_is_named(monkeypatch):
    import warnings

    import torch

    from lightning_gpuopt.internals import missing_internals

    monkeypatch.delattr(torch, "_foreach_norm")
    monkeypatch.delattr(warnings, "_filters_mutated")
    missing = missing_internals(pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False))
    assert missing == ["import:torch._foreach_norm", "import:warnings._filters_mutated"]


def test_library_accessors_read_what_the_objects_hold():
    import torch
    from jsonargparse import ArgumentParser

    from lightning_gpuopt.internals import parser_options, sequential_parts

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, 0.5, total_iters=3)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    assert sequential_parts(torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], [3])) == ([warmup, cosine], [3])
    assert sequential_parts(cosine) is None
    parser = ArgumentParser()
    parser.add_argument("--lr", type=float)
    assert parser_options(parser) == ["lr"]
