"""`BF16Precision`: bfloat16 autocast on the Trainer's device, float16 + GradScaler where bf16 is missing."""

from __future__ import annotations

import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_gpuopt.precision.autocast import _AutocastPrecision, _TrainerDeviceMixedPrecision, supports_bf16

__all__ = ["BF16Precision"]


class BF16Precision(_TrainerDeviceMixedPrecision):
    """Mixed precision with bfloat16 autocast; parameters, gradients and optimizer state stay float32.

    A subclass of Lightning's ``MixedPrecision``, so Lightning's own tools (``ThroughputMonitor``)
    read its compute dtype. The autocast device is the one the Trainer trains on; nothing to set.
    On a GPU without native bfloat16 (T4, V100: compute capability < 8.0) it trains with float16
    autocast and a ``GradScaler`` instead, and warns once that it did. Gradients are unscaled
    before gradient clipping (Lightning's ``MixedPrecision.optimizer_step``).

    Example::

        trainer = Trainer(plugins=[BF16Precision()])

        # LightningCLI / gpuopt YAML
        trainer:
          plugins:
            - class_path: lightning_gpuopt.precision.BF16Precision

    Note:
        Don't also pass ``Trainer(precision=...)``: the plugin is the precision setting.
    """

    def __init__(self) -> None:
        super().__init__()

    @property
    def fp8(self) -> bool:
        """``False``: matmuls run in :attr:`compute_dtype` (bf16, or fp16 without bf16 support)."""
        return False

    @override
    def _precision_for(self, device: torch.device) -> _AutocastPrecision:
        return "bf16-mixed" if supports_bf16(device) else "16-mixed"

    @override
    def _bind(self, device: torch.device) -> None:
        before = self._bound_device
        super()._bind(device)
        if before != device and self.precision == "16-mixed":
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
            rank_zero_warn(
                f"BF16Precision: {device} ({name}) has no native bfloat16 support, so training uses float16 "
                "autocast with a GradScaler instead. Use a GPU with compute capability >= 8.0 (A100, H100, "
                "L4, RTX 30xx or newer) for bfloat16."
            )
