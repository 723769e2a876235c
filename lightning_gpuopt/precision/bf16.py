"""`BF16Precision`: bfloat16 autocast on the Trainer's device, float16 + GradScaler where bf16 is missing."""

from __future__ import annotations

from typing import Any, Union

import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_gpuopt.perf.device import DeviceFacts
from lightning_gpuopt.precision.base import AutocastMode, DevicePrecision

__all__ = ["BF16Precision", "autocast_precision"]


def autocast_precision(facts: DeviceFacts) -> AutocastMode:
    """``"bf16-mixed"`` where the device runs bfloat16 natively (any CPU; CUDA from compute capability 8.0),
    else ``"16-mixed"`` (T4 and V100 emulate bf16, slowly)."""
    return "bf16-mixed" if facts.bf16 else "16-mixed"


class BF16Precision(DevicePrecision):
    """bfloat16 autocast on the Trainer's device; parameters, gradients and optimizer state stay float32.

    On a GPU without native bfloat16 (T4, V100) it trains with float16 autocast and a ``GradScaler``
    instead, and warns once. Gradients are unscaled before clipping, also for a fused optimizer.

    Example::

        trainer = Trainer(plugins=[BF16Precision()])

    Note:
        Don't also pass ``Trainer(precision=...)``: the plugin is the precision setting.
    """

    @override
    def autocast_mode(self, facts: DeviceFacts) -> AutocastMode:
        return autocast_precision(facts)

    @override
    def bind(self, device: Union[torch.device, str], facts: DeviceFacts, strategy: Any = None) -> None:
        before = self.device_facts
        super().bind(device, facts, strategy)
        if self.device_facts is not before and self.precision == "16-mixed":
            rank_zero_warn(
                f"BF16Precision: {self.device_facts.describe()} has no native bfloat16 support, so training uses "
                "float16 autocast with a GradScaler instead. Use a GPU with compute capability >= 8.0 (A100, H100, "
                "L4, RTX 30xx or newer) for bfloat16."
            )
