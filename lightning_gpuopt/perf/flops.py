"""Training FLOPs per token of any model: counted over one real training step, or on meta tensors.

:class:`StepFlopCounter` counts what training runs, the loss included, without changing a bit of it
(not ``FlopCounterMode``, which decomposes operators it has no formula for); ``docs/callbacks.md``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_flop_count, shape_wrapper

from lightning_gpuopt.internals import reparametrize_module, sdpa_ops, torch_dispatch_mode, uncompiled

__all__ = ["StepFlopCounter", "count_step_flops", "measure_training_flops", "model_flops_per_token"]


def _first_tensor(output: Any) -> Tensor:
    """The tensor to back-propagate from a model's output (a loss or logits)."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping):
        for key in ("loss", "logits"):
            if isinstance(output.get(key), Tensor):
                return output[key]
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, Tensor) and item.is_floating_point():
                return item
    raise ValueError(
        f"Cannot find a floating-point tensor to back-propagate in the model output of type {type(output).__name__}: "
        "give the module a flops_per_token() method or pass flops_per_token= to MFUMonitor."
    )


def _to_meta(value: Any) -> Any:
    if isinstance(value, Tensor):
        return torch.empty_like(value, device="meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


def _count(model: nn.Module, args: tuple, forward: Optional[Callable[..., Any]]) -> tuple[int, Tensor]:
    """FLOPs of a forward and backward on meta tensors, and the (meta) tensor back-propagated from."""
    model = uncompiled(model)  # torch.compile wrapper
    params = {}
    # Each shared tensor once (tied embeddings): functional_call ties the other names to it.
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        meta = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
        params[name] = meta.requires_grad_(tensor.requires_grad and tensor.is_floating_point())
    meta_args = _to_meta(args)

    def run() -> Any:
        if forward is None:
            return functional_call(model, params, meta_args, tie_weights=True, strict=False)
        with reparametrize_module(model, params):
            return forward(model, *meta_args)

    counter = FlopCounterMode(display=False)
    was_training = model.training
    model.train()
    # A step that draws on the CPU (or CUDA) generator itself must not move the run's random stream.
    rng_devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []  # the RNG of the run's own GPU
    try:
        with torch.random.fork_rng(devices=rng_devices), torch.compiler.set_stance("force_eager"), counter:
            out = _first_tensor(run())
            out.float().sum().backward()
    finally:
        model.train(was_training)
    return int(counter.get_total_flops()), out


def measure_training_flops(model: nn.Module, *args: Any, forward: Optional[Callable[..., Any]] = None) -> int:
    """FLOPs of one forward and backward pass of ``model(*args)``, counted on the meta device (nothing allocated).

    Sharded (FSDP2) parameters count at their global shape; a forward that reads a value (``.item()``)
    cannot run here: :class:`StepFlopCounter` counts what training runs.

    Args:
        model: Any ``nn.Module`` (a ``torch.compile``-d one is measured through its original module).
        *args: Example inputs; real or meta tensors (only their shapes and dtypes are used).
        forward: Called as ``forward(model, *args)`` instead of ``model(*args)``.
    """
    return _count(model, args, forward)[0]


def model_flops_per_token(module: nn.Module, seq_len: int) -> Optional[float]:
    """Training FLOPs per token from ``module.flops_per_token(seq_len)`` (or without argument); ``None`` without one."""
    fn = getattr(module, "flops_per_token", None)
    if not callable(fn):
        return None
    try:
        takes_arg = len(inspect.signature(fn).parameters) > 0
    except (TypeError, ValueError):
        takes_arg = False
    return float(fn(seq_len) if takes_arg else fn())


def _attention_flops(query: Any, key: Any, value: Any) -> int:
    """``sdpa_flop_count`` of shapes ``(B, H, T, D)``; grouped-query keys and values (fewer heads, ``enable_gqa``)
    count as repeated to the query's heads, as they are computed (torch 2.11's formula refuses them)."""
    if len(query) == 4 and len(key) == 4 and key[1] != query[1] and query[1] % key[1] == 0:
        key, value = (key[0], query[1], *key[2:]), (value[0], query[1], *value[2:])
    return sdpa_flop_count(query, key, value)


def _sdpa_forward(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return _attention_flops(query, key, value)  # Q K^T and P V over the full T x T, causal or not


def _sdpa_backward(
    grad: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    return 2 * _attention_flops(query, key, value)  # the math kernel's four matmuls; no recomputed scores


def _formulas() -> dict[Any, Callable[..., int]]:
    """torch's FLOP formulas by operator, with every SDPA kernel counted as the math kernel computes it."""
    forward, backward = sdpa_ops()  # torch's CPU flash kernel is not in torch's table: 0 there
    attention = {**{op: _sdpa_forward for op in forward}, **{op: _sdpa_backward for op in backward}}
    return {**flop_registry, **{op: shape_wrapper(count) for op, count in attention.items()}}


class _CountingMode(torch_dispatch_mode()):
    """Runs every operator exactly as dispatched (no decomposition) and adds up the FLOPs of those with a formula."""

    def __init__(self) -> None:
        super().__init__()
        self.formulas, self.flops = _formulas(), 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.formulas.get(func.overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out


class StepFlopCounter:
    """Counts the FLOPs of everything that runs between :meth:`start` and :meth:`stop`: one real training step.

    Every operator runs as it would uncounted; ``torch.compile`` runs eagerly in between, so a compiled
    module's operators are seen. Activation checkpointing's recomputation is counted too.

    Example::

        counter = StepFlopCounter()
        counter.start()            # e.g. in on_train_batch_start
        flops = counter.stop()     # e.g. in on_train_batch_end, after the step
    """

    def __init__(self) -> None:
        self._stack: Optional[contextlib.ExitStack] = None
        self._counter: Optional[_CountingMode] = None

    @property
    def running(self) -> bool:
        return self._stack is not None

    def start(self) -> None:
        if self._stack is not None:
            raise RuntimeError("StepFlopCounter.start() called twice without stop()")
        self._counter = _CountingMode()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.compiler.set_stance("force_eager"))
        stack.enter_context(self._counter)
        self._stack = stack

    def stop(self) -> int:
        """End the count; the FLOPs counted since :meth:`start`."""
        if self._stack is None or self._counter is None:
            raise RuntimeError("StepFlopCounter.stop() called before start()")
        stack, self._stack = self._stack, None
        stack.close()
        return self._counter.flops


def count_step_flops(step: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``step()`` once on real tensors and count its FLOPs: ``(its result, FLOPs)``.

    Example::

        _, flops = count_step_flops(lambda: module.training_step(batch, 0).backward())  # a step and its backward
    """
    counter = StepFlopCounter()
    counter.start()
    try:
        result = step()
    finally:
        flops = counter.stop()
    return result, flops
