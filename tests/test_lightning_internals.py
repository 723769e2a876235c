"""The private Lightning attributes lightning_gpuopt.lightning_internals relies on still exist."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest

from lightning_gpuopt.lightning_internals import show_in_progress_bar


def test_progress_bar_dict_is_where_we_write():
    trainer = pl.Trainer(logger=False, enable_checkpointing=False)
    show_in_progress_bar(trainer, {"loss": 1.5})
    assert trainer.progress_bar_metrics["loss"] == 1.5  # Lightning's public view of the same dict


def test_a_renamed_attribute_fails_loudly():
    with pytest.raises(RuntimeError, match="_progress_bar_metrics is gone in this Lightning version"):
        show_in_progress_bar(SimpleNamespace(_logger_connector=SimpleNamespace()), {"loss": 1.5})
