"""Atomic files: a file or a checkpoint folder on disk is the old one or the complete new one, never half written.

A file goes through a temporary sibling, fsync and ``os.replace`` (:func:`atomic_save`); a folder is
written under a hidden name and swapped in whole (:func:`swap_in`). ``docs/reliability.md``.
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
from typing import Any, Union

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_gpuopt.checkpoint.safety import (
    checkpoint_nbytes,
    disk_full_error,
    is_disk_full,
    remove_orphaned_temps,
    temp_path,
)

PathLike = Union[str, os.PathLike]  # a local path or a URL-like string, as Lightning's checkpoint IO takes

__all__ = [
    "PathLike",
    "atomic_save",
    "checkpoint_to_load",
    "fsync_path",
    "partial_path",
    "previous_path",
    "remove_tree",
    "swap_in",
]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def atomic_save(obj: Any, path: PathLike) -> None:
    """``torch.save`` ``obj`` to ``path`` atomically: a temp file in the same folder, fsync, ``os.replace``.

    If anything fails (pickling, a full disk, a kill), ``path`` keeps its old content; a full disk raises
    an ``OSError`` (``ENOSPC``) saying where and about how many GB the checkpoint needs.
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


def fsync_path(path: PathLike) -> None:
    """Flush a file's data, or a folder's entries (renames, new files), to disk. A no-op off POSIX."""
    if os.name != "posix":  # Windows cannot open a folder to fsync it
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hidden(path: Path, kind: str) -> Path:
    digest = hashlib.sha1(path.name.encode()).hexdigest()[:16]
    return path.with_name(f".gpuopt-{kind}-{digest}")


def partial_path(path: Path) -> Path:
    """Where a distributed checkpoint for ``path`` is written before it is swapped in: a hidden sibling."""
    return _hidden(path, "partial")


def previous_path(path: Path) -> Path:
    """Where the checkpoint ``path`` replaces waits while a two-rename swap is under way: a hidden sibling."""
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


def remove_tree(path: Path) -> None:
    """Delete ``path``, a folder with its contents or a file; nothing if it is not there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _remove_old(path: Path) -> None:
    """Delete the replaced checkpoint; the new one is in place, so a failure only leaves it for the next save."""
    try:
        remove_tree(path)
    except OSError as err:  # e.g. NFS ".nfs*" files of a shard another process still has open
        warnings.warn(f"Could not delete the replaced checkpoint {path} ({err}); the next save of this name retries.")


def swap_in(new: Path, path: Path) -> None:
    """Make the complete folder ``new`` (a sibling on the same file system) the checkpoint ``path``, so that a kill
    at any moment leaves a whole one: one ``renameat2(RENAME_EXCHANGE)`` where the file system has it, else
    two renames through :func:`previous_path`."""
    if not (path.exists() or path.is_symlink()):
        os.replace(new, path)
        fsync_path(path.parent)
    elif _exchange(new, path):
        fsync_path(path.parent)  # the exchange is durable before the old copy (now at `new`) goes
        _remove_old(new)
    else:
        previous = previous_path(path)
        remove_tree(previous)
        os.replace(path, previous)
        os.replace(new, path)
        fsync_path(path.parent)
        _remove_old(previous)


def checkpoint_to_load(path: Path) -> Path:
    """``path``, or the previous checkpoint a two-rename swap left aside when a kill came between the renames."""
    previous = previous_path(path)
    if not (path.exists() or path.is_symlink()) and previous.is_dir():
        rank_zero_warn(
            f"{path} is missing but {previous} holds the checkpoint it replaced: a save was stopped between its "
            f"two renames. Loading {previous}."
        )
        return previous
    return path
