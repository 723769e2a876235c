"""The Lightning private state this package touches is where lightning_internals expects it (fails loudly on an upgrade)."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest

from tests._module_shapes import NanoGPTModule, shape_loader
from lightning_gpuopt.lightning_internals import show_in_progress_bar, wrap_train_dataloader


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
