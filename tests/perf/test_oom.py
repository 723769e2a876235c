"""Which errors are out-of-memory errors: CUDA's, cuDNN's and cuBLAS's allocation failures, the CPU allocator's."""

from __future__ import annotations

import pytest
import torch

from lightning_gpuopt.perf.oom import is_oom_error


@pytest.mark.parametrize(
    "error, expected",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"), True),
        (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."), True),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes."), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x16 and 32x16)"), False),
        (ValueError("out of memory"), False),  # only runtime errors carry allocator messages
    ],
)
def test_is_oom_error(error, expected):
    assert is_oom_error(error) is expected
