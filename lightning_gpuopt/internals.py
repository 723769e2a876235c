"""Every private name of another library that this package touches goes through this module.

Each function touches one or two such names, all listed in :data:`TOUCHED`; :func:`require_internals`
checks them at setup, so an upgrade that renames one fails at the start of ``fit``, naming it. Written
against Lightning 2.6 (2.6.0 to 2.6.6 read) and torch 2.11 to 2.13.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch

from lightning_gpuopt.perf.parallel import data_parallel_rank, data_parallel_size

__all__ = [
    "COMPILED_PREFIX",
    "TOUCHED",
    "attached_trainer",
    "batch_counters",
    "build_train_loader",
    "call_strategy_hook",
    "compiled_by_lightning",
    "compiled_wrapper_or_in_place",
    "data_parallel_ranks",
    "disable_torch_function",
    "drop_train_loader",
    "dump_checkpoint",
    "foreach_norm",
    "forget_scaler_steps",
    "fused_sdp_choice",
    "is_last_batch",
    "load_distributed_checkpoint",
    "last_batch_ready",
    "local_tensor",
    "mark_sigterm_received",
    "missing_internals",
    "move_batch_position",
    "no_version_counter",
    "parser_options",
    "subcommand_parsers",
    "parse_whole_lists",
    "rebuild_train_loader",
    "reparametrize_module",
    "require_internals",
    "sdpa_ops",
    "sampler_sets_num_samples",
    "scaler_unscaled",
    "sdp_priority_order",
    "sequential_parts",
    "set_allocator_settings",
    "set_sdp_priority_order",
    "set_sdpa_backends",
    "settle_validation_counters",
    "show_in_progress_bar",
    "sigterm_notice_logger",
    "tensor_base",
    "throwaway_results",
    "torch_dispatch_mode",
    "transfer_hooks",
    "uncompiled",
    "unscales_in_step",
    "warning_filters_changed",
    "wrap_epoch_advance",
    "wrap_train_dataloader",
]

_SDPA_OPS = ("flash_attention_for_cpu", "flash_attention_for_cpu_backward", "flash_attention_backward",
             "efficient_attention_backward", "cudnn_attention_backward")

# Private names, as "object.path": what `missing_internals` looks up. `trainer.` paths are read on the
# Trainer, `module.` paths on a LightningModule, `checkpoint.` on a ModelCheckpoint, `import:` entries
# are module attributes.
TOUCHED = (
    "trainer._logger_connector._progress_bar_metrics",  # progress-bar dict (show_in_progress_bar)
    "trainer.fit_loop._data_source.dataloader",  # builds the train loader(s) (wrap/build_train_loader)
    "trainer.fit_loop._combined_loader",  # the built train loaders (drop/rebuild_train_loader)
    "trainer.fit_loop._data_fetcher",  # the running fetcher (rebuild_train_loader)
    "trainer.fit_loop.epoch_loop.advance",  # one training batch (wrap_epoch_advance)
    *(  # the counters move_batch_position writes (a renamed one would be created silently by setattr)
        f"trainer.fit_loop.epoch_loop.batch_progress.{part}.{name}"
        for part in ("current", "total")
        for name in ("ready", "started", "processed", "completed")
    ),
    "trainer.fit_loop.epoch_loop.batch_progress.is_last_batch",
    *(  # the in-fit validation's epoch totals (settle_validation_counters writes them)
        f"trainer.fit_loop.epoch_loop.val_loop.batch_progress.total.{name}"
        for name in ("ready", "started", "processed", "completed")
    ),
    "trainer.fit_loop.epoch_loop._results",  # logged values of the epoch (throwaway_results)
    "trainer._signal_connector.received_sigterm",  # the flag behind trainer.received_sigterm (mark_sigterm_received)
    "trainer.fit_loop.epoch_loop._num_ready_batches_reached",  # last batch of the epoch (last_batch_ready)
    "trainer._checkpoint_connector.dump_checkpoint",  # a checkpoint as a dict (dump_checkpoint)
    "trainer._accelerator_connector.use_distributed_sampler",  # the Trainer flag (data_parallel_ranks)
    "module._current_fx_name",  # the hook being run (call_strategy_hook)
    "module._trainer",  # the Trainer a module is attached to, or None (attached_trainer)
    "module._on_before_batch_transfer",  # the module's batch hooks (transfer_hooks)
    "import:lightning.pytorch.trainer.call._call_strategy_hook",
    "import:lightning.pytorch.trainer.connectors.logger_connector.result._ResultCollection",
    "import:lightning.fabric.utilities.data._set_sampler_epoch",
    "import:lightning.pytorch.loops.fetchers._DataFetcher.setup",  # moved onto a rebuilt loader (rebuild_train_loader)
    "checkpoint._enable_version_counter",  # ModelCheckpoint's, no public setter (no_version_counter)
    "module._compiler_ctx",  # set by Trainer.fit on a compiled LightningModule (compiled_by_lightning)
    # overridden (callbacks/progress_bar.py)
    "import:lightning.pytorch.callbacks.RichProgressBar._get_train_description",
    # its "Received SIGTERM" line (sigterm_notice_logger)
    "import:lightning.pytorch.trainer.connectors.signal_connector.log",
    "import:lightning.fabric.utilities.load._load_distributed_checkpoint",  # (load_distributed_checkpoint)
    # torch
    "import:torch._C._get_sdp_priority_order",  # SDPA backend priorities (sdp_priority_order)
    "import:torch._C._set_sdp_priority_order",  # (set_sdp_priority_order)
    "import:torch._fused_sdp_choice",  # the kernel SDPA would pick (fused_sdp_choice)
    "import:torch.nn.attention._sdpa_kernel",  # backends enabled, in a priority order (set_sdpa_backends)
    "import:torch._foreach_norm",  # one kernel for many norms (foreach_norm)
    *(f"import:torch.ops.aten._scaled_dot_product_{name}" for name in _SDPA_OPS),  # counted as math (sdpa_ops)
    # torch.compile's wrapper (compiled_wrapper_or_in_place, uncompiled)
    "import:torch._dynamo.eval_frame.OptimizedModule",
    "import:torch.nn.Module._compiled_call_impl",  # set by Module.compile() (compiled_wrapper_or_in_place)
    "import:torch.Tensor._base",  # the tensor a view looks into (tensor_base)
    "sampler._num_samples",  # a RandomSampler's own num_samples (sampler_sets_num_samples)
    "import:torch._C.DisableTorchFunction",  # (disable_torch_function)
    "import:torch.distributed.tensor.DTensor._local_tensor",  # a shard's own storage (local_tensor)
    "import:torch.nn.utils.stateless._reparametrize_module",  # tied weights kept (reparametrize_module)
    "optimizer._step_supports_amp_scaling",  # a fused optimizer's step() unscales (unscales_in_step)
    "import:torch.utils._python_dispatch.TorchDispatchMode",  # sees every operator below autograd (torch_dispatch_mode)
    "scaler._per_optimizer_states",  # GradScaler's unscale stage per optimizer (scaler_stage, forget_scaler_steps)
    "scheduler._schedulers",  # SequentialLR's parts (sequential_parts)
    "scheduler._milestones",
    # jsonargparse
    "parser._actions",  # the options a parser knows (parser_options, parse_whole_lists)
    "import:lightning.pytorch.cli.LightningCLI._parser",  # a subcommand's parser (subcommand_parsers)
    "import:jsonargparse.ArgumentParser._add_signature_parameter",  # overridden: int before float (cli/main.py)
    "import:jsonargparse._common.Action._check_type_",  # parses one option's value (parse_whole_lists)
    # the standard library
    "import:warnings._filters_mutated",  # refresh after removing one filter (warning_filters_changed)
)


def _lookup(root: Any, path: str) -> Any:
    for name in path.split("."):
        root = getattr(root, name)
    return root


def _imported(path: str) -> Any:
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest importable module, then attributes
        try:
            return _lookup(importlib.import_module(".".join(parts[:cut])), ".".join(parts[cut:]))
        except ModuleNotFoundError:
            continue
    raise ImportError(path)


def _library_roots() -> dict[str, Any]:
    """One small object of each other library's classes whose private attributes :data:`TOUCHED` names."""
    from jsonargparse import ArgumentParser

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0)
    scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer, [warmup, torch.optim.lr_scheduler.ConstantLR(optimizer, 1.0)], [1]
    )
    sampler = torch.utils.data.RandomSampler(range(2))
    fused = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], fused=True)
    scaler = torch.amp.GradScaler("cpu")
    return {
        "scaler": scaler,
        "scheduler": scheduler,
        "parser": ArgumentParser(),
        "sampler": sampler,
        "optimizer": fused,
    }


def missing_internals(trainer: pl.Trainer) -> list[str]:
    """The names of :data:`TOUCHED` that this Lightning does not have (``[]`` when all are there)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    roots = {"trainer": trainer, "module": pl.LightningModule(), "checkpoint": ModelCheckpoint(), **_library_roots()}
    missing = []
    for entry in TOUCHED:
        kind, _, path = entry.partition(":") if entry.startswith("import:") else entry.partition(".")
        try:
            _imported(path) if kind == "import" else _lookup(roots[kind], path)
        except Exception:  # renamed, moved, or a property that no longer works: all the same to us
            missing.append(entry)
    return missing


def require_internals(trainer: pl.Trainer, who: str) -> None:
    """Raise, naming them, if any of :data:`TOUCHED` is missing; ``who`` is the piece that needs them."""
    missing = missing_internals(trainer)
    if missing:
        raise RuntimeError(
            _gone(", ".join(missing)) + f" {who} cannot run with it: pin lightning to a version it supports."
        )


def _gone(name: str) -> str:
    return (
        f"lightning_gpuopt: {name} is gone in this version (Lightning {pl.__version__}, torch {torch.__version__}); "
        "lightning_gpuopt.internals needs an update."
    )


def sigterm_notice_logger() -> logging.Logger:
    """The logger of Lightning's "Received SIGTERM: 15" line: its signal connector's module logger."""
    from lightning.pytorch.trainer.connectors import signal_connector

    return signal_connector.log


def show_in_progress_bar(trainer: pl.Trainer, metrics: dict[str, Any]) -> None:
    """Show plain numbers in the progress bar until they are replaced.

    ``self.log(..., prog_bar=True)`` stores device tensors that the bar reads with ``.item()`` on every
    refresh, a host-device sync per batch; these are already on the host.
    """
    bar = getattr(getattr(trainer, "_logger_connector", None), "_progress_bar_metrics", None)
    if not isinstance(bar, dict):
        raise RuntimeError(_gone("Trainer._logger_connector._progress_bar_metrics"))
    bar.update(metrics)


def _data_source(trainer: pl.Trainer) -> Any:
    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
    if source is None or not callable(getattr(source, "dataloader", None)):
        raise RuntimeError(_gone("Trainer.fit_loop._data_source.dataloader"))
    return source


def wrap_train_dataloader(trainer: pl.Trainer, wrap: Callable[[Any], Any]) -> Callable[[], None]:
    """Make the training loaders pass through ``wrap(loaders) -> loaders`` when Lightning builds them (in
    ``fit_loop.setup_data()``, after the ``setup`` hooks); returns a function that undoes it."""
    source = _data_source(trainer)
    original = source.dataloader
    source.dataloader = lambda: wrap(original())

    def undo() -> None:
        source.__dict__.pop("dataloader", None)

    return undo


def build_train_loader(trainer: pl.Trainer) -> Any:
    """What the module's or datamodule's ``train_dataloader()`` returns now, outside the fit loop."""
    return _data_source(trainer).dataloader()


def drop_train_loader(trainer: pl.Trainer) -> None:
    """Forget the built train loaders, so the fit loop builds them again (e.g. with another batch size)."""
    trainer.fit_loop._combined_loader = None


def rebuild_train_loader(trainer: pl.Trainer, data_fetcher: Any) -> None:
    """Build the train loaders again, in the same epoch (same sample order), and move the running
    ``data_fetcher`` onto them; its next batch is the first of the epoch."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    fit_loop = trainer.fit_loop
    fit_loop._combined_loader = None
    fit_loop.setup_data()
    for loader in fit_loop._combined_loader.flattened:
        _set_sampler_epoch(loader, fit_loop.epoch_progress.current.processed)
    data_fetcher.setup(fit_loop._combined_loader)
    iter(data_fetcher)
    fit_loop._data_fetcher = data_fetcher


def wrap_epoch_advance(
    trainer: pl.Trainer, wrapper: Callable[[Callable[[Any], None], Any], None]
) -> Callable[[], None]:
    """Run each training batch as ``wrapper(advance, data_fetcher)``, where ``advance(data_fetcher)``
    is Lightning's own; returns a function that undoes it."""
    epoch_loop = trainer.fit_loop.epoch_loop
    original = epoch_loop.advance
    epoch_loop.advance = lambda data_fetcher: wrapper(original, data_fetcher)

    def undo() -> None:
        epoch_loop.__dict__.pop("advance", None)

    return undo


def move_batch_position(trainer: pl.Trainer, batches: int) -> None:
    """Set the epoch's batch counters to ``batches`` done (the totals move by the same amount), as if
    the epoch had run that many batches: after a change of micro-batch, the same samples in new batches."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    progress.is_last_batch = False
    for name in ("ready", "started", "processed", "completed"):
        total = getattr(progress.total, name) - getattr(progress.current, name) + batches
        setattr(progress.total, name, total)
        setattr(progress.current, name, batches)


@contextlib.contextmanager
def throwaway_results(trainer: pl.Trainer) -> Iterator[None]:
    """Within it, what training steps log goes to a fresh collection that is dropped afterwards."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    epoch_loop = trainer.fit_loop.epoch_loop
    results = epoch_loop._results
    epoch_loop._results = _ResultCollection(training=True)
    try:
        yield
    finally:
        epoch_loop._results = results


def call_strategy_hook(trainer: pl.Trainer, name: str, *args: Any, **kwargs: Any) -> Any:
    """Call a strategy hook (``training_step``, ``batch_to_device``) as the fit loop does, with the
    module's ``_current_fx_name`` put back afterwards."""
    from lightning.pytorch.trainer import call

    module = trainer.lightning_module
    previous = module._current_fx_name
    try:
        return call._call_strategy_hook(trainer, name, *args, **kwargs)
    finally:
        module._current_fx_name = previous


def attached_trainer(module: Any) -> Optional[pl.Trainer]:
    """The Trainer a LightningModule is attached to, ``None`` when none is (``module.trainer`` raises then)."""
    return getattr(module, "_trainer", None)


def transfer_hooks(module: pl.LightningModule, batch: Any) -> Any:
    """The module's (and datamodule's) ``on_before_batch_transfer`` applied to ``batch``."""
    return module._on_before_batch_transfer(batch, dataloader_idx=0)


def dump_checkpoint(trainer: pl.Trainer) -> dict[str, Any]:
    """The full checkpoint dict Lightning would save now (callbacks' ``on_save_checkpoint`` included)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def last_batch_ready(trainer: pl.Trainer) -> bool:
    """Whether the epoch's last batch has been fetched (Lightning steps the optimizer on it)."""
    return trainer.fit_loop.epoch_loop._num_ready_batches_reached()


def data_parallel_ranks(trainer: pl.Trainer) -> tuple[int, int]:
    """``(num_replicas, rank)`` of the samplers Lightning gives training loaders: ``(1, 0)`` on one
    device or with ``Trainer(use_distributed_sampler=False)`` (each rank reads the whole dataset)."""
    if not trainer._accelerator_connector.use_distributed_sampler:
        return 1, 0
    return data_parallel_size(trainer), data_parallel_rank(trainer)


def no_version_counter(callback: Any) -> None:
    """Make a ``ModelCheckpoint`` overwrite ``last.ckpt`` instead of writing ``last-v1.ckpt`` beside it
    (``ModelCheckpoint(enable_version_counter=...)`` is stored privately, without a setter)."""
    if getattr(callback, "_enable_version_counter", False):
        callback._enable_version_counter = False


def batch_counters(trainer: pl.Trainer) -> Any:
    """The running epoch's batch counters (``.ready``, ``.processed``, ...), read only."""
    return trainer.fit_loop.epoch_loop.batch_progress.current


def settle_validation_counters(trainer: pl.Trainer) -> None:
    """Set the in-fit validation's epoch totals to its completed batches: after Lightning resumed an
    interrupted validation, one batch is counted as fetched and started that never ran."""
    total = trainer.fit_loop.epoch_loop.val_loop.batch_progress.total
    total.ready = total.started = total.processed = total.completed


def mark_sigterm_received(trainer: pl.Trainer) -> None:
    """Set ``trainer.received_sigterm`` (a read-only property) as Lightning's own SIGTERM handler does."""
    trainer._signal_connector.received_sigterm = True


def is_last_batch(trainer: pl.Trainer) -> bool:
    """Whether the batch being trained is the epoch's last."""
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


# torch


def sdp_priority_order() -> list[int]:
    """SDPA's backend priority order (``SDPBackend`` values), highest first."""
    return list(torch._C._get_sdp_priority_order())


def set_sdp_priority_order(order: list[int]) -> None:
    """Set SDPA's backend priority order; which backends are enabled does not change."""
    torch._C._set_sdp_priority_order(order)


def set_sdpa_backends(backends: list[Any]) -> None:
    """Enable exactly ``backends`` (``SDPBackend`` values) for SDPA, first in the priority order in this order."""
    from torch.nn.attention import _sdpa_kernel

    _sdpa_kernel(backends, set_priority=True)


def fused_sdp_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, is_causal: bool) -> int:
    """The ``SDPBackend`` value SDPA would run for these inputs under the current flags and priorities."""
    return int(torch._fused_sdp_choice(q, k, v, dropout_p=dropout_p, is_causal=is_causal))


def foreach_norm(tensors: list[torch.Tensor], ord: float) -> list[torch.Tensor]:
    """The ``ord``-norm of each tensor, in one kernel per device and dtype (what ``clip_grad_norm_`` uses)."""
    return list(torch._foreach_norm(tensors, ord))


def sdpa_ops() -> tuple[list[Any], list[Any]]:
    """The fused SDPA operators as ``FlopCounterMode`` sees them: forward ones missing from its table
    (torch's CPU flash kernel), and the backward ones of every kernel."""
    ops = [getattr(torch.ops.aten, f"_scaled_dot_product_{name}") for name in _SDPA_OPS]
    return ops[:1], ops[1:]


def torch_dispatch_mode() -> type:
    """torch's base class of a mode that sees every operator below autograd (``TorchDispatchMode``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def load_distributed_checkpoint(folder: Any) -> dict[str, Any]:
    """A distributed (FSDP2) checkpoint folder as one checkpoint dict, gathered on the CPU (all of it in memory)."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    return _load_distributed_checkpoint(Path(folder))


def reparametrize_module(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager:
    """Within it, ``model`` uses ``params`` instead of its own, tied weights kept tied."""
    return torch.nn.utils.stateless._reparametrize_module(model, params, tie_weights=True)


COMPILED_PREFIX = "_orig_mod."  # what torch.compile's wrapper puts before its module's names (state-dict keys)


def uncompiled(module: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile`` wrapper holds, else ``module`` itself."""
    return getattr(module, "_orig_mod", module)


def compiled_by_lightning(module: torch.nn.Module) -> bool:
    """Whether Lightning recorded ``module`` as passed compiled to ``Trainer.fit``."""
    return bool(getattr(module, "_compiler_ctx", None))


def compiled_wrapper_or_in_place(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a ``torch.compile`` wrapper or was compiled in place (``Module.compile()``)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None


def tensor_base(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage a view ``t`` looks into, or ``t`` itself."""
    return t._base if t._base is not None else t


def sampler_sets_num_samples(sampler: Any) -> bool:
    """Whether a ``RandomSampler`` was given its own ``num_samples`` (instead of the dataset's length)."""
    return sampler._num_samples is not None


def disable_torch_function() -> contextlib.AbstractContextManager:
    """Within it, ``__torch_function__`` overrides (a ``TorchFunctionMode``) are not called."""
    return torch._C.DisableTorchFunction()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor a rank owns: a DTensor's local shard (its storage, so ``copy_`` writes through), else ``t``."""
    return getattr(t, "_local_tensor", t)


def set_allocator_settings(conf: str) -> None:
    """Update the CUDA caching allocator's configuration at runtime (``conf`` as in ``PYTORCH_CUDA_ALLOC_CONF``)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings  # older torch
    setter(conf)


def unscales_in_step(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` unscales gradients itself under a ``GradScaler`` (torch's fused optimizers)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def scaler_unscaled(scaler: Any, optimizer: Any) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` already ran in this step (the gradients are unscaled)."""
    from torch.amp.grad_scaler import OptState

    return scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED


def forget_scaler_steps(scaler: Any) -> None:
    """Forget every optimizer's unfinished step in ``scaler`` (each starts fresh, as after ``update``)."""
    scaler._per_optimizer_states.clear()  # a defaultdict


def sequential_parts(scheduler: Any) -> Optional[tuple[list[Any], list[int]]]:
    """``(schedulers, milestones)`` of a ``SequentialLR``; ``None`` for any other scheduler."""
    if isinstance(scheduler, torch.optim.lr_scheduler.SequentialLR):
        return list(scheduler._schedulers), [int(m) for m in scheduler._milestones]
    return None


# jsonargparse


def subcommand_parsers(cli: Any) -> dict[str, Any]:
    """A LightningCLI's parser of each subcommand (``fit``, ``predict``, ...): ``{}`` when it runs none."""
    parsers = {}
    for name in cli.subcommands():
        try:
            parsers[name] = cli._parser(name)
        except (KeyError, AttributeError):  # run=False: the CLI has no subcommands
            return {}
    return parsers


def parser_options(parser: Any) -> list[str]:
    """The option names (``dest``) a jsonargparse/argparse parser knows, ``help`` left out."""
    return [a.dest for a in parser._actions if a.dest and a.dest != "help"]


def parse_whole_lists(parser: Any, dest: str, is_default: Callable[[Any], bool]) -> None:
    """A whole list given for ``dest`` over the value ``is_default`` accepts is parsed as if that value were
    not there (jsonargparse would parse it item by item over the earlier list); ``+=`` still appends."""
    action = next(a for a in parser._actions if a.dest == dest)
    check = action._check_type_

    def check_whole(value: Any, **kwargs: Any) -> Any:
        cfg = kwargs.get("cfg")
        if (
            isinstance(value, (list, str))
            and not kwargs.get("append")
            and cfg is not None
            and is_default(cfg.get(dest))
        ):
            cfg = cfg.clone()
            cfg[dest] = None
            kwargs["cfg"] = cfg
        return check(value, **kwargs)

    action._check_type_ = check_whole


# the standard library


def warning_filters_changed() -> None:
    """Tell ``warnings`` that ``warnings.filters`` was edited in place (as ``filterwarnings`` does)."""
    warnings._filters_mutated()
