"""The run layer, below the ``gpuopt`` command: one writer per run folder and per output file, the resume checks
and the callbacks merge, for a plain ``lightning.Trainer`` as for the command (``docs/reliability.md``)."""

from lightning_gpuopt.run.lock import HeldLock, PathInUse, hold_output
from lightning_gpuopt.run.prepare import Run, prepare_run
from lightning_gpuopt.run.resume_checks import OwnCheckpoint

__all__ = ["HeldLock", "OwnCheckpoint", "PathInUse", "Run", "hold_output", "prepare_run"]
