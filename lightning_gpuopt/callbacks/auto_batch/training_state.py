"""Capture and restore everything a trial step can change, so a search leaves no trace."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_gpuopt.internals import forget_scaler_steps, local_tensor
from lightning_gpuopt.resume import capture_rng_state, restore_rng_state

__all__ = ["TrainingState", "forget_unfinished_scaler_step"]


def forget_unfinished_scaler_step(trainer: pl.Trainer) -> None:
    """Forget a grad-scaler step that an error cut short.

    Lightning's fp16 step calls ``scaler.unscale_`` before ``scaler.step``; an OOM in between leaves
    the optimizer marked "unscaled", and the next ``unscale_`` would raise. ``update`` is what
    normally clears it, and cannot run without a finished step.
    """
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None:
        forget_scaler_steps(scaler)


def _local(t: Tensor) -> Tensor:
    """The tensor a rank owns: the local shard of a DTensor (FSDP2), the tensor itself otherwise."""
    return local_tensor(t)


@dataclass
class _HostShard:
    """A DTensor's local shard in host memory, with what rebuilds the DTensor on its device."""

    local: Tensor
    device: torch.device
    spec: tuple  # (device mesh, placements, global shape, global stride)

    def back(self) -> Tensor:
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = self.spec
        local = self.local.to(self.device)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _to_host(value: Any) -> Any:
    """A copy of an optimizer state dict with its tensors in host memory (DTensors as their local shard)."""
    if isinstance(value, Tensor) and local_tensor(value) is not value:  # DTensor (FSDP2)
        spec = (value.device_mesh, value.placements, value.shape, value.stride())
        local = local_tensor(value)
        return _HostShard(local.detach().to("cpu", copy=True), local.device, spec)
    if isinstance(value, Tensor):  # torchao's low-bit states move too (their subclasses implement the copy)
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    return copy.deepcopy(value)


def _from_host(value: Any) -> Any:
    """The state dict to load: DTensors rebuilt on their device (``load_state_dict`` moves plain tensors)."""
    if isinstance(value, _HostShard):
        return value.back()
    if isinstance(value, dict):
        return {k: _from_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_from_host(v) for v in value)
    return value


@dataclass
class TrainingState:
    """Weights, optimizer and LR-scheduler state, grad-scaler state, RNG states and module modes.

    Weights and optimizer state are copied to host memory, so the copies do not take the device
    memory the search measures (Adam's state is twice the weights: a copy on the device would make
    the search pick a smaller micro-batch, or find none). Optimizer state is copied only when it
    exists. It is empty at the start of a fresh run (trial steps create it and ``restore`` drops it
    again), and a checkpoint's optimizer state arrives after ``on_fit_start`` under every strategy,
    so after the search; it exists when ``configure_optimizers`` hands over an optimizer that has
    already stepped (one kept across fits) or a callback loads optimizer state in ``on_fit_start``.
    ``restore`` loads it back onto its parameters' device and dtype.
    """

    weights: list[Tensor] = field(default_factory=list)
    grads_were_none: bool = True
    optimizers: list[Optional[dict]] = field(default_factory=list)
    groups: list[list[dict]] = field(default_factory=list)  # each optimizer's param-group settings (lr, ...)
    schedulers: list[dict] = field(default_factory=list)
    scaler: Optional[dict] = None
    rng: dict[str, Any] = field(default_factory=dict)
    modes: list[bool] = field(default_factory=list)

    @classmethod
    def capture(cls, trainer: pl.Trainer, module: torch.nn.Module) -> "TrainingState":
        tensors = list(module.parameters()) + list(module.buffers())
        state = cls(
            weights=[_local(t.detach()).to("cpu", copy=True) for t in tensors],
            grads_were_none=all(p.grad is None for p in module.parameters()),
            optimizers=[
                _to_host(opt.state_dict()) if len(opt.state) else None for opt in trainer.optimizers
            ],
            groups=[
                [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in opt.param_groups]
                for opt in trainer.optimizers
            ],
            schedulers=[copy.deepcopy(cfg.scheduler.state_dict()) for cfg in trainer.lr_scheduler_configs],
            modes=[m.training for m in module.modules()],
        )
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            state.scaler = copy.deepcopy(scaler.state_dict())
        state.rng = capture_rng_state()
        return state

    def restore(self, trainer: pl.Trainer, module: torch.nn.Module) -> None:
        with torch.no_grad():
            for t, saved in zip(list(module.parameters()) + list(module.buffers()), self.weights):
                _local(t).copy_(saved)
        if self.grads_were_none:
            for p in module.parameters():
                p.grad = None
        for opt, saved, groups in zip(trainer.optimizers, self.optimizers, self.groups):
            if saved is None:
                opt.state.clear()  # the run had no optimizer state yet: drop what the trials created
                for group, settings in zip(opt.param_groups, groups):  # and what a scheduler step changed
                    group.update(copy.deepcopy(settings))
            else:
                opt.load_state_dict(_from_host(saved))
        for cfg, saved in zip(trainer.lr_scheduler_configs, self.schedulers):
            cfg.scheduler.load_state_dict(saved)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and self.scaler is not None:
            scaler.load_state_dict(self.scaler)
        forget_unfinished_scaler_step(trainer)
        restore_rng_state(self.rng)
        for m, mode in zip(module.modules(), self.modes):
            m.training = mode
