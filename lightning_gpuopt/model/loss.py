"""The language-model loss from hidden states, without the full logits in float32.

Design note. The head of a GPT maps hidden states ``(N, C)`` to logits ``(N, V)``; with
``V = 50304`` that tensor dwarfs every activation of a block (at N = 32·1024 tokens one float32
copy is 6.6 GB), and a plain ``cross_entropy(logits.float(), targets)`` keeps about three such
copies alive at the backward peak. Here the head matmul and the loss run together, ``chunk_size``
tokens at a time: each chunk's logits are computed, the loss and the gradient of the logits
(``softmax - one_hot``, in float32 arithmetic) are computed from them at once, the gradients of
the hidden states and of the weight follow by two matmuls, and the chunk's logits are freed.
The backward pass only scales the stored gradients by the incoming one. So no more than one
chunk of logits is ever alive, the head costs no extra matmul, and the result is the mean
token loss of ``F.cross_entropy`` (targets equal to ``ignore_index`` count for nothing).
Liger-Kernel's fused linear cross-entropy (``liger_kernel.transformers.functional``) works the same
way with hand-written Triton kernels; ``impl="liger"`` calls it.

The per-chunk loss-and-gradient function is a handful of elementwise operations and one
reduction over the vocabulary; ``compile_chunk=True`` compiles it (once, with a dynamic number of
rows, so any batch size reuses it) into two fused kernels that read each logit twice in bf16.
Eager, it materialises float32 temporaries of one chunk: exact, and what CPU runs use.
"""

from __future__ import annotations

import functools
from typing import Callable, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["LOSS_IMPLS", "LossImpl", "linear_cross_entropy", "resolve_loss_impl"]

LossImpl = Literal["auto", "chunked", "liger", "plain"]
LOSS_IMPLS: tuple[str, ...] = get_args(LossImpl)


def _chunk_loss_and_grad(logits: Tensor, targets: Tensor, ignore_index: int, scale: Tensor) -> tuple[Tensor, Tensor]:
    """Sum of token losses of one chunk and ``d(scale * sum)/d logits``, in the logits' dtype.

    ``logits`` is a temporary of the caller's and is overwritten: eager, the float32 arithmetic
    then needs no tensor beyond one float32 copy of the chunk (none more when it is float32).
    """
    x = logits.float()  # (n, V); the same tensor when the logits are float32
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0).unsqueeze(1)  # (n, 1)
    row_max = x.amax(dim=1, keepdim=True)  # (n, 1)
    picked = x.gather(1, safe) - row_max  # (n, 1) target logit, shifted
    exp = x.sub_(row_max).exp_()  # in place (torch.logsumexp would allocate two more (n, V) tensors)
    total = exp.sum(dim=1, keepdim=True)  # (n, 1)
    loss_sum = torch.where(valid, (total.log() - picked).squeeze(1), 0.0).sum()  # logsumexp - target logit
    grad = exp.div_(total)  # softmax
    grad.scatter_add_(1, safe, torch.full_like(picked, -1.0))  # - one_hot(target)
    grad.mul_((valid.to(grad.dtype) * scale).unsqueeze(1))  # ignored positions get no gradient
    return loss_sum, grad.to(logits.dtype)


def _chunk_loss(logits: Tensor, targets: Tensor, ignore_index: int) -> Tensor:
    """Sum of token losses of one chunk (no gradient: evaluation)."""
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")


@functools.cache
def _compiled(fn: Callable) -> Callable:
    # dynamic=True: one graph for every chunk length (a batch-size search or the last, shorter chunk
    # would otherwise each compile again).
    return torch.compile(fn, dynamic=True)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk_size, compute_dtype, needs_grad, compile_chunk):
        # A tensor, not a Python number: no host sync. With every target ignored it is inf and the
        # loss 0 * inf = NaN, as F.cross_entropy's mean over no tokens.
        scale = 1.0 / (targets != ignore_index).sum().float()
        w = weight.to(compute_dtype)
        h = hidden.to(compute_dtype)
        loss_sum = hidden.new_zeros((), dtype=torch.float32)
        grad_fn = _compiled(_chunk_loss_and_grad) if compile_chunk else _chunk_loss_and_grad
        loss_fn = _compiled(_chunk_loss) if compile_chunk else _chunk_loss
        grad_h = torch.empty_like(hidden) if needs_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if needs_grad[1] else None
        for start in range(0, h.size(0), chunk_size):
            # The targets' slice as a tensor of its own: a view would make the compiled kernel guard on
            # the size of the whole batch's targets and compile again for each batch size.
            h_c, t_c = h[start : start + chunk_size], targets[start : start + chunk_size].clone()
            if grad_h is None and grad_w is None:  # evaluation: the chunk's logits die with the call
                loss_sum += loss_fn(h_c @ w.t(), t_c, ignore_index)
                continue
            logits = h_c @ w.t()  # (n, V): the only vocabulary-sized tensor, one chunk of it
            chunk_loss, g = grad_fn(logits, t_c, ignore_index, scale)
            del logits
            loss_sum += chunk_loss
            if grad_h is not None:
                grad_h[start : start + chunk_size] = g @ w
            if grad_w is not None:
                grad_w += g.t() @ h_c
            del g  # before the next chunk's logits exist: one chunk alive at a time
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        ctx.save_for_backward(grad_h, grad_w)
        return loss_sum * scale

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        # grad_out is 1 / accumulation in a Lightning step; scaling costs one pass, checking costs a sync.
        grad_h = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        grad_w = grad_w * grad_out.to(grad_w.dtype) if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None, None, None


def _liger(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, compute_dtype: torch.dtype) -> Tensor:
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError as err:
        raise ImportError(
            "loss_impl='liger' needs Liger-Kernel: pip install \"lightning-gpuopt[liger]\" (CUDA only), "
            "or use loss_impl='chunked'."
        ) from err
    # Liger's kernels want both operands in the compute dtype; the weight's gradient is accumulated over
    # the chunks in float32 (accum_dtype; by default Liger sums it in the weight's dtype, bf16 here) and
    # autograd casts it to the (float32) parameter's. Note: Liger reads the number of targets with
    # .item() in its forward, one host sync per micro-batch that the chunked path does not have.
    with torch.autocast(hidden.device.type, enabled=False):
        return liger_fused_linear_cross_entropy(
            hidden.to(compute_dtype), weight.to(compute_dtype), targets, ignore_index=ignore_index,
            accum_dtype=torch.float32,
        )


def resolve_loss_impl(impl: str, device: torch.device) -> str:
    """The implementation ``impl`` stands for on ``device`` (``"auto"`` resolved).

    ``"auto"`` is ``"chunked"``: it needs no extra package and runs on every device.

    Args:
        impl: ``"auto"``, ``"chunked"``, ``"liger"`` or ``"plain"``.
        device: Where the loss runs.

    Example::

        >>> resolve_loss_impl("auto", torch.device("cpu"))
        'chunked'
    """
    if impl not in LOSS_IMPLS:
        raise ValueError(f"loss_impl={impl!r} is not one of {list(LOSS_IMPLS)}.")
    if impl == "liger" and device.type != "cuda":
        raise ValueError(f"loss_impl='liger' runs on CUDA only, not on {device.type}: use loss_impl='chunked'.")
    return "chunked" if impl == "auto" else impl


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int = -1,
    chunk_size: int = 4096,
    impl: LossImpl = "auto",
    compile_chunk: bool = False,
) -> Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``, without the full logits.

    Under autocast the matmuls run in the autocast dtype (bf16) and the loss arithmetic in float32,
    as ``F.cross_entropy(F.linear(hidden, weight).float(), targets)`` would; gradients flow to
    ``hidden`` and ``weight`` in their own dtypes.

    Example::

        >>> h, w = torch.randn(6, 16), torch.randn(32, 16)
        >>> y = torch.tensor([1, 2, 3, -1, 5, 6])
        >>> torch.allclose(linear_cross_entropy(h, w, y), F.cross_entropy(h @ w.T, y, ignore_index=-1))
        True

    Args:
        hidden: Final hidden states, ``(..., C)``.
        weight: Output head, ``(V, C)`` (the tied token embedding in a GPT).
        targets: Token ids, ``hidden.shape[:-1]``; ``ignore_index`` marks positions without a target.
        ignore_index: Target value that contributes no loss.
        chunk_size: Tokens per chunk; one chunk's ``(chunk_size, V)`` float32 logits are the largest
            temporary (4096 x 50304 x 4 B = 0.8 GB eager in float32; the compiled chunk keeps them in bf16).
        impl: ``"chunked"`` (this module), ``"liger"`` (Liger-Kernel, CUDA), ``"plain"`` (full
            logits, the reference), or ``"auto"`` (see :func:`resolve_loss_impl`).
        compile_chunk: Compile the per-chunk loss and gradient (``"chunked"`` only).
    """
    if chunk_size < 1:
        raise ValueError(f"linear_cross_entropy chunk_size must be >= 1, got {chunk_size}.")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"linear_cross_entropy: targets of shape {tuple(targets.shape)} do not match hidden states of "
            f"shape {tuple(hidden.shape)} (expected {tuple(hidden.shape[:-1])})."
        )
    impl = resolve_loss_impl(impl, hidden.device)
    device_type = hidden.device.type
    autocast = torch.is_autocast_enabled(device_type)
    compute_dtype = torch.get_autocast_dtype(device_type) if autocast else hidden.dtype
    hidden, targets = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    if impl == "plain":
        return F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=ignore_index)
    if impl == "liger":
        return _liger(hidden, weight, targets, ignore_index, compute_dtype)
    return _chunked(hidden, weight, targets, ignore_index, chunk_size, compute_dtype, compile_chunk)


# A whole-model torch.compile stops here and runs the chunk loop eagerly: the loop's length follows the
# token count, and the per-chunk kernel inside is compiled on its own (compile_chunk).
@torch.compiler.disable
def _chunked(hidden, weight, targets, ignore_index, chunk_size, compute_dtype, compile_chunk) -> Tensor:
    grad = torch.is_grad_enabled()
    needs_grad = (grad and hidden.requires_grad, grad and weight.requires_grad)
    with torch.autocast(hidden.device.type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(
            hidden, weight, targets, ignore_index, chunk_size, compute_dtype, needs_grad, compile_chunk
        )
