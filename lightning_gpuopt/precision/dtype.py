"""The dtype matmuls run in under a precision plugin, for picking the right peak FLOP/s.

Each plugin states its own (``compute_dtype``, ``fp8``); only Lightning's, which state a
``precision`` string alone, are read from a table.
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
    """Whether fp32 matmuls on CUDA may run on TF32 tensor cores, read through ``fp32_precision`` (torch >= 2.9),
    which answers whichever API set it (the legacy flags refuse to be read once the new one is set)."""
    if hasattr(torch.backends, "fp32_precision"):
        return torch.backends.cuda.matmul.fp32_precision == "tf32"
    return torch.get_float32_matmul_precision() != "highest"


# The ``precision`` string of a Lightning plugin -> the dtype its matmuls run in, naming the plugins that use it.
# Other plugins state their own dtype (``compute_dtype``, ``fp8``), so a new plugin needs no new row; strings not
# listed (bitsandbytes' ``"nf4"``, ``"int8"``, ...) are read from the plugin's ``dtype``.
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
    """Whether ``plugin`` runs its matmuls in float8: it says so (``fp8 = True``), or is Transformer Engine's."""
    return _stated_dtype_name(plugin) == "fp8"


def compute_dtype_name(plugin: Any) -> Optional[str]:
    """What the plugin's matmuls run in: ``fp32``, ``tf32``, ``bf16``, ``fp16``, ``fp64``, ``fp8``, or ``None``.

    The plugin's ``fp8`` and ``compute_dtype`` first, else Lightning's ``precision`` string through
    :data:`LIGHTNING_PRECISIONS`; fp32 counts as ``tf32`` when TF32 matmuls are allowed.

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

    Lightning refuses to clip for an optimizer that unscales inside ``step()`` (fused AdamW). Under bf16
    nothing is scaled; under fp16 this unscales first (``GradScaler.unscale_``, torch's documented way),
    and the fused step then does not unscale again, so the step equals Lightning's non-fused one.
    """
    if not clip_val or clip_val <= 0:
        return
    # An optimizer whose step() unscales (fused AdamW); Lightning has unscaled all others already.
    has_grads = any(p.grad is not None for group in optimizer.param_groups for p in group["params"])
    # no gradients: a skipped backward, nothing to clip
    if plugin.scaler is not None and unscales_in_step(optimizer) and has_grads:
        plugin.scaler.unscale_(optimizer)
    Precision.clip_gradients(plugin, optimizer, clip_val, GradClipAlgorithmType(algorithm))
