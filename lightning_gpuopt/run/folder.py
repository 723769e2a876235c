"""A run's folder: which file ``--ckpt_path last`` / ``hpc`` names, a ``fit`` that would overwrite a run, one writer.

Lightning turns ``last`` and ``hpc`` into a file only inside ``trainer.fit``, after everything is built; resolved
here as Lightning would, from the parsed configuration, the file goes through the resume checks and is the one
the Trainer loads. The behaviour: ``docs/reliability.md`` ("Where last.ckpt is", "One writer per run folder")."""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from lightning_gpuopt.option_checks import from_command_line, option
from lightning_gpuopt.run.lock import HeldLock, PathInUse, holds_locks, keep_held, take_lock

__all__ = [
    "LOCK_FILE",
    "checkpoint_dirs",
    "existing_run_problem",
    "hold_run_folder",
    "last_checkpoints",
    "resolve_ckpt_path",
    "run_checkpoints",
]

LOCK_FILE = ".gpuopt-fit.lock"  # the file in a run folder whose flock a running fit holds

_LAST = re.compile(rf"^{ModelCheckpoint.CHECKPOINT_NAME_LAST}(-(\d+))?$")
_HPC = re.compile(r"^hpc_ckpt_(\d+)$")


def _get(node: Any, key: str, default: Any = None) -> Any:
    if node is None:
        return default
    value = node.get(key, default) if hasattr(node, "get") else getattr(node, key, default)
    return default if value is None else value


def _is_model_checkpoint(callback: Any) -> bool:
    if isinstance(callback, ModelCheckpoint):
        return True
    class_path = _get(callback, "class_path")
    if not isinstance(class_path, str):
        return False
    if "." not in class_path:
        return class_path == "ModelCheckpoint"
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    return isinstance(cls, type) and issubclass(cls, ModelCheckpoint)


def checkpoint_dirs(trainer_config: Any) -> list[Path]:
    """The folders the ``ModelCheckpoint`` callbacks of a parsed ``trainer`` group write into (without ``dirpath``, and
    Lightning's own: ``<default_root_dir>/checkpoints``; none with ``enable_checkpointing: false``)."""
    if _get(trainer_config, "enable_checkpointing", True) is False:
        return []
    root = Path(_get(trainer_config, "default_root_dir", os.getcwd()))
    callbacks = _get(trainer_config, "callbacks", [])
    callbacks = callbacks if isinstance(callbacks, (list, tuple)) else [callbacks]
    dirs = []
    for callback in [c for c in callbacks if _is_model_checkpoint(c)] or [None]:  # None: Lightning's own
        dirpath = getattr(callback, "dirpath", None) if isinstance(callback, ModelCheckpoint) else None
        dirpath = dirpath or _get(_get(callback, "init_args"), "dirpath")
        folder = Path(os.path.realpath(dirpath or root / "checkpoints"))
        if folder not in dirs:
            dirs.append(folder)
    return dirs


def _run_folders(trainer_config: Any) -> list[Path]:
    """Where a run's checkpoints may be: :func:`checkpoint_dirs`, and ``<default_root_dir>/checkpoints`` even when
    this configuration writes none (an earlier run of the same folder did)."""
    root = Path(os.path.realpath(_get(trainer_config, "default_root_dir", os.getcwd())))
    dirs = checkpoint_dirs(trainer_config)
    return dirs if root / "checkpoints" in dirs else [*dirs, root / "checkpoints"]


def last_checkpoints(dirs: list[Path]) -> list[Path]:
    """The ``last*.ckpt`` files in ``dirs``, newest first (the order Lightning's ``ckpt_path="last"`` picks in)."""
    return [p for p in run_checkpoints(dirs) if _LAST.match(p.stem)]


def run_checkpoints(dirs: list[Path]) -> list[Path]:
    """Every checkpoint in ``dirs`` (``*.ckpt``, a file or a distributed checkpoint's folder; hidden partial saves
    left out), newest first."""
    found = []
    for folder in dirs:
        if folder.is_dir():
            found += [p for p in folder.iterdir() if p.suffix == ".ckpt" and not p.name.startswith(".") and p.exists()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def resolve_ckpt_path(ckpt_path: Any, subcommand: str, trainer_config: Any) -> Any:
    """The checkpoint file a special ``--ckpt_path`` names, found as Lightning would; other values unchanged.

    ``last``: the newest ``last*.ckpt`` in the run's checkpoint folders, else its newest checkpoint (said); none: a
    ``fit`` starts from step 0 (said), other subcommands stop. ``hpc``: the highest ``hpc_ckpt_N.ckpt`` in
    ``default_root_dir``. ``registry``: refused (a local file can be checked before anything is built)."""
    if not isinstance(ckpt_path, str):
        return ckpt_path
    if ckpt_path == "last":
        return _last(subcommand, trainer_config)
    if ckpt_path == "hpc":
        root = Path(_get(trainer_config, "default_root_dir", os.getcwd()))
        numbered = [(int(m[1]), p) for p in (root.iterdir() if root.is_dir() else []) if p.suffix == ".ckpt"
                    for m in [_HPC.match(p.stem)] if m]
        if not numbered:
            raise ValueError(
                f"--ckpt_path hpc: no hpc_ckpt_N.ckpt in {root}. Pass the checkpoint's path, or the "
                "trainer.default_root_dir of the run that wrote it."
            )
        return str(max(numbered)[1])
    if ckpt_path == "registry" or ckpt_path.startswith("registry:"):
        raise ValueError(
            f"--ckpt_path {ckpt_path}: gpuopt checks a checkpoint before building the run, so it needs a local file. "
            "Download it from the model registry first (litmodels: download_model) and pass its path."
        )
    return ckpt_path


def _last(subcommand: str, trainer_config: Any) -> Optional[str]:
    """The file ``--ckpt_path last`` names: the newest ``last*.ckpt``, else the run's newest checkpoint, said once."""
    dirs = _run_folders(trainer_config)
    where = ", ".join(map(str, dirs))
    found = last_checkpoints(dirs)
    if found:
        rank_zero_info(f"{subcommand} --ckpt_path last: {found[0]}")
        return str(found[0])
    found = run_checkpoints(dirs)
    if found:  # a ModelCheckpoint without save_last (a list of one's own, Lightning's default one)
        more = " ..." if len(found) > 4 else ""
        others = f"; the others: {', '.join(p.name for p in found[1:4])}{more}" if found[1:] else ""
        rank_zero_info(f"{subcommand} --ckpt_path last: no last.ckpt in {where}, so the run's newest checkpoint, "
                       f"{found[0]}{others}. Pass --ckpt_path PATH to resume from another.")
        return str(found[0])
    if subcommand != "fit":
        raise ValueError(
            f"--ckpt_path last: no checkpoint in {where}. Pass the checkpoint's path, or the "
            "trainer.default_root_dir of the run that wrote it."
        )
    rank_zero_info(f"fit --ckpt_path last: no checkpoint in {where} yet, so this run starts from step 0.")
    return None


def existing_run_problem(
    ckpt_path: Any, trainer_config: Any,
    commands: tuple[str, str] = ("gpuopt fit ... --ckpt_path last",
                                 "gpuopt fit ... --trainer.default_root_dir NEW_FOLDER"),
) -> Optional[str]:
    """The error for a ``fit`` without ``--ckpt_path`` (nor ``fast_dev_run``) whose checkpoint folders already hold a
    checkpoint, naming the two ``commands`` to choose from, continue and new run (a re-run is as often a new
    experiment as a continuation: only the user knows which); else ``None``."""
    if ckpt_path or _get(trainer_config, "fast_dev_run", False):
        return None
    dirs = checkpoint_dirs(trainer_config)
    found = last_checkpoints(dirs) or run_checkpoints(dirs)
    if not found:
        return None
    return (
        f"{found[0]} holds a run this fit would overwrite (it starts again from step 0). To continue it: "
        f"`{commands[0]}`; to start a new run: `{commands[1]}` (or move {found[0].parent} away first)."
    )


def _fit() -> str:
    return "gpuopt fit" if from_command_line() else "fit"


def _lock(folder: Path) -> Optional[HeldLock]:
    try:
        return take_lock(folder / LOCK_FILE)
    except PathInUse as used:
        root = option("Trainer", "default_root_dir")
        if used.ours:  # a prepare_run block (or a fit's hold) of this process that has not ended
            raise PathInUse(folder, used.holder, (
                f"{folder} is held by this process already ({used.holder}): an earlier prepare_run block on it has "
                f"not ended, and two runs in one folder write over each other's checkpoints. End that block first "
                f"(its `with` holds the folder), or give this run another {root}."
            )) from None
        raise PathInUse(folder, used.holder, (
            f"{folder} is in use by another {_fit()} ({used.holder}): two runs in one folder write over each other's "
            f"checkpoints. Wait for it to end (or stop it), or give this run another {root}."
        )) from None


def hold_run_folder(trainer: Any, env: Mapping[str, str] = os.environ, keep: bool = True) -> list[Any]:
    """Hold the run folder of a ``fit`` (``default_root_dir``, else the working folder), and each checkpoint folder
    outside it, until the process's end or, with ``keep``, :func:`~lightning_gpuopt.run.lock.release_held`; return
    the locks (``close(tidy)`` lets go of one). A folder another ``fit`` holds stops this one, naming it.
    ``trainer``: a ``Trainer``, or the ``gpuopt`` command's parsed ``trainer`` group."""
    if not holds_locks(env):
        return []
    try:
        import fcntl  # noqa: F401
    except ImportError:  # not on POSIX: said once
        rank_zero_info(f"{_fit()}: no file locks on this platform, so a second fit on the same folder is not refused.")
        return []
    root = Path(os.path.realpath(_get(trainer, "default_root_dir", os.getcwd())))
    held = [_lock(root)]
    try:
        for folder in checkpoint_dirs(trainer):  # a ModelCheckpoint dirpath outside the run folder
            if not folder.is_relative_to(root) and "://" not in str(folder):
                held.append(_lock_checkpoint_folder(folder))
    except ValueError:
        for lock in held:
            if lock is not None:
                lock.close()
        raise
    held = [lock for lock in held if lock is not None]
    if keep:
        keep_held(*held)
    return held


class _FolderLock:
    """An exclusive ``flock`` on a folder itself: nothing is written into it (Lightning's ``ModelCheckpoint`` warns
    about a checkpoint folder that is not empty)."""

    def __init__(self, folder: Path) -> None:
        import fcntl

        self.fd = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise

    def close(self, tidy: bool = False) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _lock_checkpoint_folder(folder: Path) -> Optional[_FolderLock]:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return _FolderLock(folder)
    except BlockingIOError:
        where = ("a ModelCheckpoint dirpath in trainer.callbacks" if from_command_line()
                 else "the dirpath of a ModelCheckpoint in Trainer(callbacks=...)")
        raise PathInUse(folder, "", (
            f"the checkpoint folder {folder} ({where}) is in use by another {_fit()}: two runs in one folder write "
            "over each other's checkpoints. Wait for it to end (or stop it), or give this run's ModelCheckpoint "
            "another dirpath."
        )) from None
    except OSError:  # a file, or a folder this process cannot write: the checks of the options name it, next
        return None
