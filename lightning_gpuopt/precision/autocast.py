"""The shared base of our precision plugins: Lightning's ``MixedPrecision`` whose device comes from the Trainer.

Lightning's ``MixedPrecision`` takes the autocast ``device`` as a constructor argument. Ours learn it
from the Trainer they are attached to (``trainer.strategy.root_device``) the first time they see the
LightningModule (in ``module_init_context``'s hooks or in ``convert_module``), so a YAML config never
names a device. Until then they assume bfloat16 on the device a Trainer would pick by default (CUDA if
present), without initialising CUDA.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

import torch
from lightning.fabric.accelerators.cuda import num_cuda_devices
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gpuopt.precision.dtype import clip_without_scaler

__all__ = ["supports_bf16", "trainer_device"]

_AutocastPrecision = Literal["16-mixed", "bf16-mixed"]


def supports_bf16(device: torch.device) -> bool:
    """Whether ``device`` runs bfloat16 matmuls natively (CPU: yes; CUDA: compute capability >= 8.0).

    Example::

        supports_bf16(torch.device("cuda", 0))  # False on a T4 or V100, True on A100/H100

    Args:
        device: The device training runs on.
    """
    if device.type == "cuda":
        # including_emulation=False: T4/V100 "support" bf16 only through slow emulation.
        with torch.cuda.device(device):
            return torch.cuda.is_bf16_supported(including_emulation=False)
    return True


def trainer_device(module: Module) -> Optional[torch.device]:
    """The root device of the Trainer ``module`` (a LightningModule) is attached to, else ``None``."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        return None
    return trainer.strategy.root_device


def _default_device_type() -> str:
    # What a Trainer with accelerator="auto" picks; replaced by the real device at setup. Lightning's
    # device count does not initialise CUDA (NVML), so a plugin built before a fork-based launch
    # (strategy="ddp_fork" / "ddp_notebook") leaves the children free to use the GPU.
    return "cuda" if num_cuda_devices() > 0 else "cpu"


class _TrainerDeviceMixedPrecision(MixedPrecision):
    """``MixedPrecision`` that takes its autocast device from the Trainer at setup (private base).

    Until then it assumes bfloat16, without asking the GPU (that would initialise CUDA in the
    process that builds the Trainer); ``_bind`` decides with the real device, at ``convert_module`` or
    at the first read of ``precision`` once the Trainer has initialised its GPU, whichever comes first.
    """

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        clip_without_scaler(self, optimizer, clip_val, gradient_clip_algorithm)

    def __init__(self) -> None:
        self._bound_device: Optional[torch.device] = None
        self._built = False  # MixedPrecision.__init__ reads and then overwrites what a bind would set
        super().__init__(precision="bf16-mixed", device=_default_device_type())
        self._built = True

    @property  # type: ignore[override]
    def precision(self) -> _AutocastPrecision:
        """``"bf16-mixed"`` or ``"16-mixed"``: decided by the training device's bf16 support."""
        if getattr(self, "_built", False) and self._bound_device is None and torch.cuda.is_initialized():
            # The Trainer has set its GPU (setup_environment) but not yet called convert_module: callbacks'
            # setup and configure_model (FSDP2's parameter dtype) read the precision now, for this GPU.
            self._bind(torch.device("cuda", torch.cuda.current_device()))
        return self._precision

    @precision.setter
    def precision(self, value: _AutocastPrecision) -> None:
        self._precision = value

    def _precision_for(self, device: torch.device) -> _AutocastPrecision:
        """The autocast precision to use on ``device``; subclasses decide."""
        return "bf16-mixed"

    def _bind(self, device: torch.device) -> None:
        """Adopt ``device`` (where training runs): autocast there, with a ``GradScaler`` for fp16."""
        if self._bound_device == device:
            return
        self._bound_device = device
        self.device = device.type
        self.precision = self._precision_for(device)
        if self.precision == "16-mixed" and self.scaler is None:
            self.scaler = torch.amp.GradScaler(device=device.type)
        elif self.precision == "bf16-mixed":
            self.scaler = None

    def _bind_from(self, module: Module) -> None:
        device = trainer_device(module)
        if device is not None:
            self._bind(device)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matmuls run in under this plugin's autocast (read by MFU/throughput callbacks).

        Subclasses state ``fp8`` beside it: whether their matmuls run in float8 instead.
        """
        return torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16

    @override
    def convert_module(self, module: Module) -> Module:
        self._bind_from(module)
        return module
