"""Recognise out-of-memory errors the way they really look, and give the memory back afterwards."""

from __future__ import annotations

import gc
from typing import Optional

import torch

__all__ = ["free_memory", "is_oom_error"]

# Fragments of the messages that CUDA, the caching allocator and cuDNN raise when memory runs out.
# cuDNN reports NOT_SUPPORTED when it cannot get the workspace an algorithm needs under memory
# pressure (the same heuristic as Composer's and accelerate's OOM detectors).
_OOM_MESSAGES = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_SUPPORTED",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",
    "out of memory",
)


def is_oom_error(error: BaseException) -> bool:
    """Whether ``error`` means the device ran out of memory: ``torch.OutOfMemoryError``, or a ``RuntimeError``
    with an out-of-memory message of CUDA, cuBLAS, cuDNN or the CPU allocator."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if isinstance(error, RuntimeError) and error.args:
        message = str(error.args[0])
        return any(fragment in message for fragment in _OOM_MESSAGES)
    return False


def free_memory(device: Optional[torch.device] = None) -> None:
    """Collect garbage and return cached blocks to the GPU, so the next try starts clean (CUDA only: a full
    collection in a process holding torch takes seconds). Call it once the exception and its traceback are gone.

    Args:
        device: The CUDA device whose peak-memory counters are reset too; ``None`` only frees.
    """
    if torch.cuda.is_initialized():  # this process's own GPU memory: without CUDA in use there is no cache to return
        gc.collect()
        torch.cuda.empty_cache()
        if device is not None and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
