"""A run's folder: which file ``--ckpt_path last`` / ``hpc`` names, and a ``fit`` that would overwrite a run.

Design note: Lightning turns ``last`` and ``hpc`` into a file only inside ``trainer.fit``, after the
model and the data are built, so the checks of :mod:`lightning_gpuopt.cli.resume_checks` (run
before anything is built) saw the word, not the file, and let an architecture change, a foreign
checkpoint or another vocabulary through to a traceback. :func:`resolve_ckpt_path` finds the file
from the parsed configuration the same way Lightning does (the newest ``last*.ckpt`` in the
checkpoint folders, the highest ``hpc_ckpt_N.ckpt`` in ``default_root_dir``), and the CLI puts that
path in the configuration, so every ``--ckpt_path`` goes through the same checks and the Trainer
loads the file that was checked.

Without a ``last*.ckpt`` (a ``ModelCheckpoint`` of one's own without ``save_last``, or Lightning's default
one), ``last`` names the run's newest checkpoint and says so, rather than starting from step 0 next to it.

A ``fit`` without ``--ckpt_path`` into a folder that holds a checkpoint would replace it with
step 1 of a new run. :func:`existing_run_problem` stops such a run (exit 2) with the two commands to
choose from, rather than continuing it: a re-run of a command is as often a new experiment with
changed options (which a resume refuses or applies), and only the user knows which was meant.

A run folder has one writer: :func:`hold_run_folder` takes an exclusive ``flock`` on a file in it
(``.gpuopt-fit.lock``, holding the holder's pid) for the life of the ``fit``, so a second ``gpuopt fit`` on
it stops at its start, naming the first. The kernel drops the lock when its process ends, however it
ends (``kill -9`` included): no stale lock to remove. Under DDP only the launching process (rank 0) holds it;
the ranks it starts run the same command and must not take it (:func:`holds_run_folder`).
"""

from __future__ import annotations

import importlib
import os
import re
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Optional

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

__all__ = [
    "LOCK_FILE",
    "checkpoint_dirs",
    "existing_run_problem",
    "hold_run_folder",
    "holds_run_folder",
    "last_checkpoints",
    "release_run_folder",
    "resolve_ckpt_path",
    "run_checkpoints",
]

LOCK_FILE = ".gpuopt-fit.lock"
"""The file in a run folder whose ``flock`` a running ``gpuopt fit`` holds."""

# Environment variables that give a process's rank (torchrun, Lightning's launcher, Slurm, LSF, MPI): a process
# with any of them above 0 is one a launch started, not the one that holds the run folder.
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK",
                   "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_held: list[IO[str]] = []  # the lock file this process holds (one fit at a time)

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
    """The folders the ``ModelCheckpoint`` callbacks of a parsed ``trainer`` group write into.

    A callback without ``dirpath`` writes into ``<default_root_dir>/checkpoints``
    (:func:`~lightning_gpuopt.cli.defaults.fill_checkpoint_dirs`), and so does the ``ModelCheckpoint`` Lightning adds
    when the list has none; ``enable_checkpointing: false`` writes none.

    Example::

        checkpoint_dirs(config.fit.trainer)  # [Path("/abs/runs/quickstart/checkpoints")]

    Args:
        trainer_config: The parsed ``trainer`` group.
    """
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
    left out), newest first.

    Example::

        run_checkpoints([Path("runs/x/checkpoints")])  # [.../epoch=0-step=10.ckpt, .../epoch=0-step=5.ckpt]
    """
    found = []
    for folder in dirs:
        if folder.is_dir():
            found += [p for p in folder.iterdir() if p.suffix == ".ckpt" and not p.name.startswith(".") and p.exists()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def resolve_ckpt_path(ckpt_path: Any, subcommand: str, trainer_config: Any) -> Any:
    """The checkpoint file a special ``--ckpt_path`` names, found as Lightning would; other values unchanged.

    ``last``: the newest ``last*.ckpt`` in :func:`checkpoint_dirs` (and ``<default_root_dir>/checkpoints``);
    without one, the run's newest checkpoint there (a ``ModelCheckpoint`` without ``save_last`` writes no
    ``last.ckpt``), named in one line; with no checkpoint at all, a ``fit`` starts from step 0 (said once) and
    the other subcommands stop with an error. ``hpc``: the highest
    ``hpc_ckpt_N.ckpt`` in ``default_root_dir``. ``registry``: refused (download the checkpoint and
    pass its path), so that it too is checked before anything is built.

    Example::

        resolve_ckpt_path("last", "fit", config.fit.trainer)  # "/abs/runs/quickstart/checkpoints/last.ckpt"

    Args:
        ckpt_path: The ``--ckpt_path`` value.
        subcommand: ``fit``, ``validate``, ``predict``, ...
        trainer_config: The parsed ``trainer`` group.

    Raises:
        ValueError: No file for ``hpc`` (or no checkpoint for ``last`` outside ``fit``), or a registry checkpoint.
    """
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
        others = f"; the others: {', '.join(p.name for p in found[1:4])}{' ...' if len(found) > 4 else ''}" if found[1:] else ""
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


def existing_run_problem(ckpt_path: Any, trainer_config: Any, command: str = "gpuopt fit ...") -> Optional[str]:
    """The error for a ``fit`` without ``--ckpt_path`` whose checkpoint folders already hold a checkpoint, else ``None``.

    Example::

        existing_run_problem(None, config.fit.trainer)  # "runs/quickstart/checkpoints/last.ckpt holds a run ..."

    Args:
        ckpt_path: The ``--ckpt_path`` value (any value: no problem).
        trainer_config: The parsed ``trainer`` group (``fast_dev_run`` writes no checkpoint: no problem).
        command: How to show the user's command in the advice.
    """
    if ckpt_path or _get(trainer_config, "fast_dev_run", False):
        return None
    dirs = checkpoint_dirs(trainer_config)
    found = last_checkpoints(dirs) or run_checkpoints(dirs)
    if not found:
        return None
    return (
        f"{found[0]} holds a run this fit would overwrite (it starts again from step 0). To continue it: "
        f"`{command} --ckpt_path last`; to start a new run: `{command} --trainer.default_root_dir NEW_FOLDER` "
        f"(or move {found[0].parent} away first)."
    )


def holds_run_folder(env: Mapping[str, str]) -> bool:
    """Whether this process is the one to hold the run folder: every rank variable in ``env`` is 0 or unset.

    Lightning's DDP launcher starts ranks 1..N-1 as new processes running the same command, with
    ``LOCAL_RANK`` set; ``torchrun`` and Slurm set ``RANK`` / ``SLURM_PROCID`` for every rank. Only the one process
    that is rank 0 in all of them holds the lock, so the run has one holder however it was launched.

    Example::

        holds_run_folder({"LOCAL_RANK": "1"})  # False: a rank Lightning's launcher started

    Args:
        env: The process's environment (``os.environ``).
    """
    return all(env.get(name, "0").strip() in ("", "0") for name in _RANK_VARIABLES)


def _lock(folder: Path) -> Optional[IO[str]]:
    import fcntl

    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / LOCK_FILE, "a+")  # created if missing, never truncated before the lock is ours
    except OSError:  # a file, or a folder this process cannot write: the checks of the options name it, next
        return None
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ValueError(
            f"{folder} is in use by another gpuopt fit ({holder}): two runs in one folder write over each other's "
            "checkpoints. Wait for it to end (or stop it), or give this run another --trainer.default_root_dir."
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    return handle


def hold_run_folder(trainer_config: Any, env: Mapping[str, str] = os.environ) -> None:
    """Hold the run folder of a ``fit`` (``default_root_dir``, the working folder when unset) until
    :func:`release_run_folder`, or the end of the process; a folder another ``fit`` holds stops this one.

    Example::

        hold_run_folder(config.fit.trainer)   # ValueError: runs/x is in use by another gpuopt fit (pid 4242 ...)

    Args:
        trainer_config: The parsed ``trainer`` group.
        env: The process's environment: a rank a launch started holds nothing (:func:`holds_run_folder`).

    Raises:
        ValueError: The folder is held by another process, named with its pid, host and start time.
    """
    if not holds_run_folder(env):
        return
    try:
        import fcntl  # noqa: F401
    except ImportError:  # not on POSIX: said once
        rank_zero_info("gpuopt fit: no file locks on this platform, so a second fit on the same folder is not refused.")
        return
    handle = _lock(Path(os.path.realpath(_get(trainer_config, "default_root_dir", os.getcwd()))))
    if handle is not None:
        _held.append(handle)


def release_run_folder() -> None:
    """Let go of the folder :func:`hold_run_folder` holds (at the end of a ``fit``; the process's end does it too)."""
    while _held:
        _held.pop().close()
