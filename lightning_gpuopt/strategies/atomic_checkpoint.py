"""`AtomicModelParallelStrategy`: Lightning's FSDP2 strategy, whose distributed checkpoints are never half written.

Lightning's ``ModelParallelStrategy`` writes a distributed checkpoint (a folder: one ``.distcp``
file per rank, ``.metadata`` and ``meta.pt``) into the target folder in place. A run killed while
it overwrites ``last.ckpt`` leaves a folder that mixes the new step's files with the old one's:
killed after the shards and before ``meta.pt``, it loads without an error, with new weights and
old loop counters. This subclass writes every rank's files into a hidden sibling folder and, once
all ranks are done, rank 0 swaps it in (:func:`swap_in`):

* on Linux file systems that support it (ext4, XFS, Btrfs, tmpfs), one ``renameat2`` call with
  ``RENAME_EXCHANGE`` swaps the two folders atomically, and the old one is deleted;
* elsewhere (e.g. NFS), two renames: the old folder to ``.gpuopt-old-<id>``, the new one to the
  target. A kill between them (microseconds) leaves the old checkpoint under that name, which
  ``load_checkpoint`` falls back to with a warning when given the target path (``ckpt_path="last"``
  does not look for it: rename it back by hand).

A hidden folder a killed save left is deleted by the next save of the same name. The hidden names
do not contain the target's name, so Lightning's scans for ``last*.ckpt`` and ``hpc_ckpt_<n>``
never see them. Single-file checkpoints (``save_distributed_checkpoint=False``) go through
Lightning's path unchanged (``AtomicCheckpointIO`` covers those on one device and DDP).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_gpuopt.plugins.checkpoint_io import fsync_path
from lightning_gpuopt.plugins.checkpoint_safety import NonFiniteCheckpointError, non_finite_message, nonfinite_weights

__all__ = ["AtomicModelParallelStrategy", "checkpoint_to_load", "partial_path", "previous_path", "swap_in"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _hidden(path: Path, kind: str) -> Path:
    digest = hashlib.sha1(path.name.encode()).hexdigest()[:16]
    return path.with_name(f".gpuopt-{kind}-{digest}")


def partial_path(path: Path) -> Path:
    """Where a distributed checkpoint for ``path`` is written before it is swapped in: a hidden sibling.

    Example::

        partial_path(Path("ckpt/last.ckpt"))  # Path("ckpt/.gpuopt-partial-<16 hex digits>")

    Args:
        path: The checkpoint to write.
    """
    return _hidden(path, "partial")


def previous_path(path: Path) -> Path:
    """Where the checkpoint ``path`` replaces waits while a two-rename swap is under way: a hidden sibling.

    Example::

        previous_path(Path("ckpt/last.ckpt"))  # Path("ckpt/.gpuopt-old-<16 hex digits>")

    Args:
        path: The checkpoint being replaced.
    """
    return _hidden(path, "old")


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # glibc < 2.28, or a libc without it
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False  # the file system cannot exchange
    raise OSError(err, os.strerror(err), str(a), str(b))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _remove_old(path: Path) -> None:
    """Delete the replaced checkpoint; the new one is in place, so a failure only leaves it for the next save."""
    try:
        _remove(path)
    except OSError as err:  # e.g. NFS ".nfs*" files of a shard another process still has open
        warnings.warn(f"Could not delete the replaced checkpoint {path} ({err}); the next save of this name retries.")


def swap_in(new: Path, path: Path) -> None:
    """Make the complete folder ``new`` the checkpoint ``path``, so that a kill at any moment leaves a whole one.

    Example::

        swap_in(partial_path(Path("ckpt/last.ckpt")), Path("ckpt/last.ckpt"))

    Args:
        new: The written checkpoint (a sibling of ``path``, on the same file system).
        path: The checkpoint to replace, or to create.
    """
    if not (path.exists() or path.is_symlink()):
        os.replace(new, path)
        fsync_path(path.parent)
    elif _exchange(new, path):
        fsync_path(path.parent)  # the exchange is durable before the old copy (now at `new`) goes
        _remove_old(new)
    else:
        previous = previous_path(path)
        _remove(previous)
        os.replace(path, previous)
        os.replace(new, path)
        fsync_path(path.parent)
        _remove_old(previous)


def checkpoint_to_load(path: Path) -> Path:
    """``path``, or the previous checkpoint a two-rename swap left aside when a kill came between the renames.

    Example::

        trainer.strategy.load_checkpoint(checkpoint_to_load(Path("ckpt/last.ckpt")))  # what load_checkpoint does

    Args:
        path: The checkpoint asked for.
    """
    previous = previous_path(path)
    if not (path.exists() or path.is_symlink()) and previous.is_dir():
        rank_zero_warn(
            f"{path} is missing but {previous} holds the checkpoint it replaced: a save was stopped between its "
            f"two renames. Loading {previous}."
        )
        return previous
    return path


class AtomicModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 with Lightning) whose distributed checkpoints are replaced atomically.

    Same arguments and behaviour as Lightning's ``ModelParallelStrategy``; only saving differs (see
    the module docstring), and loading falls back to the previous checkpoint if a kill came between
    the two renames of a save where the file system cannot exchange folders atomically. An error
    while swapping on rank 0 is raised on every rank. A checkpoint whose weights hold NaN/Inf on
    any rank is not written (:class:`~lightning_gpuopt.plugins.NonFiniteCheckpointError` on every
    rank), so a diverged run never replaces a good checkpoint. ``choose_strategy`` and
    ``trainer.strategy: gpuopt-auto`` use it.

    Example::

        trainer = Trainer(devices=8, strategy=AtomicModelParallelStrategy(data_parallel_size=8, tensor_parallel_size=1))

    .. code-block:: yaml

        trainer:
          strategy:
            class_path: lightning_gpuopt.strategies.AtomicModelParallelStrategy
            init_args: {data_parallel_size: auto, tensor_parallel_size: 1}

    Note:
        The folder must be on a file system all ranks share (as for Lightning's own distributed
        checkpoints); the hidden folder is created beside the target, so the swap stays on one file system.
    """

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(filepath))
        partial = partial_path(path)
        state = checkpoint.get("state_dict") or {}
        bad = nonfinite_weights(state)  # this rank's shards; the ranks agree before anything is written
        if not self.reduce_boolean_decision(not bad, all=True):
            raise NonFiniteCheckpointError(
                non_finite_message(path, len(bad), len(state), bad[0] if bad else "on another rank", path.exists())
            )

        def prepare() -> None:
            _remove(partial)  # what a killed save left
            partial.parent.mkdir(parents=True, exist_ok=True)

        def commit() -> None:
            fsync_path(partial / "meta.pt")  # the shards are fsynced by the distributed-checkpoint writer
            fsync_path(partial)
            swap_in(partial, path)

        self._on_rank_zero(prepare, f"Could not prepare {partial} for the checkpoint {path}")
        super().save_checkpoint(checkpoint, partial, storage_options)  # every rank writes its shard
        self.barrier("atomic_checkpoint_written")
        self._on_rank_zero(commit, f"Could not swap the checkpoint written to {partial} in as {path}")

    def _on_rank_zero(self, work: Any, failure: str) -> None:
        """Run ``work`` on rank 0; all ranks agree on the outcome, so an error is raised on every rank, none waits."""
        error: Optional[BaseException] = None
        if self.global_rank == 0:
            try:
                work()
            except Exception as err:
                error = err
        if not self.reduce_boolean_decision(error is None, all=True):
            raise RuntimeError(
                failure + (f": {type(error).__name__}: {error}" if error is not None else " (the error is on rank 0).")
            ) from error

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return super().load_checkpoint(checkpoint_to_load(Path(checkpoint_path)), weights_only=weights_only)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        super().remove_checkpoint(filepath)
        if self.global_rank == 0:
            for leftover in (partial_path(Path(filepath)), previous_path(Path(filepath))):
                _remove(leftover)
