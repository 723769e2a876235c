"""Saves a checkpoint that fits, then one that does not, on a 4 MB tmpfs (run under ``unshare -rm``).

Prints the error of the second save and the step the checkpoint file still holds.
Usage: unshare -rm python disk_full_save.py MOUNT_POINT
"""

import subprocess
import sys
from pathlib import Path

import torch

from lightning_gpuopt.model.checkpoint import read_checkpoint
from lightning_gpuopt.checkpoint import AtomicCheckpointIO

mount = Path(sys.argv[1])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=True)
path = mount / "last.ckpt"
io = AtomicCheckpointIO()
io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(250_000)}}, path)  # 1 MB
try:
    io.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.ones(1_000_000)}}, path)  # 4 MB: does not fit
except OSError as err:
    print(f"ERROR {type(err).__name__} errno={err.errno}: {err}")
print("STEP", read_checkpoint(path)["global_step"])
print("FILES", sorted(p.name for p in mount.iterdir()))
