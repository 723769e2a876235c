"""A run's folder: which file ``--ckpt_path last`` / ``hpc`` names, and a ``fit`` that would overwrite a run.

Design note: Lightning turns ``last`` and ``hpc`` into a file only inside ``trainer.fit``, after the
model and the data are built, so the checks of :mod:`lightning_gpuopt.cli.resume_checks` (run
before anything is built) saw the word, not the file, and let an architecture change, a foreign
checkpoint or another vocabulary through to a traceback. :func:`resolve_ckpt_path` finds the file
from the parsed configuration the same way Lightning does (the newest ``last*.ckpt`` in the
checkpoint folders, the highest ``hpc_ckpt_N.ckpt`` in ``default_root_dir``), and the CLI puts that
path in the configuration, so every ``--ckpt_path`` goes through the same checks and the Trainer
loads the file that was checked.

A ``fit`` without ``--ckpt_path`` into a folder that holds a ``last.ckpt`` would replace it with
step 1 of a new run. :func:`existing_run_problem` stops such a run (exit 2) with the two commands to
choose from, rather than continuing it: a re-run of a command is as often a new experiment with
changed options (which a resume refuses or applies), and only the user knows which was meant.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

__all__ = ["checkpoint_dirs", "existing_run_problem", "last_checkpoints", "resolve_ckpt_path"]

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
    (:func:`~lightning_gpuopt.cli.defaults.fill_checkpoint_dirs`); ``enable_checkpointing: false`` writes none.

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
    for callback in callbacks:
        if not _is_model_checkpoint(callback):
            continue
        dirpath = getattr(callback, "dirpath", None) if isinstance(callback, ModelCheckpoint) else None
        dirpath = dirpath or _get(_get(callback, "init_args"), "dirpath")
        folder = Path(os.path.realpath(dirpath or root / "checkpoints"))
        if folder not in dirs:
            dirs.append(folder)
    return dirs


def last_checkpoints(dirs: list[Path]) -> list[Path]:
    """The ``last*.ckpt`` files in ``dirs``, newest first (the order Lightning's ``ckpt_path="last"`` picks in)."""
    found = []
    for folder in dirs:
        if folder.is_dir():
            found += [p for p in folder.iterdir() if p.suffix == ".ckpt" and _LAST.match(p.stem) and p.exists()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def resolve_ckpt_path(ckpt_path: Any, subcommand: str, trainer_config: Any) -> Any:
    """The checkpoint file a special ``--ckpt_path`` names, found as Lightning would; other values unchanged.

    ``last``: the newest ``last*.ckpt`` in :func:`checkpoint_dirs`; none there starts a ``fit`` from
    step 0 (said once) and is an error for the other subcommands. ``hpc``: the highest
    ``hpc_ckpt_N.ckpt`` in ``default_root_dir``. ``registry``: refused (download the checkpoint and
    pass its path), so that it too is checked before anything is built.

    Example::

        resolve_ckpt_path("last", "fit", config.fit.trainer)  # "/abs/runs/quickstart/checkpoints/last.ckpt"

    Args:
        ckpt_path: The ``--ckpt_path`` value.
        subcommand: ``fit``, ``validate``, ``predict``, ...
        trainer_config: The parsed ``trainer`` group.

    Raises:
        ValueError: No file for ``hpc`` (or for ``last`` outside ``fit``), or a registry checkpoint.
    """
    if not isinstance(ckpt_path, str):
        return ckpt_path
    if ckpt_path == "last":
        dirs = checkpoint_dirs(trainer_config)
        found = last_checkpoints(dirs)
        if found:
            rank_zero_info(f"{subcommand} --ckpt_path last: {found[0]}")
            return str(found[0])
        where = ", ".join(map(str, dirs)) or "(no ModelCheckpoint callback in trainer.callbacks)"
        if subcommand != "fit":
            raise ValueError(
                f"--ckpt_path last: no last.ckpt in {where}. Pass the checkpoint's path, or the "
                "trainer.default_root_dir of the run that wrote it."
            )
        rank_zero_info(f"fit --ckpt_path last: no last.ckpt in {where} yet, so this run starts from step 0.")
        return None
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


def existing_run_problem(ckpt_path: Any, trainer_config: Any, command: str = "gpuopt fit ...") -> Optional[str]:
    """The error for a ``fit`` without ``--ckpt_path`` whose checkpoint folder already holds a ``last.ckpt``, else ``None``.

    Example::

        existing_run_problem(None, config.fit.trainer)  # "runs/quickstart/checkpoints/last.ckpt holds a run ..."

    Args:
        ckpt_path: The ``--ckpt_path`` value (any value: no problem).
        trainer_config: The parsed ``trainer`` group (``fast_dev_run`` writes no checkpoint: no problem).
        command: How to show the user's command in the advice.
    """
    if ckpt_path or _get(trainer_config, "fast_dev_run", False):
        return None
    found = last_checkpoints(checkpoint_dirs(trainer_config))
    if not found:
        return None
    return (
        f"{found[0]} holds a run this fit would overwrite (it starts again from step 0). To continue it: "
        f"`{command} --ckpt_path last`; to start a new run: `{command} --trainer.default_root_dir NEW_FOLDER` "
        f"(or move {found[0].parent} away first)."
    )
