"""What a checkpoint writer checks around a save: finite weights, a full disk, and its own leftover temporary files.

A diverged run would otherwise write NaN weights over every good checkpoint; a killed save leaves a
temporary file; a full disk surfaces from ``torch.save`` with the ``OSError`` buried in its chain.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_gpuopt.model.checkpoint import nonfinite_weights  # one scan for every reader and writer
from lightning_gpuopt.option_checks import option
from lightning_gpuopt.perf.units import GB

__all__ = [
    "NonFiniteCheckpointError",
    "check_finite_weights",
    "nonfinite_optimizer_state",
    "checkpoint_nbytes",
    "disk_full_error",
    "is_disk_full",
    "nonfinite_weights",
    "remove_orphaned_temps",
    "temp_path",
]

_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
_TEMP = re.compile(r"^\..+\.tmp-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{8}$")
STALE_AFTER_S = 3600.0  # a temp file of another machine untouched this long is from a dead save


class NonFiniteCheckpointError(RuntimeError):
    """A checkpoint whose weights hold NaN/Inf was not written (the run has diverged)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP2 DTensor: this rank's shard


def _flat_tensors(obj: Any, prefix: str, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _flat_tensors(value, f"{prefix}.{key}", out)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _flat_tensors(value, f"{prefix}.{i}", out)
    return out


def nonfinite_optimizer_state(checkpoint: Any) -> tuple[list[str], int]:
    """Names of the optimizer-state tensors of a Lightning checkpoint that hold NaN/Inf, and how many there are.
    AdamW's ``exp_avg_sq`` can overflow while the weights are finite, and a resume then updates with NaN."""
    states = checkpoint.get("optimizer_states") if isinstance(checkpoint, dict) else None
    tensors = _flat_tensors(states or [], "optimizer_states", {})
    return nonfinite_weights(tensors), len(tensors)


def check_finite_weights(checkpoint: dict[str, Any], path: Any) -> None:
    """Raise :class:`NonFiniteCheckpointError` before writing ``checkpoint`` to ``path`` if its weights
    (``state_dict``) or ``optimizer_states`` hold NaN/Inf."""
    state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    guarded = isinstance(checkpoint, dict) and "NonFiniteGuard" in (checkpoint.get("callbacks") or {})
    bad = nonfinite_weights(state)
    if bad:
        raise NonFiniteCheckpointError(
            non_finite_message(path, len(bad), len(state), bad[0], Path(str(path)).exists(), guarded=guarded)
        )
    bad, total = nonfinite_optimizer_state(checkpoint)
    if bad:
        raise NonFiniteCheckpointError(
            non_finite_message(
                path, len(bad), total, bad[0], Path(str(path)).exists(), "optimizer-state tensors", guarded
            )
        )


def non_finite_message(
    path: Any, n_bad: int, n_total: int, first: str, kept: bool, what: str = "weight tensors", guarded: bool = False
) -> str:
    """The message of a refused non-finite save (shared with the distributed writer). The checkpoints kept
    are finite, not necessarily good (weights written while the loss rose give the same bad gradients), so
    it does not call them good, and names ``NonFiniteGuard`` when the run has none."""
    path = Path(str(path))
    guard = ("NonFiniteGuard did not stop it (it checks the loss and gradients of each step, not the weights after "
             "the update): " if guarded else
             "Add lightning_gpuopt.callbacks.NonFiniteGuard to the callbacks: it stops at the first bad step and says "
             "whether the last checkpoint is worth resuming. Until then: ")
    return (
        f"Not writing the checkpoint {str(path)!r}: {n_bad} of {n_total} {what} hold NaN/Inf (first: "
        f"{first!r}), the run has diverged. "
        + (f"The previous {path.name} is kept" if kept else f"The checkpoints already in {path.parent} are kept")
        + ", finite, but not necessarily good: weights written while the loss was rising give the same bad "
        "gradients at any learning rate. " + guard + "resume a checkpoint written while the loss was still falling, "
        "with a lower learning rate or gradient clipping, or start a new run with a lower learning rate."
    )


def temp_path(path: Path) -> Path:
    """The temporary file a save of ``path`` writes first: ``.<name>.tmp-<host>-<pid>-<random>`` beside it."""
    return path.with_name(f".{path.name}.tmp-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_orphaned_temps(folder: Path, now: Optional[float] = None) -> list[Path]:
    """Delete the temporary files of killed saves into ``folder`` (named by :func:`temp_path`: this machine's
    whose process is gone, another machine's untouched for an hour); return what was removed."""
    removed = []
    now = time.time() if now is None else now
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return removed
    for entry in entries:
        match = _TEMP.match(entry.name)
        if not match or not entry.is_file(follow_symlinks=False):
            continue
        pid = int(match["pid"])
        if match["host"] == _HOST and os.name == "posix":  # os.kill(pid, 0) would end the process on Windows
            dead = pid != os.getpid() and not _pid_alive(pid)
        else:
            try:
                dead = now - entry.stat(follow_symlinks=False).st_mtime > STALE_AFTER_S
            except FileNotFoundError:
                continue
        if dead:
            try:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
            except FileNotFoundError:
                pass
    return removed


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err``, or an error in its chain, is "no space left on device" (or a disk quota)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(err) or "Disk quota exceeded" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def checkpoint_nbytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (nested dicts, lists, tuples): about the size of its ``torch.save`` file."""
    if isinstance(obj, torch.Tensor):
        return _local(obj).numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(checkpoint_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(checkpoint_nbytes(v) for v in obj)
    return 0


def disk_full_error(path: Path, needed_bytes: int) -> OSError:
    """The error for a save of ``path`` that ran out of space: where, how much it needs, what is free, the fix."""
    try:
        free = f", {shutil.disk_usage(path.parent).free / GB:.2f} GB free"
    except OSError:
        free = ""
    return OSError(
        errno.ENOSPC,
        f"No space left on device at {path.parent} (needs ~{needed_bytes / GB:.2f} GB for {path.name}{free}). "
        + (f"The previous {path.name} is kept. " if path.exists() else "")
        + f"Free space there, or point {option('ModelCheckpoint', 'dirpath')} or "
          f"{option('Trainer', 'default_root_dir')} "
        "at a larger disk.",
    )
