"""`AtomicCheckpointIO`: checkpoint files that are either the old one or the complete new one, never half-written.

Design note: Lightning's ``TorchCheckpointIO`` serialises the whole checkpoint into memory, then
writes it through an ``fsspec`` transaction whose temporary file lives in the system temp
directory; committing is a ``shutil.move``, a copy when that directory is on another filesystem,
and nothing is fsynced. Here the checkpoint is streamed into a temporary file next to the target,
fsynced, and renamed over it with ``os.replace`` (atomic on POSIX and Windows), then the directory
is fsynced, so after a crash or ``kill -9`` at any moment ``last.ckpt`` is the old file or the new
one. Loading defaults to ``weights_only=True``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lightning_gpuopt.model.checkpoint import read_checkpoint
from lightning_gpuopt.plugins.checkpoint_safety import (
    check_finite_weights,
    checkpoint_nbytes,
    disk_full_error,
    is_disk_full,
    remove_orphaned_temps,
    temp_path,
)

__all__ = ["AtomicCheckpointIO", "atomic_save", "fsync_path"]


def _is_local(path: _PATH) -> bool:
    text = str(path)
    return "://" not in text or text.startswith("file://")


def atomic_save(obj: Any, path: _PATH) -> None:
    """``torch.save`` ``obj`` to ``path`` atomically: a temp file in the same folder, fsync, ``os.replace``.

    If anything fails (pickling, a full disk, a kill), ``path`` keeps its old content and the
    temporary file is removed (after a ``kill -9``, a ``.<name>.tmp-*`` file may be left, never ``path``
    half-written; the next save into the folder removes it). A full disk raises an ``OSError``
    (``ENOSPC``) saying where and about how many GB the checkpoint needs.

    Example::

        atomic_save({"step": 3, "weights": model.state_dict()}, "checkpoints/last.ckpt")

    Args:
        obj: Anything ``torch.save`` accepts.
        path: The local file to write.
    """
    path = Path(str(path).removeprefix("file://"))
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_orphaned_temps(path.parent)  # what earlier saves killed mid-write left
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, Exception) and is_disk_full(err):
            raise disk_full_error(path, checkpoint_nbytes(obj)) from err
        raise
    fsync_path(path.parent)  # make the rename itself durable


def fsync_path(path: _PATH) -> None:
    """Flush a file's data, or a folder's entries (renames, new files), to disk. A no-op off POSIX.

    Example::

        os.replace(tmp, target)
        fsync_path(Path(target).parent)  # the rename survives a power loss

    Args:
        path: A local file or folder.
    """
    if os.name != "posix":  # Windows cannot open a folder to fsync it
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes checkpoints atomically and reads them with ``weights_only=True`` by default.

    A drop-in replacement for Lightning's default ``TorchCheckpointIO`` (single-file checkpoints:
    single device, DDP, FSDP with a full state dict). The ``gpuopt`` CLI uses it unless the
    strategy brings its own CheckpointIO.

    Example::

        trainer = Trainer(plugins=[AtomicCheckpointIO()])

        # gpuopt / LightningCLI YAML
        trainer:
          plugins:
            - class_path: lightning_gpuopt.plugins.AtomicCheckpointIO

    Args:
        allow_nonfinite: Write checkpoints whose weights hold NaN/Inf. By default such a save raises
            :class:`~lightning_gpuopt.plugins.checkpoint_safety.NonFiniteCheckpointError` and writes
            nothing, so a diverged run never replaces a good checkpoint.

    Note:
        Each save first removes the temporary files that earlier saves into the same folder left
        when they were killed (only files named by this writer, of processes that are gone).
        Remote paths (``s3://``, ``gs://``, ...) go through Lightning's own ``fsspec`` writer, whose
        object-store uploads are all-or-nothing already. A broken or foreign file raises
        :class:`~lightning_gpuopt.model.checkpoint.CheckpointError` naming the problem.
    """

    def __init__(self, allow_nonfinite: bool = False) -> None:
        super().__init__()
        self.allow_nonfinite = allow_nonfinite

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        if not self.allow_nonfinite:
            check_finite_weights(checkpoint, path)  # before anything is written: the previous file stays
        if storage_options is not None or not _is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_save(checkpoint, path)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Optional[Callable] = lambda storage, loc: storage,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        if not _is_local(path):
            return super().load_checkpoint(path, map_location, True if weights_only is None else weights_only)
        return read_checkpoint(str(path).removeprefix("file://"), map_location, True if weights_only is None else weights_only)
