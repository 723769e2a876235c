"""The shared base of our precision plugins: Lightning's ``MixedPrecision`` bound to the Trainer's device.

Lightning's ``MixedPrecision`` takes the autocast ``device`` as a constructor argument. Ours learn it
from the Trainer they are attached to (``trainer.strategy.root_device``) and read that device's facts
once (:func:`~lightning_gpuopt.perf.device.read_device`): the autocast dtype and the ``GradScaler`` are
a decision on those facts. They bind at explicit points: when ``configure_model`` assigns its first
module to the LightningModule (``module_init_context``), in ``convert_module``, and when a reader of the
dtype at setup (``MFUMonitor``, ``CUDASettings``) calls
:func:`~lightning_gpuopt.protocols.bind_precision_plugin`. Until then they assume bfloat16 on the
device a Trainer would pick by default (CUDA if present), without initialising CUDA.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gpuopt.perf.device import DeviceFacts, cuda_device_count, read_device
from lightning_gpuopt.precision.dtype import clip_mixed_precision

__all__ = ["trainer_device"]

_AutocastPrecision = Literal["16-mixed", "bf16-mixed"]


def trainer_device(module: Module) -> Optional[torch.device]:
    """The root device of the Trainer ``module`` (a LightningModule) is attached to, else ``None``."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        return None
    return trainer.strategy.root_device


def _default_device_type() -> str:
    # What a Trainer with accelerator="auto" picks; replaced by the real device when the plugin binds.
    # The device count does not initialise CUDA (NVML), so a plugin built before a fork-based launch
    # (strategy="ddp_fork" / "ddp_notebook") leaves the children free to use the GPU.
    return "cuda" if cuda_device_count() > 0 else "cpu"


class _TrainerDeviceMixedPrecision(MixedPrecision):
    """``MixedPrecision`` that takes its autocast device from the Trainer and decides from its facts (private base).

    ``precision``, ``device`` and ``scaler`` are plain attributes that :meth:`bind` sets; reading
    them changes nothing.
    """

    def __init__(self) -> None:
        super().__init__(precision="bf16-mixed", device=_default_device_type())
        self.device_facts: Optional[DeviceFacts] = None
        """The facts of the device bound to (:meth:`bind`), ``None`` until then."""
        self._bound_device: Optional[torch.device] = None

    def _precision_for(self, facts: DeviceFacts) -> _AutocastPrecision:
        """The autocast precision on a device with these facts; subclasses decide."""
        return "bf16-mixed"

    def bind(self, device: Union[torch.device, str], facts: Optional[DeviceFacts] = None) -> None:
        """Train on ``device``: autocast there, in the dtype its facts allow, with a ``GradScaler`` for fp16.

        The plugin binds itself to the Trainer's root device (in ``configure_model`` and
        ``convert_module``); binding the same device again changes nothing.

        Example::

            plugin.bind(trainer.strategy.root_device)
            plugin.bind(torch.device("cpu"), REFERENCE_DEVICES["V100"])  # decide as on a V100, train on the CPU

        Args:
            device: The device training runs on (autocast and the ``GradScaler`` run there).
            facts: The facts the decision reads; ``None`` reads them from ``device`` (``read_device``).
        """
        device = torch.device(device)
        if facts is None and device == self._bound_device:
            return
        before = self.device
        self.device_facts = read_device(device) if facts is None else facts
        self._bound_device = device
        self.device = device.type
        self.precision = self._precision_for(self.device_facts)
        if self.precision == "bf16-mixed":
            self.scaler = None
        elif self.scaler is None or before != device.type:
            self.scaler = torch.amp.GradScaler(device=device.type)  # built for the device it scales on

    def _bind_from(self, module: Module) -> None:
        device = trainer_device(module)
        if device is not None:
            self.bind(device)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matmuls run in under this plugin's autocast (read by MFU/throughput callbacks).

        Subclasses state ``fp8`` beside it: whether their matmuls run in float8 instead.
        """
        return torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        clip_mixed_precision(self, optimizer, clip_val, gradient_clip_algorithm)

    def _on_register(self, parent: Module, name: str, child: Optional[Module]) -> Optional[Module]:
        # Module-registration hook, active inside module_init_context (configure_model): bind to the Trainer's
        # device as the first module is assigned, before configure_model reads the dtype (FSDP2's parameters).
        if child is not None and isinstance(parent, pl.LightningModule):
            self._bind_from(parent)
        return None

    @override
    @contextmanager
    def module_init_context(self) -> Generator[None, None, None]:
        handle = nn.modules.module.register_module_module_registration_hook(self._on_register)
        try:
            with super().module_init_context():
                yield
        finally:
            handle.remove()

    @override
    def convert_module(self, module: Module) -> Module:
        self._bind_from(module)
        return module
