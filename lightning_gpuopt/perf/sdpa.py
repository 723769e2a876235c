"""Scaled-dot-product attention backends: which kernel SDPA runs for a shape, and the cuDNN-first order.

``CUDASettings`` applies these; they are plain functions on torch's global SDPA state, so they can be
used and tested without a Trainer.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


__all__ = ["SDPA_BACKENDS", "SDPA_FLAGS", "apply_auto_sdpa_order", "attention_kernel", "attention_row"]

SDPA_BACKENDS = {
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}
"""Our backend names -> ``torch.nn.attention.SDPBackend`` member names."""
SDPA_FLAGS = {"cudnn": "cudnn", "flash": "flash", "efficient": "mem_efficient", "math": "math"}
"""Our backend names -> the suffix of ``torch._C._get_/_set_sdp_use_*`` (what ``sdpa_kernel`` calls)."""

# cuDNN attention first on Hopper and Blackwell (compute capability 9.x, 10.x) with a recent cuDNN; the
# rest in PyTorch's own order, nothing disabled.
_HOPPER_SDPA_ORDER = ("cudnn", "flash", "efficient", "math")
_MIN_CUDNN_FIRST = 91500  # cuDNN 9.15


def apply_auto_sdpa_order(device: torch.device) -> tuple[str, str, str]:
    """Apply ``CUDASettings(sdpa_backends="auto")`` on the training device; return the settings-table row.

    cuDNN attention goes first on compute capability 9.x/10.x with cuDNN >= 9.15; elsewhere the
    order is left as PyTorch has it. Only priorities change: which kernels are enabled does not.

    Example::

        apply_auto_sdpa_order(torch.device("cpu"))  # ("sdpa_backends", "auto", "left as ...: no CUDA device")

    Args:
        device: The training device.
    """
    if device.type != "cuda":
        return ("sdpa_backends", "auto", "left as PyTorch orders them: no CUDA device")
    capability = torch.cuda.get_device_capability(device)
    cudnn = torch.backends.cudnn.version() or 0
    if capability[0] not in (9, 10):
        return ("sdpa_backends", "auto", f"left as PyTorch orders them (compute capability {capability[0]}.{capability[1]})")
    if cudnn < _MIN_CUDNN_FIRST:
        # Older cuDNN attention gave wrong gradients for some sequence lengths (not multiples of 128).
        return ("sdpa_backends", "auto", f"left as PyTorch orders them (cuDNN {cudnn} < {_MIN_CUDNN_FIRST})")
    from torch.nn.attention import SDPBackend

    order = [int(getattr(SDPBackend, SDPA_BACKENDS[b])) for b in _HOPPER_SDPA_ORDER]
    rest = [b for b in torch._C._get_sdp_priority_order() if b not in order]
    torch._C._set_sdp_priority_order(order + rest)  # priorities only: which kernels are enabled is unchanged
    return ("sdpa_backends", "auto", f"priority {','.join(_HOPPER_SDPA_ORDER)} (compute capability {capability[0]}.{capability[1]})")


def attention_kernel(
    device: torch.device, head_dim: int, seq_len: int, dtype: torch.dtype, n_head: int = 1, dropout_p: float = 0.0
) -> str:
    """The SDPA kernel PyTorch picks for causal self-attention of this shape, under the current
    backend flags and priorities: ``"cudnn"``, ``"flash"``, ``"efficient"`` or ``"math"``.

    Example::

        >>> attention_kernel(torch.device("cpu"), head_dim=64, seq_len=128, dtype=torch.float32) in SDPA_BACKENDS
        True

    Args:
        device: Where attention runs.
        head_dim: Size of one head.
        seq_len: Sequence length.
        dtype: The dtype attention runs in (bf16 under bf16 autocast).
        n_head: Number of heads.
        dropout_p: Attention dropout in training (some kernels accept only some values).
    """
    from torch.nn.attention import SDPBackend

    q = torch.zeros(1, n_head, seq_len, head_dim, device=device, dtype=dtype, requires_grad=True)  # as in training
    choice = SDPBackend(torch._fused_sdp_choice(q, q, q, dropout_p=dropout_p, is_causal=True))
    names = {getattr(SDPBackend, v): k for k, v in SDPA_BACKENDS.items()}
    return names.get(choice, choice.name.lower())


def attention_row(module: Any, compute_dtype: Optional[str], device: torch.device) -> tuple[str, str, str]:
    """The settings-table row naming the kernel SDPA runs for ``module``'s attention shape.

    The shape comes from ``module.config`` (``head_size``, ``block_size``, ``n_head``, ``dropout``),
    else an assumed head dim 64 at T 1024; attention runs in bf16 under float8 (only the projections are float8).

    Example::

        attention_row(gpt_module, "bf16", torch.device("cuda"))  # ("attention_kernel", "flash", ...)

    Args:
        module: The LightningModule (or any object with a GPT-like ``config``).
        compute_dtype: What the precision plugin computes in (``precision.dtype.compute_dtype_name``).
        device: Where attention runs.
    """
    config = getattr(module, "config", None)
    head_dim, seq_len, n_head = (getattr(config, k, None) for k in ("head_size", "block_size", "n_head"))
    dropout = float(getattr(config, "dropout", 0.0) or 0.0)
    shape = "the model's" if head_dim and seq_len else "an assumed"
    head_dim, seq_len, n_head = head_dim or 64, seq_len or 1024, n_head or 1
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}.get(compute_dtype, torch.float32)
    kernel = attention_kernel(device, head_dim, seq_len, dtype, n_head, dropout)
    dtype_name = str(dtype).removeprefix("torch.")
    return ("attention_kernel", kernel, f"what SDPA runs for {shape} head dim {head_dim}, T {seq_len}, {dtype_name}, causal")
