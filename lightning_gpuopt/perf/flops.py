"""Training FLOPs per token of any model, counted without allocating its memory.

Design note: the FLOPs MFU needs are those of what training runs, the loss included: the
module's ``training_step`` and the backward of its loss. :func:`training_step_flops` counts
exactly that, on meta tensors. ``model(input_ids)`` is a weaker stand-in: a forward without
targets may compute the head for the last position only (karpathy/nanoGPT does), which counts
12-22% too few FLOPs; :func:`forward_positions` tells how many positions such an output covers,
so the caller can say so instead of reporting a low MFU in silence.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from lightning_gpuopt.internals import reparametrize_module, uncompiled

__all__ = [
    "FlopsCount",
    "count_flops_per_token",
    "forward_positions",
    "measure_training_flops",
    "model_flops_per_token",
    "training_step_flops",
]


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
        the FLOPs of the whole model, as MFU needs. A forward without targets may not compute every
        position (see :func:`forward_positions`); :func:`training_step_flops` counts what training runs.
    """
    return _count(model, args, forward)[0]


def forward_positions(model: nn.Module, input_ids: Tensor) -> tuple[int, Optional[int]]:
    """FLOPs of a forward and backward of ``model(input_ids)``, and how many positions its output covers.

    The second value is the size of the output's sequence dimension (dim 1) when the output has one
    and it differs from the input's: nanoGPT's ``forward(idx)`` without targets returns logits of
    shape ``(B, 1, vocab)``, so the count misses the head (and loss) for all but one position.
    ``None`` means the output covers every position (or has no sequence dimension to compare).

    Example::

        flops, covered = forward_positions(model, torch.zeros(2, 64, dtype=torch.long))
        if covered is not None:
            print(f"forward covers {covered} of 64 positions: the count is low")

    Args:
        model: Any ``nn.Module`` taking token ids.
        input_ids: A ``(batch, seq_len)`` tensor (real or meta).
    """
    flops, out = _count(model, (input_ids,), None)
    if input_ids.dim() == 2 and out.dim() >= 2 and out.shape[0] == input_ids.shape[0]:
        if out.shape[1] != input_ids.shape[1]:
            return flops, int(out.shape[1])
    return flops, None


class _NoSideEffects:
    """Runs ``training_step`` of a LightningModule without ``self.log`` and without keeping attribute changes.

    ``log``/``log_dict`` are shadowed on the instance (they would record meta values); every
    submodule's attributes are put back afterwards (a step counter, a cached value), lists and dicts
    as shallow copies. Parameters and buffers are already swapped for meta tensors by the caller.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __enter__(self) -> None:
        self.saved = []
        for m in self.module.modules():
            attrs = {k: v for k, v in m.__dict__.items() if k not in _MODULE_STATE}
            contents = {k: copy.copy(v) for k, v in attrs.items() if type(v) in (list, dict, set)}
            self.saved.append((m, attrs, contents))
        for name in ("log", "log_dict"):
            if hasattr(self.module, name):
                setattr(self.module, name, lambda *args, **kwargs: None)

    def __exit__(self, *exc: Any) -> None:
        for m, attrs, contents in self.saved:
            for k in [k for k in m.__dict__ if k not in attrs and k not in _MODULE_STATE]:
                del m.__dict__[k]
            m.__dict__.update(attrs)
            for k, copied in contents.items():  # the same list/dict/set object, its old contents
                attrs[k].clear()
                attrs[k].update(copied) if not isinstance(copied, list) else attrs[k].extend(copied)


_MODULE_STATE = ("_parameters", "_buffers", "_modules")


def training_step_flops(module: nn.Module, batch: Any, batch_idx: int = 0) -> int:
    """FLOPs of ``module.training_step(batch, batch_idx)`` and the backward of its loss, on meta tensors.

    This is what a training step computes, whatever the module's ``forward`` does without targets:
    the forward, the loss (a dict's ``"loss"`` entry when the step returns a dict) and its backward.
    Parameters, buffers and the batch are meta tensors for the call, ``self.log`` does nothing and
    attribute changes are undone, so the module is left as it was. A step that reads a value
    (``loss.item()``), steps an optimizer itself (manual optimisation) or indexes by data raises:
    count ``forward`` instead, or give the module ``flops_per_token(seq_len)``.

    Example::

        flops = training_step_flops(lightning_module, (input_ids, targets))
        flops_per_token = flops / input_ids.numel()

    Args:
        module: A LightningModule (or any module with ``training_step``).
        batch: A training batch as the loader yields it (real or meta tensors).
        batch_idx: Passed on to ``training_step``.
    """
    if getattr(module, "automatic_optimization", True) is False:
        raise ValueError("the module optimises manually (automatic_optimization=False), so its step cannot be replayed")
    module = uncompiled(module)
    with _NoSideEffects(module):
        return _count(module, (batch, batch_idx), lambda m, b, i: m.training_step(b, i))[0]


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


class FlopsCount(NamedTuple):
    """Training FLOPs per token (``None`` if they could not be counted), how, and what to tell the user."""

    per_token: Optional[float]
    source: Optional[str]
    warning: Optional[str] = None
    info: Optional[str] = None


def count_flops_per_token(
    module: nn.Module, batch: Any, batch_idx: int, tokens: int, input_ids: Optional[Tensor]
) -> FlopsCount:
    """Training FLOPs per token of a module without ``flops_per_token``: its training step, else its forward.

    :func:`training_step_flops` first; where the step cannot run on meta tensors, a forward and
    backward of ``module(input_ids)`` (:func:`forward_positions`), with a warning when its output
    does not cover every position (the count is then low). Never raises: a module that cannot be
    counted gets ``per_token=None`` and a warning naming the fix.

    Example::

        count = count_flops_per_token(lightning_module, batch, 0, tokens=batch[0].numel(), input_ids=batch[0])
        count.per_token, count.source

    Args:
        module: A LightningModule.
        batch: A training batch.
        batch_idx: Its index, passed on to ``training_step``.
        tokens: Tokens in the batch (FLOPs are divided by it).
        input_ids: The batch's token-id tensor, for the forward fallback (``None`` if there is none).
    """
    name = type(module).__name__
    fix = "Define `flops_per_token(seq_len)` on the module or pass MFUMonitor(flops_per_token=...)."
    if tokens <= 0:
        return FlopsCount(None, None, warning=(
            f"found no tokens in the batch of {name}, so TFLOP/s and MFU are not logged: pass "
            "MFUMonitor(tokens_fn=...) or give the batch an input-ids tensor (batch[0] or batch['input_ids'])."
        ))
    try:
        per_token = training_step_flops(module, batch, batch_idx) / tokens
        source = f"{name}.training_step on meta tensors"
        return FlopsCount(per_token, source, info=f"{per_token / 1e6:.4g} MFLOPs per token, counted over {source}.")
    except Exception as err:
        step_error = err
    try:
        if input_ids is None:
            raise ValueError("no input-ids tensor in the batch")
        flops, covered = forward_positions(module, input_ids)
    except Exception as err:  # any model: no FLOPs rather than a stopped run
        return FlopsCount(None, None, warning=(
            f"could not count the FLOPs of {name} (training_step: {step_error}; forward: {err}); TFLOP/s and MFU "
            f"are not logged. {fix}"
        ))
    per_token, source, seq_len = flops / tokens, f"{name}.forward(input_ids) on meta tensors", int(input_ids.shape[-1])
    if covered is not None:
        return FlopsCount(per_token, source, warning=(
            f"FLOPs counted through {name}.forward(input_ids) (its training_step could not run on meta tensors: "
            f"{step_error}), and that forward's output covers {covered} of {seq_len} positions, so TFLOP/s and MFU "
            f"are low. {fix[:-1]}, or let training_step run without reading values (no .item())."
        ))
    return FlopsCount(per_token, source, info=(
        f"{per_token / 1e6:.4g} MFLOPs per token, counted over {source} (training_step could not run on meta "
        f"tensors: {step_error}); the loss is not counted."
    ))
