"""TF32 across torch's two APIs: capture, set and put back.

torch 2.9 added per-backend ``fp32_precision`` settings beside the legacy flags, which then refuse to be
read. These functions read the new ones and write both: the new decide, the legacy are what Lightning reads.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["capture_tf32", "restore_tf32", "set_tf32"]


def _nodes() -> dict[str, Any]:
    """The per-backend settings that :func:`set_tf32` writes, by name; none before torch 2.9."""
    b = torch.backends
    if not hasattr(b, "fp32_precision"):
        return {}
    return {
        "cuda.matmul": b.cuda.matmul,
        "cudnn.conv": b.cudnn.conv,
        "cudnn.rnn": b.cudnn.rnn,
        "mkldnn.matmul": b.mkldnn.matmul,
    }


def _legacy_view(read: Callable[[], Any]) -> Any:
    """A legacy flag, or ``None`` where the new API was set so that torch refuses to read it."""
    try:
        return read()
    except RuntimeError:  # "... you have used mix of the legacy and new APIs ..."
        return None


def capture_tf32() -> dict[str, Any]:
    """The TF32 state :func:`set_tf32` may change, for :func:`restore_tf32`."""
    return {
        "matmul_precision": _legacy_view(torch.get_float32_matmul_precision),
        "tf32_cudnn": _legacy_view(lambda: torch.backends.cudnn.allow_tf32),
        "fp32_precision": {name: node.fp32_precision for name, node in _nodes().items()},
    }


def set_tf32(tf32: Optional[bool], matmul_precision: Optional[str]) -> None:
    """Let fp32 matmuls and convolutions on CUDA use TF32 tensor cores, or not, through both APIs.

    Args:
        tf32: TF32 for cuBLAS matmuls and cuDNN convolutions and RNNs; ``None`` leaves them.
        matmul_precision: ``torch.set_float32_matmul_precision`` value (it also decides CPU matmuls);
            ``None`` leaves it.
    """
    if matmul_precision is not None:
        torch.set_float32_matmul_precision(matmul_precision)
    if tf32 is None:
        return
    torch.backends.cudnn.allow_tf32 = tf32
    for name, node in _nodes().items():
        if name != "mkldnn.matmul":  # CPU matmuls follow matmul_precision alone
            node.fp32_precision = "tf32" if tf32 else "ieee"


def restore_tf32(saved: dict[str, Any]) -> None:
    """Put back what :func:`capture_tf32` saw: the legacy flags where they could be read, then each backend's
    setting."""
    if saved["matmul_precision"] is not None:
        torch.set_float32_matmul_precision(saved["matmul_precision"])
    if saved["tf32_cudnn"] is not None:
        torch.backends.cudnn.allow_tf32 = saved["tf32_cudnn"]
    for name, node in _nodes().items():
        node.fp32_precision = saved["fp32_precision"][name]
