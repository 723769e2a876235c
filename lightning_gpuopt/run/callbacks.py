"""The run's callbacks made one list: checkpoint folders a new process finds, each stack callback once, and what a
resumed ``fit`` adds (``docs/reliability.md``)."""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gpuopt.callbacks import ExactResume, SigtermCheckpoint
from lightning_gpuopt.callbacks.resumed_optimizer import ResumedOptimizerSettings
from lightning_gpuopt.internals import no_version_counter

__all__ = ["fill_checkpoint_dirs", "merge_callbacks", "prepare_resumed_fit"]

_ONCE = (ExactResume, SigtermCheckpoint)  # a second copy would save or restore the same state twice


def fill_checkpoint_dirs(trainer: Any) -> None:
    """Give every ``ModelCheckpoint`` without a ``dirpath`` the folder ``<default_root_dir>/checkpoints``, where the
    next ``ckpt_path="last"`` looks (Lightning's default, the logger's new ``version_N``, a new process cannot know)."""
    folder = os.path.realpath(os.path.join(trainer.default_root_dir, "checkpoints"))
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
            callback.dirpath = folder


def merge_callbacks(trainer: Any) -> None:
    """Keep the first ``ExactResume`` and ``SigtermCheckpoint`` of ``trainer.callbacks`` (a copy listed with its own
    arguments comes first and stays; the ``gpuopt`` command adds one of each) and fill the checkpoint folders."""
    for cls in _ONCE:
        for extra in [c for c in trainer.callbacks if type(c) is cls][1:]:
            trainer.callbacks.remove(extra)
    fill_checkpoint_dirs(trainer)


def prepare_resumed_fit(trainer: Any) -> None:
    """On a resumed ``fit``, make each ``ModelCheckpoint`` replace a file of the same name (the stopped run's) instead
    of adding ``-vN`` beside it (``internals.no_version_counter``: no public setter), and add
    ``ResumedOptimizerSettings``, which applies asked optimizer settings over the restored ones."""
    for callback in trainer.checkpoint_callbacks:
        no_version_counter(callback)
    if not any(isinstance(c, ResumedOptimizerSettings) for c in trainer.callbacks):
        trainer.callbacks.append(ResumedOptimizerSettings())
