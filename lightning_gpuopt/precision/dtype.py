"""The dtype matmuls run in under a precision plugin, for picking the right peak FLOP/s.

Each plugin states its own dtype (``compute_dtype``, and ``fp8`` when its matmuls run in float8);
only Lightning's built-in plugins, which state a ``precision`` string alone, are read from a table.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.optim import Optimizer

from lightning_gpuopt.internals import unscales_in_step
from lightning_gpuopt.perf.peaks import dtype_name

__all__ = ["LIGHTNING_PRECISIONS", "clip_mixed_precision", "compute_dtype_name", "is_fp8", "tf32_enabled"]


def tf32_enabled() -> bool:
    """Whether fp32 matmuls on CUDA may run on TF32 tensor cores (global torch setting).

    Read through ``torch.backends.cuda.matmul.fp32_precision`` (torch >= 2.9), which answers whichever
    API set it; the legacy flags refuse to be read once anything set the new one.
    """
    if hasattr(torch.backends, "fp32_precision"):
        return torch.backends.cuda.matmul.fp32_precision == "tf32"
    return torch.get_float32_matmul_precision() != "highest"


# Lightning's own precision plugins state their dtype only as a ``precision`` string: one row per
# string, naming the plugins that use it. A plugin of ours (or anyone's) states its own dtype instead
# (``compute_dtype``, ``fp8``), so no plugin class is named here and a new plugin needs no new row.
LIGHTNING_PRECISIONS: dict[str, str] = {
    "32-true": "fp32",  # Precision (the default), FSDPPrecision, DeepSpeedPrecision, XLAPrecision
    "64-true": "fp64",  # DoublePrecision
    "16-mixed": "fp16",  # MixedPrecision, FSDPPrecision, DeepSpeedPrecision
    "bf16-mixed": "bf16",  # MixedPrecision, FSDPPrecision, DeepSpeedPrecision
    "16-true": "fp16",  # HalfPrecision, FSDPPrecision, DeepSpeedPrecision, XLAPrecision
    "bf16-true": "bf16",  # HalfPrecision, FSDPPrecision, DeepSpeedPrecision, XLAPrecision
    "transformer-engine": "fp8",  # TransformerEnginePrecision (bf16 weights, fp8 matmuls)
    "transformer-engine-float16": "fp8",  # TransformerEnginePrecision (fp16 weights, fp8 matmuls)
}
"""``precision`` string of a Lightning precision plugin -> the dtype its matmuls run in. Strings not
listed (BitsandbytesPrecision's ``"nf4"``, ``"int8"``, ...) are read from the plugin's ``dtype``."""


def _trusted_precision_string(plugin: Any) -> bool:
    # Lightning's own plugins, or a subclass that set its own `precision` (e.g. of MixedPrecision).
    # A custom plugin merely inheriting `Precision.precision = "32-true"` says nothing about its dtype.
    from_lightning = type(plugin).__module__.startswith(("lightning.", "pytorch_lightning.", "lightning_fabric."))
    return from_lightning or "precision" in getattr(plugin, "__dict__", {})


def _stated_dtype_name(plugin: Any) -> Optional[str]:
    """What the plugin says (``fp8``, then ``compute_dtype``), else its Lightning precision string; no TF32 rule."""
    if getattr(plugin, "fp8", None) is True:
        return "fp8"
    dtype = getattr(plugin, "compute_dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype_name(dtype)
    if not _trusted_precision_string(plugin):
        return None
    precision = str(getattr(plugin, "precision", "32-true"))
    if precision in LIGHTNING_PRECISIONS:
        return LIGHTNING_PRECISIONS[precision]
    dequantised = getattr(plugin, "dtype", None)  # bitsandbytes: compute dtype of the dequantised matmuls
    return dtype_name(dequantised) if isinstance(dequantised, torch.dtype) else None


def is_fp8(plugin: Any) -> bool:
    """Whether ``plugin`` runs its matmuls in float8: it says so (``fp8 = True``), or is Transformer Engine's.

    Example::

        is_fp8(Float8Precision())  # True: the plugin's ``fp8`` property
        is_fp8(BF16Precision())    # False

    Args:
        plugin: A precision plugin (``trainer.precision_plugin``).
    """
    return _stated_dtype_name(plugin) == "fp8"


def compute_dtype_name(plugin: Any) -> Optional[str]:
    """``fp32``, ``tf32``, ``bf16``, ``fp16``, ``fp64`` or ``fp8``: what the plugin's matmuls run in; ``None`` if unknown.

    The plugin is asked first: ``fp8 = True`` means float8 matmuls, else a ``compute_dtype``
    (``torch.dtype``) is the dtype (``BF16Precision`` and ``Float8Precision`` state both). Lightning's
    own plugins state only a ``precision`` string, read through :data:`LIGHTNING_PRECISIONS`. fp32
    counts as ``tf32`` when TF32 matmuls are allowed.

    Example::

        compute_dtype_name(trainer.precision_plugin)  # "bf16" under precision="bf16-mixed"

    Args:
        plugin: A precision plugin (``trainer.precision_plugin``).

    Note:
        A custom plugin with neither ``fp8``/``compute_dtype`` nor its own ``precision`` string gives
        ``None`` rather than a guess (Lightning's ``ThroughputMonitor`` takes it as fp32).
    """
    name = _stated_dtype_name(plugin)
    if name == "fp32" and tf32_enabled():
        return "tf32"
    return name


def clip_mixed_precision(
    plugin: MixedPrecision,
    optimizer: Optimizer,
    clip_val: Union[int, float],
    algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
) -> None:
    """Clip gradients under a ``MixedPrecision`` plugin, fused optimizers included, always on unscaled gradients.

    Lightning's ``MixedPrecision.clip_gradients`` refuses any optimizer that can unscale gradients
    inside ``step()`` (``torch.optim.AdamW(fused=True)``, what ``GPTModule`` builds on CUDA), because
    under fp16 such gradients are still scaled when clipping runs. Under bf16 there is no scaler and
    nothing is scaled, so the plain clipping is exact. Under fp16 this unscales them first
    (``GradScaler.unscale_``, torch's documented way to clip under a scaler): ``GradScaler.step`` then
    hands the fused kernel no scale to divide by again, only the inf check of the unscale, so the step
    equals the one Lightning takes for a non-fused optimizer (which it unscales before clipping itself).

    Example::

        clip_mixed_precision(trainer.precision_plugin, optimizer, 1.0)

    Args:
        plugin: The Trainer's precision plugin.
        optimizer: The optimizer about to step.
        clip_val: The clipping value (``trainer.gradient_clip_val``).
        algorithm: ``norm`` or ``value``.
    """
    if not clip_val or clip_val <= 0:
        return
    # An optimizer whose step() unscales (fused AdamW); Lightning has unscaled all others already.
    has_grads = any(p.grad is not None for group in optimizer.param_groups for p in group["params"])
    if plugin.scaler is not None and unscales_in_step(optimizer) and has_grads:  # no gradients: a skipped backward, nothing to clip
        plugin.scaler.unscale_(optimizer)
    Precision.clip_gradients(plugin, optimizer, clip_val, GradClipAlgorithmType(algorithm))
