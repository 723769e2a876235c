"""`DevicePrecision`: the public base of this package's precision plugins.

Bound once to the run's device and its facts, it decides from them, and converts the model's layers
where the Trainer builds them; ``docs/precision.md`` writes a new plugin on it in one file.
"""

from __future__ import annotations

import weakref
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gpuopt.internals import attached_trainer
from lightning_gpuopt.perf.device import DeviceFacts, cuda_device_count, training_device
from lightning_gpuopt.precision.dtype import clip_mixed_precision
from lightning_gpuopt.protocols import ConvertsOwnLayers

__all__ = ["AutocastMode", "DevicePrecision", "LayerContext", "LossHead"]

AutocastMode = Literal["16-mixed", "bf16-mixed"]  # bf16, or fp16 with a GradScaler


@dataclass(frozen=True)
class LossHead:
    """An output head whose GEMMs a module's loss runs itself, chunk by chunk, and can run in float8 there
    (``GPTModule``'s chunked loss: ``model/loss.py``'s ``head_float8``): a plugin that decides per layer decides the
    head too and tells the module with ``use_float8``.

    Args:
        name: The head's name in the LightningModule's state dict (``"model.lm_head"``), as the conversion
            report names layers.
        in_features, out_features: Its shape (hidden size, vocabulary rows).
        rows: Tokens per chunk of the loss: the rows of each of its GEMMs.
        use_float8: Called with ``True`` to run the head's GEMMs in float8, ``False`` for the compute dtype.
        unavailable: Why this run's loss cannot run the head in float8 (e.g. tensor parallelism), for the report;
            ``None``: it can.
    """

    name: str
    in_features: int
    out_features: int
    rows: int
    use_float8: Callable[[bool], None]
    unavailable: Optional[str] = None


@dataclass(frozen=True)
class LayerContext:
    """What a model's layers see in training, for a plugin that decides per layer (``Float8Precision`` times them).

    Args:
        tokens: Rows each Linear multiplies per micro-batch (micro-batch x sequence length); ``None``: unknown.
        flops_per_token: The model's training FLOPs per token, to judge a saving against the whole step.
        local_shape: ``(name, in, out) -> (in, out)`` of this rank's shard under tensor parallelism.
        loss_head: The output head the module's loss multiplies itself, which can run in float8 (:class:`LossHead`);
            ``None``: none (the head, if any, is a plain Linear layer).
    """

    tokens: Optional[int] = None
    flops_per_token: Optional[float] = None
    local_shape: Optional[Callable[[str, int, int], tuple[int, int]]] = None
    loss_head: Optional[LossHead] = None


class DevicePrecision(MixedPrecision):
    """A ``MixedPrecision`` plugin that decides from the training device's facts and converts the model.

    Subclass it and override what differs: :meth:`autocast_mode`, :attr:`fp8`, :meth:`bind` (calling
    ``super().bind`` first) and :meth:`convert`. Until bound it states bf16 on the device a Trainer would
    pick, without initialising CUDA.

    Example::

        class MyPrecision(DevicePrecision):
            def convert(self, module, name):
                return swap_linears(module)   # any in-place or returned replacement

        trainer = Trainer(plugins=[MyPrecision()])
    """

    def __init__(self) -> None:
        # The device count does not initialise CUDA (NVML), so a fork-based launch can still use the GPU.
        super().__init__(precision="bf16-mixed", device="cuda" if cuda_device_count() > 0 else "cpu")
        self.device_facts: Optional[DeviceFacts] = None  # the facts bound to; None until bound
        self.bound_device: Optional[torch.device] = None
        self.layer_context: Optional[LayerContext] = None  # what the layers see, when the module said so

    def autocast_mode(self, facts: DeviceFacts) -> AutocastMode:
        """The autocast on a device with these facts."""
        return "bf16-mixed"

    @property
    def fp8(self) -> bool:
        """Whether the converted layers run float8 matmuls (MFU then counts against the fp8 peak)."""
        return False

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matmuls run in under this plugin's autocast (read by MFU and throughput callbacks)."""
        return torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16

    def bind(self, device: Union[torch.device, str], facts: DeviceFacts, strategy: Any = None) -> None:
        """Train on ``device``, deciding from ``facts``: the autocast mode, and a ``GradScaler`` under fp16.

        A run binds the plugin once (``training_device``, with its ``strategy``); a plugin already bound to
        ``device`` keeps its facts, so one bound by hand keeps that decision in a fit:
        ``plugin.bind(torch.device("cpu"), REFERENCE_DEVICES["V100"])`` trains in fp16 with a GradScaler on the CPU.
        """
        device = torch.device(device)
        if device == self.bound_device:
            return
        self.device_facts, self.bound_device, self.device = facts, device, device.type
        self.precision = self.autocast_mode(facts)
        self.scaler = None if self.precision == "bf16-mixed" else torch.amp.GradScaler(device=device.type)

    def convert(self, module: Module, name: str) -> Module:
        """Convert the layers of ``module`` and return it, or what replaces it; by default nothing changes.

        Called for each module ``configure_model`` assigns (``name``: its attribute), before that hook can
        shard or compile it, then for the whole LightningModule (``name == ""``): leave converted modules as they are.
        """
        return module

    def convert_layers(self, module: Module, name: str, context: Optional[LayerContext] = None) -> Module:
        """The named call a LightningModule's ``configure_model`` makes to convert the model it built, before it
        shards or compiles it (``GPTModule`` does; :class:`~lightning_gpuopt.protocols.ConvertsOwnLayers`).
        ``name``: the attribute it assigns the result to; ``context``: what the layers see. Returns :meth:`convert`'s.
        The plugin is bound to the run's device by then (``training_device`` in the module's ``setup``)."""
        self.layer_context = context
        return self.convert(module, name)

    def run_trainer(self) -> Optional[pl.Trainer]:
        """The Trainer of the run this plugin converts for (set as it converts), else ``None``."""
        ref = getattr(self, "_trainer_ref", None)
        return ref() if ref is not None else None

    def _bind_to_run(self, module: Module) -> None:
        trainer = attached_trainer(module)
        if trainer is not None:
            self._trainer_ref = weakref.ref(trainer)
            training_device(trainer)  # binds this plugin, once per run

    @override
    def convert_module(self, module: Module) -> Module:
        self._bind_to_run(module)
        if isinstance(module, ConvertsOwnLayers):
            self.layer_context = module.layer_context()
        return self.convert(module, "")

    def _on_register(self, parent: Module, name: str, child: Optional[Module]) -> Optional[Module]:
        # Active inside module_init_context (configure_model): a module assigned to the LightningModule is converted
        # now, before configure_model can shard or compile it; a module that converts its own layers is left alone.
        if child is None or not isinstance(parent, pl.LightningModule) or isinstance(parent, ConvertsOwnLayers):
            return None
        self._bind_to_run(parent)
        converted = self.convert(child, name)
        return None if converted is child else converted

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
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        clip_mixed_precision(self, optimizer, clip_val, gradient_clip_algorithm)
