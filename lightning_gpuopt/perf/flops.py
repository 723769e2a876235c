"""Training FLOPs per token of any model, counted without allocating its memory."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["measure_training_flops", "model_flops_per_token"]


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


def measure_training_flops(model: nn.Module, *args: Any, forward: Optional[Callable[..., Any]] = None) -> int:
    """FLOPs of one forward and backward pass of ``model(*args)``, counted on the meta device.

    The model's parameters and buffers are replaced, for this call only, by meta tensors of the same
    shapes (``torch.func.functional_call``): nothing is copied and no memory is allocated, so this
    works for models that fill the GPU. Matmuls, convolutions and attention are counted by
    ``torch.utils.flop_counter.FlopCounterMode``; element-wise operations are not (as in MFU).

    Example::

        flops = measure_training_flops(model, torch.zeros(8, 512, dtype=torch.long))
        flops_per_token = flops / (8 * 512)

    Args:
        model: Any ``nn.Module`` (a ``torch.compile``-d one is measured through its original module).
        *args: Example inputs; real or meta tensors (only their shapes and dtypes are used).
        forward: Called as ``forward(model, *args)`` instead of ``model(*args)``.

    Note:
        Sharded (FSDP2 ``DTensor``) parameters are counted at their global shape, so the result is
        the FLOPs of the whole model, as MFU needs.
    """
    model = getattr(model, "_orig_mod", model)  # torch.compile wrapper
    params = {}
    # Each shared tensor once (tied embeddings): functional_call ties the other names to it.
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        meta = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
        params[name] = meta.requires_grad_(tensor.requires_grad and tensor.is_floating_point())
    meta_args = _to_meta(args)

    def run() -> Any:
        if forward is None:
            return functional_call(model, params, meta_args, tie_weights=True, strict=False)
        with torch.nn.utils.stateless._reparametrize_module(model, params, tie_weights=True):
            return forward(model, *meta_args)

    counter = FlopCounterMode(display=False)
    was_training = model.training
    model.train()
    try:
        with torch.compiler.set_stance("force_eager"), counter:
            out = _first_tensor(run())
            out.float().sum().backward()
    finally:
        model.train(was_training)
    return int(counter.get_total_flops())


def model_flops_per_token(module: nn.Module, seq_len: int) -> Optional[float]:
    """Training FLOPs per token from ``module.flops_per_token(seq_len)`` (or without argument); ``None`` without one.

    Args:
        module: A module that may define ``flops_per_token``, such as ``GPTModule``.
        seq_len: Sequence length of the batch, for the attention term.
    """
    fn = getattr(module, "flops_per_token", None)
    if not callable(fn):
        return None
    try:
        takes_arg = len(inspect.signature(fn).parameters) > 0
    except (TypeError, ValueError):
        takes_arg = False
    return float(fn(seq_len) if takes_arg else fn())
