"""The dtype matmuls run in under a precision plugin, for picking the right peak FLOP/s."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.optim import Optimizer

from lightning_gpuopt.perf.peaks import dtype_name

__all__ = ["clip_without_scaler", "compute_dtype_name", "is_fp8", "tf32_enabled"]


def tf32_enabled() -> bool:
    """Whether fp32 matmuls on CUDA may run on TF32 tensor cores (global torch setting)."""
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def is_fp8(plugin: Any) -> bool:
    """Whether ``plugin`` runs matmuls in float8: it says so (``fp8 = True``), or is a Float8 / Transformer Engine plugin.

    Args:
        plugin: A precision plugin (``trainer.precision_plugin``).
    """
    if getattr(plugin, "fp8", False) is True:
        return True
    name = type(plugin).__name__
    return "Float8" in name or "TransformerEngine" in name or "transformer-engine" in str(getattr(plugin, "precision", ""))


def _trusted_precision_string(plugin: Any) -> bool:
    # Lightning's own plugins, or a subclass that set its own `precision` (e.g. of MixedPrecision).
    # A custom plugin merely inheriting `Precision.precision = "32-true"` says nothing about its dtype.
    from_lightning = type(plugin).__module__.startswith(("lightning.", "pytorch_lightning.", "lightning_fabric."))
    return from_lightning or "precision" in getattr(plugin, "__dict__", {})


def compute_dtype_name(plugin: Any) -> Optional[str]:
    """``fp32``, ``tf32``, ``bf16``, ``fp16``, ``fp64`` or ``fp8``: what the plugin's matmuls run in; ``None`` if unknown.

    A plugin states its own dtype through a ``compute_dtype`` property (``lightning_gpuopt``'s
    ``BF16Precision`` and ``Float8Precision`` do); Lightning's built-in plugins (mixed, half, double,
    full, FSDP, DeepSpeed, Transformer Engine) are read from their ``precision`` string. fp32 counts as
    ``tf32`` when TF32 matmuls are allowed.

    Example::

        compute_dtype_name(trainer.precision_plugin)  # "bf16" under precision="bf16-mixed"

    Args:
        plugin: A precision plugin (``trainer.precision_plugin``).

    Note:
        A custom plugin with neither ``compute_dtype`` nor its own ``precision`` string gives
        ``None`` rather than a guess (Lightning's ``ThroughputMonitor`` takes it as fp32).
    """
    if is_fp8(plugin):
        return "fp8"
    dtype = getattr(plugin, "compute_dtype", None)
    if isinstance(dtype, torch.dtype):
        name = dtype_name(dtype)
    elif _trusted_precision_string(plugin):
        precision = str(getattr(plugin, "precision", "32-true"))
        if precision.startswith("bf16"):
            name = "bf16"
        elif precision.startswith("16"):
            name = "fp16"
        elif precision.startswith("64"):
            name = "fp64"
        elif precision.startswith("32"):
            name = "fp32"
        else:
            bnb_dtype = getattr(plugin, "dtype", None)  # e.g. bitsandbytes: compute dtype of the dequantised matmuls
            name = dtype_name(bnb_dtype) if isinstance(bnb_dtype, torch.dtype) else None
    else:
        return None
    if name == "fp32" and tf32_enabled():
        return "tf32"
    return name


def clip_without_scaler(
    plugin: MixedPrecision,
    optimizer: Optimizer,
    clip_val: Union[int, float],
    algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
) -> None:
    """Clip gradients under a ``MixedPrecision`` plugin, fused optimizers included, when it has no scaler.

    Lightning's ``MixedPrecision.clip_gradients`` refuses any optimizer that can unscale gradients
    inside ``step()`` (``torch.optim.AdamW(fused=True)``, what ``GPTModule`` builds on CUDA), because
    under fp16 such gradients are still scaled when clipping would run. Under bf16 there is no
    scaler and nothing is scaled, so the plain clipping is exact; with a scaler this defers to Lightning.

    Example::

        clip_without_scaler(trainer.precision_plugin, optimizer, 1.0)

    Args:
        plugin: The Trainer's precision plugin.
        optimizer: The optimizer about to step.
        clip_val: The clipping value (``trainer.gradient_clip_val``).
        algorithm: ``norm`` or ``value``.
    """
    if plugin.scaler is None:
        Precision.clip_gradients(plugin, optimizer, clip_val, GradClipAlgorithmType(algorithm))
    else:
        MixedPrecision.clip_gradients(plugin, optimizer, clip_val, GradClipAlgorithmType(algorithm))
