"""The trial step of ``AutoBatchSize``: real training steps at a candidate micro-batch, that leave no trace.

A trial runs ``training_step``, backward and the optimizer step through the run's own strategy
and precision plugin, on a batch of the real shape built from the training data, and reports
whether it fits (:class:`~lightning_gpuopt.callbacks.auto_batch.search.Trial`). :func:`trial_steps` captures
the training state first and puts it back afterwards; other callbacks do not see the trial steps,
and what they log is dropped. Lightning's private state is reached through
:mod:`lightning_gpuopt.internals` only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data import default_collate

from lightning_gpuopt.callbacks.auto_batch.training_state import TrainingState, forget_unfinished_scaler_step
from lightning_gpuopt.internals import (
    build_train_loader,
    call_strategy_hook,
    throwaway_results,
    transfer_hooks,
)
from lightning_gpuopt.callbacks.auto_batch.search import Trial
from lightning_gpuopt.perf.device import training_device
from lightning_gpuopt.perf.oom import free_memory, is_oom_error
from lightning_gpuopt.protocols import CompilesItself
from lightning_gpuopt.perf.units import GiB

__all__ = ["batch_len", "trial_steps"]


@contextlib.contextmanager
def trial_steps(
    trainer: pl.Trainer, pl_module: pl.LightningModule, steps: int, memory_margin: float
) -> Iterator[Callable[[int], Trial]]:
    """Within it, ``trial(size)`` runs ``steps`` training steps at micro-batch ``size`` on every rank.

    On exit the weights, optimizer, schedulers, grad scaler, RNG states and module modes are put
    back as they were, and the memory the trials used is freed. Compiled graphs are kept (training
    reuses them) unless the module compiles with a tuning mode.

    Example::

        with trial_steps(trainer, module, steps=2, memory_margin=0.1) as trial:
            fits = trial(8).fits

    Args:
        trainer: The Trainer in ``on_fit_start``.
        pl_module: Its module.
        steps: Training steps per trial (2 runs one with the optimizer state the first created).
        memory_margin: Fraction of the device's memory a trial must leave free (CUDA).
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
        # Compiled graphs are kept: the trial at micro-batch 1 compiles one (Dynamo specialises size 1),
        # the next size a second with a dynamic batch dimension, which every larger trial and then
        # training reuse. So the search and training compile twice in all, and the trials measured
        # the memory of the very graph that trains. Under a tuning compile mode (max-autotune,
        # reduce-overhead) the trial graphs were tuned or captured for the trial sizes: those are
        # dropped and training compiles its own.
        if _tuned_compile(pl_module):
            torch.compiler.reset()


def _tuned_compile(pl_module: pl.LightningModule) -> bool:
    """Whether the module says (:class:`~lightning_gpuopt.protocols.CompilesItself`) it compiled with a mode
    that tunes or records for the shapes it saw (max-autotune, reduce-overhead)."""
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
    """DDP without the gradient all-reduce: each rank's trial is free of collectives, so an OOM cannot hang the others."""
    model = trainer.strategy.model
    return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()


class _PeerOutOfMemory(RuntimeError):
    """Another rank ran out of memory in this trial step."""


class _PeerSync:
    """Keeps ranks in step when a trial runs out of memory on some of them, under FSDP2.

    FSDP2's forward all-gathers parameters, so a rank that fails in the middle of a forward would
    leave the others waiting in a collective. Here every rank all-reduces an "out of memory" flag
    before each FSDP module's forward (before its all-gather) and once after the loss; a rank that
    runs out of memory sends the flag once, which meets the others at their next check, and they
    stop too. Under DDP (trials run in ``no_sync``) and on one device it does nothing. Not covered:
    an OOM on only some ranks inside the backward pass, whose reduce-scatters cannot be matched.
    """

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
    """Batches of any size with the real shape, dtype and device: raw samples of the training data,
    batched by the loader's own ``collate_fn`` (the default or the dataset's custom one)."""

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
                    "single samples: yield one sample at a time and return DataLoader(dataset, batch_size=self.batch_size, "
                    "collate_fn=...) from train_dataloader()."
                )
            # Raw samples read from the dataset in this process, as many as the largest trial needs; repeated if it ends.
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
    """Samples in a batch: the first dimension of its first tensor (``None`` when it holds no tensor).

    Example::

        batch_len((torch.zeros(8, 16), torch.zeros(8, 16)))  # 8
    """
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
