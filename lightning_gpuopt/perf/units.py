"""Byte units, named once: ``GiB`` (2**30, CUDA memory, ``nvidia-smi``) and ``GB`` (10**9, disks and datasheets).

Every message that prints a size says which of the two it divides by.
"""

from __future__ import annotations

__all__ = ["GB", "GiB", "MiB"]

GiB = 2**30  # CUDA memory (torch.cuda.memory_*, nvidia-smi), printed as "GiB"
MiB = 2**20
GB = 10**9  # disk space and the device memory of datasheets, printed as "GB"
