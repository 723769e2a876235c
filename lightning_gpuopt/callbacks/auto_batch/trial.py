"""The trials of `AutoBatchSize` and their undo: real training steps at a candidate micro-batch, leaving no trace."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import RunningStage
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data import default_collate

from lightning_gpuopt.internals import (
    build_train_loader,
    call_strategy_hook,
    forget_scaler_steps,
    local_tensor,
    throwaway_results,
    transfer_hooks,
)
from lightning_gpuopt.callbacks.auto_batch.search import Trial
from lightning_gpuopt.perf.device import training_device
from lightning_gpuopt.perf.oom import free_memory, is_oom_error
from lightning_gpuopt.protocols import CompilesItself
from lightning_gpuopt.perf.units import GiB
from lightning_gpuopt.resume import capture_rng_state, restore_rng_state

__all__ = ["TrainingState", "batch_len", "forget_unfinished_scaler_step", "trial_steps"]


@contextlib.contextmanager
def trial_steps(
    trainer: pl.Trainer, pl_module: pl.LightningModule, steps: int, memory_margin: float
) -> Iterator[Callable[[int], Trial]]:
    """Within it, ``trial(size)`` runs ``steps`` training steps at micro-batch ``size`` on every rank.

    On exit the training state (:class:`TrainingState`) is put back and the trials' memory freed.

    Example::

        with trial_steps(trainer, module, steps=2, memory_margin=0.1) as trial:
            fits = trial(8).fits
    """
    state = TrainingState.capture(trainer, pl_module)  # first: building the sample batches may draw from the RNG
    batches: Optional[_SampleBatches] = None
    callbacks, stage = trainer.callbacks, trainer.state.stage
    try:
        batches = _SampleBatches(trainer, pl_module)
        trainer.callbacks = []  # no other callback sees a trial step
        trainer.state.stage = RunningStage.TRAINING
        with throwaway_results(trainer):
            yield lambda size: _trial(trainer, pl_module, batches(size), size, steps, memory_margin)
    finally:
        trainer.callbacks, trainer.state.stage = callbacks, stage
        state.restore(trainer, pl_module)
        batches = None  # the sample batches' memory goes before the next allocation
        free_memory(trainer.strategy.root_device)
        # Compiled graphs are kept (Dynamo specialises size 1, then one dynamic graph that training reuses, so the
        # trials measured the graph that trains); graphs tuned or captured for the trial sizes are dropped.
        if _tuned_compile(pl_module):
            torch.compiler.reset()


def _tuned_compile(pl_module: pl.LightningModule) -> bool:
    """Whether the module compiled with a mode that tunes or records for the shapes it saw."""
    return isinstance(pl_module, CompilesItself) and pl_module.compile_mode_in_use not in (None, "default")


def _trial(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, size: int, steps: int, margin: float
) -> Trial:
    """Run the trial steps at one size on every rank; fits only if it fits on all of them."""
    device = trainer.strategy.root_device
    free_memory(device)
    fits, reason = True, ""
    sync = _PeerSync(trainer, pl_module)
    try:
        with sync:
            for _ in range(steps):
                _training_step(trainer, pl_module, batch, sync)
    except _PeerOutOfMemory:
        fits, reason = False, "out of memory on another rank"
    except Exception as err:
        if not is_oom_error(err):
            raise
        fits, reason = False, "out of memory"
        sync.tell_peers()
    if not fits:
        pl_module.zero_grad(set_to_none=True)
        for opt in trainer.optimizers:
            opt.zero_grad(set_to_none=True)
        forget_unfinished_scaler_step(trainer)
    peak = None
    if device.type == "cuda":
        peak = torch.cuda.max_memory_reserved(device)  # a measurement on the run's own GPU
        total = training_device(trainer).total_memory
        if fits and peak > (1 - margin) * total:
            fits, reason = False, f"peak {peak / GiB:.1f} GiB leaves less than {margin:.0%} free"
    free_memory(device)
    agreed = trainer.strategy.reduce_boolean_decision(fits, all=True)
    if fits and not agreed:
        reason = "out of memory on another rank"
    return Trial(size, agreed, peak, reason)


def _no_sync(trainer: pl.Trainer) -> contextlib.AbstractContextManager:
    """DDP without the gradient all-reduce: a trial free of collectives, so an OOM cannot hang the other ranks."""
    model = trainer.strategy.model
    return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()


class _PeerOutOfMemory(RuntimeError):
    """Another rank ran out of memory in this trial step."""


class _PeerSync:
    """Under FSDP2, ranks all-reduce an "out of memory" flag before each FSDP module's forward (ahead of its
    all-gather) and after the loss, so one rank's OOM stops the trial on all (``docs/callbacks.md``, Distributed)."""

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.device = trainer.strategy.root_device
        self.active = (
            trainer.world_size > 1
            and torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and not hasattr(trainer.strategy.model, "no_sync")
        )
        self.modules = []
        if self.active:
            from torch.distributed.fsdp import FSDPModule

            self.modules = [m for m in pl_module.modules() if isinstance(m, FSDPModule)]
        self._handles: list[Any] = []

    def __enter__(self) -> "_PeerSync":
        self._handles = [m.register_forward_pre_hook(lambda *_: self.check(), prepend=True) for m in self.modules]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()

    def _all_reduce(self, value: float) -> float:
        flag = torch.tensor([value], device=self.device)
        torch.distributed.all_reduce(flag)
        return float(flag.item())

    def check(self) -> None:
        if self.active and self._all_reduce(0.0) > 0:
            raise _PeerOutOfMemory("out of memory on another rank")

    def tell_peers(self) -> None:
        if self.active:
            self._all_reduce(1.0)


def _training_step(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, sync: _PeerSync) -> None:
    """One real training step through the run's strategy and precision plugin."""
    pl_module.train()
    optimizer = trainer.optimizers[0]
    precision = trainer.precision_plugin
    with _no_sync(trainer):
        output = call_strategy_hook(trainer, "training_step", batch, 0)
        loss = output["loss"] if isinstance(output, dict) else output
        if loss is None:
            raise ValueError("AutoBatchSize needs training_step to return the loss; it returned None.")
        sync.check()  # the logits and loss, after the last block, are where memory peaks
        scaler = getattr(precision, "scaler", None)
        precision.backward(scaler.scale(loss) if scaler is not None else loss, pl_module, optimizer)
    precision.optimizer_step(optimizer, model=pl_module, closure=lambda: loss)
    optimizer.zero_grad(set_to_none=True)


class _SampleBatches:
    """Batches of any size with the real shape: raw training samples through the loader's own ``collate_fn``."""

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.trainer, self.module = trainer, pl_module
        loader = build_train_loader(trainer)
        if not isinstance(loader, DataLoader):
            raise ValueError(
                f"AutoBatchSize needs train_dataloader() to return a torch DataLoader, got {type(loader).__name__}."
            )
        self.collate = loader.collate_fn or default_collate
        self.dataset = loader.dataset
        self.samples: Optional[list[Any]] = None
        if isinstance(self.dataset, IterableDataset):
            if loader.batch_size is None and loader.batch_sampler is None:
                raise ValueError(
                    f"AutoBatchSize cannot set the micro-batch of a DataLoader with batch_size=None: its "
                    f"{type(self.dataset).__name__} yields whole batches of its own size. Let the loader batch "
                    "single samples: yield one sample at a time and return DataLoader(dataset, "
                    "batch_size=self.batch_size, "
                    "collate_fn=...) from train_dataloader()."
                )
            # Raw samples read from the dataset in this process, as many as the largest trial needs; repeated if it
            # ends.
            self.samples, self._stream = [], iter(self.dataset)
        elif len(self.dataset) == 0:
            raise ValueError("AutoBatchSize: the training dataset is empty.")

    def _stream_samples(self, size: int) -> list[Any]:
        while self._stream is not None and len(self.samples) < size:
            try:
                self.samples.append(next(self._stream))
            except StopIteration:
                self._stream = None
        if not self.samples:
            raise ValueError("AutoBatchSize: the training dataset is empty.")
        return [self.samples[i % len(self.samples)] for i in range(size)]

    def __call__(self, size: int) -> Any:
        if self.samples is not None:
            items = self._stream_samples(size)
        else:
            items = [self.dataset[i % len(self.dataset)] for i in range(size)]
        batch = self.trainer.precision_plugin.convert_input(self.collate(items))
        batch = transfer_hooks(self.module, batch)
        return call_strategy_hook(self.trainer, "batch_to_device", batch, dataloader_idx=0)


def batch_len(batch: Any) -> Optional[int]:
    """Samples in a batch: the first dimension of its first tensor (``None`` when it holds no tensor)."""
    if isinstance(batch, torch.Tensor):
        return batch.size(0) if batch.dim() else None
    if isinstance(batch, Mapping):  # dicts, Hugging Face BatchEncoding
        values = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
    else:
        return None
    for value in values:
        found = batch_len(value)
        if found is not None:
            return found
    return None


# ------------------------------------------------------------------ the undo: what a trial can change


def forget_unfinished_scaler_step(trainer: pl.Trainer) -> None:
    """Forget a grad-scaler step that an error cut short between ``unscale_`` and ``step`` (the next
    ``unscale_`` would raise; ``update``, which clears it, needs a finished step)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None:
        forget_scaler_steps(scaler)


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
    """A copy of an optimizer state dict in host memory (DTensors as their local shard)."""
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

    Copied to host memory, so the copies do not take the device memory the search measures (Adam's
    state is twice the weights). Optimizer state is copied only when it exists before the search
    (an optimizer that already stepped); a checkpoint's arrives after it.
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
            weights=[local_tensor(t.detach()).to("cpu", copy=True) for t in tensors],
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
                local_tensor(t).copy_(saved)
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
