"""Scaled-dot-product attention backends: which kernel SDPA runs for a shape, and the cuDNN-first order.

The decisions are plain functions of a :class:`~lightning_gpuopt.perf.device.DeviceFacts`, tested for any
GPU on any machine; ``CUDASettings`` applies them to torch's global SDPA state.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from lightning_gpuopt.internals import fused_sdp_choice, sdp_priority_order, set_sdp_priority_order
from lightning_gpuopt.perf.device import DeviceFacts

__all__ = [
    "CUDNN_FIRST_ORDER",
    "SDPA_BACKENDS",
    "SDPA_FLAGS",
    "attention_kernel",
    "attention_row",
    "auto_sdpa_order",
    "flash_skipped",
    "set_sdpa_priority",
]

# Our backend names -> torch.nn.attention.SDPBackend members, and -> torch.backends.cuda.enable_<name>_sdp().
SDPA_BACKENDS = {
    "cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"
}
SDPA_FLAGS = {"cudnn": "cudnn", "flash": "flash", "efficient": "mem_efficient", "math": "math"}

# cuDNN attention first on Hopper and Blackwell (compute capability 9.x, 10.x) with a recent cuDNN; the
# rest in PyTorch's own order, nothing disabled.
CUDNN_FIRST_ORDER = ("cudnn", "flash", "efficient", "math")
_MIN_CUDNN_FIRST = 91500  # cuDNN 9.15


def auto_sdpa_order(facts: DeviceFacts) -> tuple[Optional[tuple[str, ...]], str]:
    """What ``CUDASettings(sdpa_backends="auto")`` does on a device: ``(order, why)``; order ``None`` leaves PyTorch's.

    cuDNN attention goes first on compute capability 9.x/10.x with cuDNN >= 9.15 (its forward is ~25%
    faster than FlashAttention-2 at head dim 64, FA3 paper).

    Example::

        auto_sdpa_order(REFERENCE_DEVICES["A100"])  # (None, "left as PyTorch orders them (compute capability 8.0)")
    """
    if not facts.is_cuda:
        return None, "left as PyTorch orders them: no CUDA device"
    major, minor = facts.capability or (0, 0)
    if major not in (9, 10):
        return None, f"left as PyTorch orders them (compute capability {major}.{minor})"
    cudnn = facts.cudnn_version or 0
    if cudnn < _MIN_CUDNN_FIRST:
        # Older cuDNN attention gave wrong gradients for some sequence lengths (not multiples of 128).
        return None, f"left as PyTorch orders them (cuDNN {cudnn} < {_MIN_CUDNN_FIRST})"
    return CUDNN_FIRST_ORDER, f"priority {','.join(CUDNN_FIRST_ORDER)} (compute capability {major}.{minor})"


def flash_skipped(facts: DeviceFacts, backends: Sequence[str]) -> bool:
    """Whether ``flash`` is among ``backends`` but the CUDA device cannot run it (compute capability < 8.0)."""
    return "flash" in backends and facts.is_cuda and not facts.flash_attention


def set_sdpa_priority(order: Sequence[str]) -> None:
    """Put ``order`` (our backend names) first in PyTorch's SDPA priority; which kernels are enabled is unchanged."""
    from torch.nn.attention import SDPBackend

    first = [int(getattr(SDPBackend, SDPA_BACKENDS[b])) for b in order]
    rest = [b for b in sdp_priority_order() if b not in first]
    set_sdp_priority_order(first + rest)


def attention_kernel(
    device: torch.device, head_dim: int, seq_len: int, dtype: torch.dtype, n_head: int = 1, dropout_p: float = 0.0
) -> str:
    """The SDPA kernel PyTorch picks for causal self-attention of this shape, under the current backend
    flags and priorities: ``"cudnn"``, ``"flash"``, ``"efficient"`` or ``"math"`` (``dropout_p``: some kernels
    accept only some values)."""
    from torch.nn.attention import SDPBackend

    q = torch.zeros(1, n_head, seq_len, head_dim, device=device, dtype=dtype, requires_grad=True)  # as in training
    choice = SDPBackend(fused_sdp_choice(q, q, q, dropout_p=dropout_p, is_causal=True))
    names = {getattr(SDPBackend, v): k for k, v in SDPA_BACKENDS.items()}
    return names.get(choice, choice.name.lower())


def attention_row(module: Any, compute_dtype: Optional[str], device: torch.device) -> tuple[str, str, str]:
    """The settings-table row naming the kernel SDPA runs for ``module``'s attention shape.

    The shape comes from ``module.config`` (``head_size``, ``block_size``, ``n_head``, ``dropout``), else an
    assumed head dim 64 at T 1024; under float8 attention runs in bf16 (only the projections are float8).
    """
    config = getattr(module, "config", None)
    head_dim, seq_len, n_head = (getattr(config, k, None) for k in ("head_size", "block_size", "n_head"))
    dropout = float(getattr(config, "dropout", 0.0) or 0.0)
    shape = "the model's" if head_dim and seq_len else "an assumed"
    head_dim, seq_len, n_head = head_dim or 64, seq_len or 1024, n_head or 1
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}.get(compute_dtype, torch.float32)
    kernel = attention_kernel(device, head_dim, seq_len, dtype, n_head, dropout)
    dtype_name = str(dtype).removeprefix("torch.")
    return (
        "attention_kernel", kernel, f"what SDPA runs for {shape} head dim {head_dim}, T {seq_len}, {dtype_name}, causal"
    )
