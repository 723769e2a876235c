"""Starts an AtomicCheckpointIO save that stalls half-way, until killed (tests/checkpoint/test_safety.py SIGKILLs it).

The checkpoint holds an object whose pickling sleeps, so the save's temporary file exists, unfinished,
when the process is killed: what a kill in the middle of a large save leaves.
Usage: python stalled_writer.py PATH
"""

import sys
import time

import torch

from lightning_gpuopt.checkpoint import AtomicCheckpointIO


class _Stall:
    def __reduce__(self):
        print("stalled", flush=True)
        time.sleep(600)
        return (int, ())


AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(100_000)}, "stall": _Stall()}, sys.argv[1])
