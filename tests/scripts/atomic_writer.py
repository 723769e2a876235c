"""Saves checkpoints of ~16 MB to one path in a loop until killed (tests/checkpoint/test_io.py SIGKILLs it).

Each checkpoint's tensor is filled with its step number, so a reader can tell a complete file from a mix.
Usage: python atomic_writer.py PATH
"""

import sys

import torch

from lightning_gpuopt.checkpoint import AtomicCheckpointIO

io = AtomicCheckpointIO()
step = 0
weights = torch.empty(4_000_000)
while True:
    step += 1
    weights.fill_(step)
    io.save_checkpoint({"global_step": step, "state_dict": {"w": weights}}, sys.argv[1])
    print(step, flush=True)
