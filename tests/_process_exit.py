"""How the multi-process test scripts end: destroy the process group, then leave without interpreter teardown.

``end_distributed()`` removes the cause we could measure (Lightning leaves gloo groups to interpreter
shutdown, where torch aborts now and then with "terminate called without an active exception").
The full test suite still showed the abort, rarely, in the 2-process FSDP2 run after all its work
was done and written; a script that has finished has nothing left for the interpreter's teardown
to do, so it exits at once (``os._exit``) with its output flushed, and the test judges what it wrote.
"""

from __future__ import annotations

import os
import sys

from lightning_gpuopt.strategies import end_distributed

__all__ = ["finish"]


def finish() -> None:
    """End a finished multi-process test script: process group destroyed, output flushed, exit 0."""
    end_distributed()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
