"""One writer per file or folder: an exclusive ``flock`` on a lock file that names its holder.

A second process sees the lock and is refused, naming the holder's pid. The kernel drops the lock when its holder
ends, however it ends (``kill -9``, an out-of-memory kill), so a lock is never stale: a lock file left behind is
taken over by the next writer, and it tells a file the dead run left (its ``.partial``) from one a live run writes.
The behaviour: ``docs/reliability.md`` ("One writer per run folder", "One writer per output file")."""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Optional, Union

__all__ = ["HeldLock", "PathInUse", "hold_output", "holds_locks", "keep_held", "output_lock_path", "release_held",
           "take_lock"]

# Environment variables that give a process's rank (torchrun, Lightning's launcher, Slurm, LSF, MPI): a process
# with any of them above 0 is one a launch started, not the one that holds the run's files.
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK",
                   "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_held: list[Any] = []  # what this process holds until release_held() (the gpuopt command's run): close() frees each


class PathInUse(ValueError):
    """A lock another process (or another open of it in this one) holds; ``holder``: what its lock file says."""

    def __init__(self, path: Path, holder: str, message: str = "") -> None:
        super().__init__(message or f"{path} is held by {holder or 'another process'}")
        self.path, self.holder = path, holder or "another process"
        found = re.search(r"pid (\d+)", holder)
        self.pid: Optional[int] = int(found[1]) if found else None
        on = re.search(r"pid \d+ on ([^\s,]+),", holder)  # as _holder_note writes it
        self.host: Optional[str] = on[1] if on else None

    @property
    def ours(self) -> bool:
        """Whether this very process holds it (another open of the lock, still held): no process to wait for. The
        host is compared whole: containers on other nodes sharing the folder reuse small pids."""
        return self.pid == os.getpid() and self.host == socket.gethostname()


def holds_locks(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process takes the run's locks: every rank variable in ``env`` is 0 or unset, so a run has one
    holder however it was launched (Lightning's DDP launcher, ``torchrun``, Slurm)."""
    return all(env.get(name, "0").strip() in ("", "0") for name in _RANK_VARIABLES)


class HeldLock:
    """An open lock file whose ``flock`` this process holds; a context manager that lets go at its end.

    Attributes:
        path: The lock file.
        previous: What the lock file said before this process took it (a writer that ended without letting go,
            ``kill -9``), ``""`` when it was new or empty.
    """

    def __init__(self, handle: IO[str], path: Path, created: list[Path], previous: str, remove: bool) -> None:
        self.handle, self.path, self.previous = handle, path, previous
        # created: the lock file (if taking it made it), then the folders it made, innermost first
        self._created, self._remove = created, remove

    def close(self, tidy: bool = False) -> None:
        """Let go. The lock file is removed if it is one of an output (``remove``), or with ``tidy`` if taking it
        created it (then the folders it created go too, when empty: a run refused before it wrote anything)."""
        if self.handle.closed:
            return
        if self in _held:
            _held.remove(self)
        if self._remove or (tidy and self.path in self._created):
            self.path.unlink(missing_ok=True)  # still held: a writer that opened it meanwhile retries (take_lock)
        self.handle.close()
        if tidy:
            for folder in [p for p in self._created if p != self.path]:
                try:
                    folder.rmdir()
                except OSError:
                    return

    def __enter__(self) -> "HeldLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(tidy=exc[0] is not None)


def _holder_note(command: str = "") -> str:
    note = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
    return f"{command} ({note})" if command else note


def take_lock(path: Union[str, Path], command: str = "", remove: bool = False) -> Optional[HeldLock]:
    """Take the ``flock`` of the lock file ``path`` (created, with its folders, if missing) and write the holder into
    it (``command``, this pid, host and time); raise :class:`PathInUse` if another open of it holds it. ``None``: the
    folder cannot be written (the caller's checks name it). ``remove``: the file goes when the lock is let go."""
    import fcntl

    path = Path(path)
    try:
        created = [p for p in (path.parent, *path.parent.parents) if not p.exists()]  # innermost first
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    while True:
        try:
            existed = path.exists()
            handle = open(path, "a+")  # created if missing, never truncated before the lock is ours
        except OSError:
            return None
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            raise PathInUse(path, holder) from None
        if _same_file(handle, path):
            break
        handle.close()  # its holder removed it as this process opened it: take the one there now
    handle.seek(0)
    previous = handle.read().strip()
    handle.seek(0)
    handle.truncate()
    handle.write(_holder_note(command) + "\n")
    handle.flush()
    return HeldLock(handle, path, ([] if existed else [path]) + created, previous, remove)


def _same_file(handle: IO[str], path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def output_lock_path(output: Union[str, Path]) -> Path:
    """The lock file of an output file: ``.<name>.lock`` beside it."""
    output = Path(output).expanduser()
    return output.with_name(f".{output.name}.lock")


def hold_output(
    output: Union[str, Path], command: str = "gpuopt", option: str = "", env: Mapping[str, str] = os.environ,
    lost: str = "", overwrite: bool = False,
) -> Optional[HeldLock]:
    """Hold ``output``, a file this process is about to write, until the returned lock is let go (``with``, or
    ``close()``) or :func:`release_held`, or the process ends; refuse one another live process holds, naming its
    pid. ``None``: not taken (a rank other than 0; no file locks on this platform; a folder that cannot be written).

    Example::

        with hold_output("model.safetensors", "gpuopt export", "--output"):
            save_file(tensors, "model.safetensors")

    Args:
        command: What writes it, written into the lock file and named to a second writer.
        option: The option that names the file (in the refusal's fix), ``""``: "another file".
        lost: What two writers would lose of each other's (``"lines"``: a file written as it goes); ``""``: they
            would write over each other.
        overwrite: The command has an option to replace its output: the refusal says it does not apply here.
    """
    if not holds_locks(env):
        return None
    try:
        import fcntl  # noqa: F401
    except ImportError:  # not on POSIX
        return None
    output = Path(output).expanduser()
    try:
        lock = take_lock(output_lock_path(output), command, remove=True)
    except PathInUse as used:
        where = f"give this run another {option}" if option else "write another file"
        kill = f" (kill {used.pid})" if used.pid is not None else ""
        clash = f"lose each other's {lost}" if lost else "write over each other"
        after = "; overwriting never replaces a file a live run writes." if overwrite else "."
        raise PathInUse(output, used.holder,
            f"{output} is being written by another {used.holder}: two writers would {clash}. "
            f"Wait for it to end or stop it{kill}, or {where}{after}"
        ) from None
    keep_held(lock)
    return lock


def keep_held(*locks: Any) -> None:
    """Keep ``locks`` (each with ``close(tidy)``; ``None`` left out) until :func:`release_held`."""
    _held.extend(lock for lock in locks if lock is not None)


def release_held(tidy: bool = False) -> None:
    """Let go of every lock this process holds for its run (at the end of a ``gpuopt`` command; the process's end
    does it too); ``tidy``: a run that failed also removes the lock files and the folders taking them created."""
    while _held:
        _held.pop().close(tidy)
