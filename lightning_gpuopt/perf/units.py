"""Byte units, named once: ``GiB`` (2**30, what CUDA memory is counted in) and ``GB`` (10**9, disks and datasheets).

Every message that prints a size says which of the two it divides by, so a figure can be checked
against ``nvidia-smi`` (MiB/GiB) or a datasheet (GB) without guessing.

Example::

    >>> from lightning_gpuopt.perf.units import GB, GiB
    >>> f"{80 * GB / GiB:.1f} GiB"
    '74.5 GiB'
"""

from __future__ import annotations

__all__ = ["GB", "GiB", "MiB"]

GiB = 2**30
"""Bytes in a gibibyte: CUDA memory (``torch.cuda.memory_*``, ``nvidia-smi``), printed as "GiB"."""

MiB = 2**20
"""Bytes in a mebibyte."""

GB = 10**9
"""Bytes in a gigabyte: disk space and the device memory of datasheets, printed as "GB"."""
