"""`AtomicModelParallelStrategy`: Lightning's FSDP2 strategy, whose distributed checkpoints are never half written.

Lightning's ``ModelParallelStrategy`` writes a distributed checkpoint (a folder: one ``.distcp``
file per rank, ``.metadata`` and ``meta.pt``) into the target folder in place. A run killed while
it overwrites ``last.ckpt`` leaves a folder that mixes the new step's files with the old one's,
which loads as neither. This subclass writes every rank's files into a sibling folder
``.<name>.partial`` and, once all ranks are done, rank 0 swaps it in with two renames:

1. ``<name>`` (the previous checkpoint, if any) -> ``.<name>.old``
2. ``.<name>.partial`` -> ``<name>``; then ``.<name>.old`` is deleted.

A kill at any point leaves a complete checkpoint: the old ``<name>`` until step 1, the new
``<name>`` after step 2, and between the two renames (microseconds) the old one as
``.<name>.old``, which ``load_checkpoint`` falls back to with a warning. A partial folder left by
a kill is deleted by the next save. Single-file checkpoints (``save_distributed_checkpoint=False``)
go through Lightning's path unchanged (``AtomicCheckpointIO`` covers those on one device and DDP).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

__all__ = ["AtomicModelParallelStrategy", "partial_path", "previous_path"]


def partial_path(path: Path) -> Path:
    """Where a distributed checkpoint for ``path`` is written before it is swapped in."""
    return path.with_name(f".{path.name}.partial")


def previous_path(path: Path) -> Path:
    """Where the checkpoint ``path`` replaces is kept while the new one is swapped in."""
    return path.with_name(f".{path.name}.old")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


class AtomicModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 with Lightning) whose distributed checkpoints are replaced atomically.

    Same arguments and behaviour as Lightning's ``ModelParallelStrategy``; only saving differs (see
    the module docstring), and loading falls back to the previous checkpoint if a kill came between
    the two renames of a save. ``choose_strategy`` and ``trainer.strategy: gpuopt-auto`` use it.

    Example::

        trainer = Trainer(devices=8, strategy=AtomicModelParallelStrategy(data_parallel_size=8, tensor_parallel_size=1))

    .. code-block:: yaml

        trainer:
          strategy:
            class_path: lightning_gpuopt.strategies.AtomicModelParallelStrategy
            init_args: {data_parallel_size: auto, tensor_parallel_size: 1}

    Note:
        The folder must be on a file system all ranks share (as for Lightning's own distributed
        checkpoints); the renames are atomic on one POSIX file system, not across file systems.
    """

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(filepath))
        partial = partial_path(path)
        if self.global_rank == 0:
            _remove(partial)  # what a killed save left
            partial.parent.mkdir(parents=True, exist_ok=True)
        self.barrier("atomic_checkpoint_begin")
        super().save_checkpoint(checkpoint, partial, storage_options)  # every rank writes its shard
        self.barrier("atomic_checkpoint_written")
        if self.global_rank == 0:
            previous = previous_path(path)
            _remove(previous)
            if path.exists() or path.is_symlink():
                os.replace(path, previous)
            os.replace(partial, path)
            _fsync_dir(path.parent)
            _remove(previous)
        self.barrier("atomic_checkpoint_done")

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(checkpoint_path)
        previous = previous_path(path)
        if not path.exists() and previous.is_dir():
            rank_zero_warn(
                f"{path} is missing but {previous.name} is complete: a save was stopped between its two renames. "
                f"Loading {previous}."
            )
            checkpoint_path = previous
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        super().remove_checkpoint(filepath)
        if self.global_rank == 0:
            for leftover in (partial_path(Path(filepath)), previous_path(Path(filepath))):
                _remove(leftover)
