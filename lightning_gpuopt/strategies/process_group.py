"""Ending a distributed run: destroy the process group before the interpreter shuts down.

Lightning does so at exit for NCCL only; gloo's left to interpreter shutdown aborts now and then
(``docs/parallel.md``, with the measurement).
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["end_distributed"]


def end_distributed() -> None:
    """Destroy the default process group (and its subgroups) if one was started; else do nothing.

    Call it once at the end of a script whose ``Trainer`` ran several processes, after the last
    collective (``trainer.fit(...); end_distributed()``); not after an error, where a failed rank would
    leave the others waiting here.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
