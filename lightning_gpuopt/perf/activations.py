"""Activation memory of any model's training step: the tensors autograd saves, counted on meta tensors.

Attention is counted as the fused kernels save it; how each byte is counted: ``docs/parallel.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from lightning_gpuopt.internals import disable_torch_function, reparametrize_module, tensor_base, uncompiled

__all__ = ["ActivationBytes", "measure_activation_bytes", "measure_step_activation_bytes"]

_LOGIT_BYTES = 10  # 16-bit logits, their float32 copy for the loss, and its gradient
_LOGIT_GRAD_BYTES = 4  # the float32 gradient of the logits alone (a training step saves the rest itself)


class ActivationBytes(NamedTuple):
    """``saved``: bytes autograd keeps for the backward; ``logits``: bytes of the logits over every position."""

    saved: int
    logits: int

    @property
    def total(self) -> int:
        return self.saved + self.logits


class _FusedAttention(torch.autograd.Function):
    """SDPA that saves for backward what the fused kernels do: q, k, v, output and a log-sum-exp."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, kwargs: dict) -> Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
        lse = torch.empty(out.shape[:-1], dtype=torch.float32, device=out.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # pragma: no cover - never run: only the saved tensors are counted
        raise RuntimeError("measure_activation_bytes does not run a backward")


class _AsFusedAttention(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is Tensor.__getitem__ and len(args) == 2 and isinstance(args[1], str):
            # forward(batch) reading batch["input_ids"]: torch would index the ids by the string's characters
            raise TypeError(f"the forward indexes its input with {args[1]!r}: it takes a mapping, not a tensor of "
                            "token ids")
        if func is torch.nn.functional.scaled_dot_product_attention and len(args) >= 3:
            with disable_torch_function():
                return _FusedAttention.apply(
                    args[0],
                    args[1],
                    args[2],
                    dict(kwargs, **dict(zip(("attn_mask", "dropout_p", "is_causal"), args[3:]))),
                )
        return func(*args, **kwargs)


def _meta_params(model: nn.Module) -> dict[str, Tensor]:
    params: dict[str, Tensor] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        meta = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
        params[name] = meta.requires_grad_(tensor.requires_grad and tensor.is_floating_point())
    return params


def _saved_bytes(
    model: nn.Module, params: dict[str, Tensor], run: Callable[[], Any], precision: str
) -> tuple[int, Any]:
    """Bytes of the tensors ``run()`` saves for backward (each storage once, parameters not), and its output."""
    skip = {id(t) for t in params.values()}
    mixed = str(precision).endswith("-mixed")
    seen: dict[int, Tensor] = {}  # id -> tensor, kept alive so ids are not reused

    def pack(t: Tensor) -> Any:
        base = tensor_base(t)
        if id(base) not in skip and id(base) not in seen:
            seen[id(base)] = base
        return t

    was_training = model.training
    model.train()
    try:
        with (
            torch.compiler.set_stance("force_eager"),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            _AsFusedAttention(),
        ):
            out = run()
    finally:
        model.train(was_training)
    total = sum(t.numel() * (2 if mixed and t.dtype == torch.float32 else t.element_size()) for t in seen.values())
    return total, out


def measure_activation_bytes(model: nn.Module, input_ids: Tensor, precision: str = "bf16-mixed") -> ActivationBytes:
    """Bytes of the tensors ``model(input_ids)`` saves for its backward, and of its logits, counted on meta tensors.

    Args:
        model: Any ``nn.Module`` whose forward takes a ``(batch, seq_len)`` tensor of token ids.
        input_ids: The input (real or meta; only its shape and dtype are used).
        precision: The Trainer's precision string; with ``*-mixed`` float32 activations count 2 bytes.
    """
    model = uncompiled(model)
    params = _meta_params(model)
    ids = torch.empty_like(input_ids, device="meta")
    total, out = _saved_bytes(
        model, params, lambda: functional_call(model, params, (ids,), tie_weights=True, strict=False), precision
    )
    logits = _logits(out)
    # (B, T, vocab) logits, or nanoGPT's (B, 1, vocab) for the last position: a vocabulary per position
    covers = logits is not None and logits.dim() == input_ids.dim() + 1 and logits.shape[0] == input_ids.shape[0]
    vocab = logits.shape[-1] if covers and logits.shape[1] in (1, input_ids.shape[1]) else 0
    return ActivationBytes(total, input_ids.numel() * vocab * _LOGIT_BYTES)


_READS = {torch.Tensor.item: 1, torch.Tensor.__bool__: True, torch.Tensor.__float__: 1.0, torch.Tensor.__int__: 1}


class _StandInReads(TorchFunctionMode):
    """Answers a host read of a meta tensor (``.item()``, ``bool()``, ...) with 1, and counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if func in _READS and args and isinstance(args[0], Tensor) and args[0].is_meta:
            self.reads += 1
            value = _READS[func]
            return bool(value) if args[0].dtype == torch.bool and func is torch.Tensor.item else value
        return func(*args, **(kwargs or {}))


def measure_step_activation_bytes(
    module: nn.Module, batch: Any, precision: str = "bf16-mixed"
) -> tuple[ActivationBytes, int]:
    """Bytes of the tensors ``module.training_step(batch, 0)`` saves for its backward, on meta tensors, and
    how many host reads were answered with 1 to let it run (an estimate, not a count).

    Args:
        module: A LightningModule (or any module with ``training_step``) using automatic optimisation.
        batch: A training batch as the loader yields it (real or meta tensors; shapes and dtypes are used).
        precision: The Trainer's precision string; with ``*-mixed`` float32 activations count 2 bytes.
    """
    if getattr(module, "automatic_optimization", True) is False:
        raise ValueError("the module optimises manually (automatic_optimization=False): its step needs a Trainer")
    module = uncompiled(module)
    params = _meta_params(module)
    meta_batch = _to_meta(batch)
    reads = _StandInReads()
    shadowed = [name for name in ("log", "log_dict") if hasattr(module, name) and name not in module.__dict__]
    for name in shadowed:
        setattr(module, name, lambda *args, **kwargs: None)
    # The vocabulary: the largest embedding table. The logits and the loss's copies are saved tensors; their
    # float32 gradient, allocated in the backward, is not, and is added apart.
    vocab = max((m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)), default=0)
    try:
        with reparametrize_module(module, params), reads:
            total, _ = _saved_bytes(module, params, lambda: module.training_step(meta_batch, 0), precision)
    finally:
        for name in shadowed:
            delattr(module, name)
    ids = next((t for t in _tensors(batch) if not t.is_floating_point() and t.dim() >= 2), None)
    tokens = ids.numel() if ids is not None else 0
    return ActivationBytes(total, tokens * vocab * _LOGIT_GRAD_BYTES), reads.reads


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (tuple, list)) else []
    return [t for item in items for t in _tensors(item)]


def _to_meta(value: Any) -> Any:
    if isinstance(value, Tensor):
        return torch.empty_like(value, device="meta")
    if isinstance(value, Mapping):
        return {k: _to_meta(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    return value


def _logits(out: Any) -> Any:
    if isinstance(out, Mapping):
        out = out.get("logits", next(iter(out.values()), None))
    if isinstance(out, (tuple, list)):
        out = out[0] if out else None
    return out if isinstance(out, Tensor) and out.is_floating_point() else None
