"""Activation memory of any model's training step, measured on meta tensors.

Design note: the activations a training step holds at its peak are the tensors autograd saves
for the backward. :func:`measure_activation_bytes` runs ``forward(input_ids)`` on meta tensors (no
memory is allocated) under ``torch.autograd.graph.saved_tensors_hooks`` and adds up what is saved:
each storage once (a view counts as its base tensor, so q, k and v split from one projection count
once), parameters not at all (they are model state, counted apart). Attention through
``F.scaled_dot_product_attention`` is counted as the fused GPU kernels (Flash, cuDNN, memory-efficient)
save it: q, k, v, the output and a float32 log-sum-exp per row, not the ``T x T`` scores the math
kernel that runs on meta tensors would keep. Under 16-bit mixed precision the
float32 tensors are counted at 2 bytes, as autocast would run the matmuls that make most of them in
bf16/fp16; norms and softmaxes that autocast keeps in float32 are undercounted by that rule, which
the caller's headroom absorbs. The forward without targets may skip the loss and part of the head
(nanoGPT's computes the last position only), so the logits are counted apart, for every position, by
the rule ``choose_strategy`` states: 10 bytes per logit (16-bit logits, their float32 copy for the
loss, and its gradient), the vocabulary read from the last dimension of the output.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from lightning_gpuopt.internals import disable_torch_function, tensor_base, uncompiled

__all__ = ["ActivationBytes", "measure_activation_bytes"]

_LOGIT_BYTES = 10  # 16-bit logits, their float32 copy for the loss, and its gradient


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
            raise TypeError(f"the forward indexes its input with {args[1]!r}: it takes a mapping, not a tensor of token ids")
        if func is torch.nn.functional.scaled_dot_product_attention and len(args) >= 3:
            with disable_torch_function():
                return _FusedAttention.apply(args[0], args[1], args[2], dict(kwargs, **dict(zip(("attn_mask", "dropout_p", "is_causal"), args[3:]))))
        return func(*args, **kwargs)


def measure_activation_bytes(model: nn.Module, input_ids: Tensor, precision: str = "bf16-mixed") -> ActivationBytes:
    """Bytes of the tensors ``model(input_ids)`` saves for its backward, and of its logits, counted on meta tensors.

    Example::

        est = measure_activation_bytes(model, torch.zeros(8, 1024, dtype=torch.long, device="meta"))
        est.total / 1e9  # GB for one micro-batch of 8 x 1024 tokens

    Args:
        model: Any ``nn.Module`` whose forward takes a ``(batch, seq_len)`` tensor of token ids.
        input_ids: The input (real or meta; only its shape and dtype are used).
        precision: The Trainer's precision string; with ``*-mixed`` float32 activations count 2 bytes.
    """
    model = uncompiled(model)
    params: dict[str, Tensor] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        meta = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
        params[name] = meta.requires_grad_(tensor.requires_grad and tensor.is_floating_point())
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
        with torch.compiler.set_stance("force_eager"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _AsFusedAttention():
            out = functional_call(model, params, (torch.empty_like(input_ids, device="meta"),), tie_weights=True, strict=False)
    finally:
        model.train(was_training)
    total = 0
    for t in seen.values():
        size = 2 if mixed and t.dtype == torch.float32 else t.element_size()
        total += t.numel() * size
    logits = _logits(out)
    # (B, T, vocab) logits, or nanoGPT's (B, 1, vocab) for the last position: a vocabulary per position
    covers = logits is not None and logits.dim() == input_ids.dim() + 1 and logits.shape[0] == input_ids.shape[0]
    vocab = logits.shape[-1] if covers and logits.shape[1] in (1, input_ids.shape[1]) else 0
    return ActivationBytes(total, input_ids.numel() * vocab * _LOGIT_BYTES)


def _logits(out: Any) -> Any:
    if isinstance(out, Mapping):
        out = out.get("logits", next(iter(out.values()), None))
    if isinstance(out, (tuple, list)):
        out = out[0] if out else None
    return out if isinstance(out, Tensor) and out.is_floating_point() else None
