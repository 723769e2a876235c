"""The language-model loss from hidden states, one chunk of tokens at a time, never the full float32 logits.

The head matmul and the cross-entropy run together per chunk, so at most one chunk of logits is alive,
and the result is ``F.cross_entropy``'s mean token loss. Under tensor parallelism the same loop runs on
the head's vocabulary shards (Megatron's vocabulary-parallel cross-entropy, chunked). The design, and
why torch's ``F.linear_cross_entropy`` is not used: ``docs/model.md`` ("The loss"); memory and time:
``benchmarks/README.md``."""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Literal, NamedTuple, Optional, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_gpuopt.option_checks import check_choice, check_int

__all__ = [
    "CHUNK_BYTES",
    "LOSS_IMPLS",
    "MAX_CHUNK_BYTES",
    "LossImpl",
    "chunk_budget",
    "chunk_tokens",
    "device_free_bytes",
    "linear_cross_entropy",
    "resolve_loss_impl",
    "run_chunk_tokens",
]

LossImpl = Literal["auto", "chunked", "liger", "plain"]
LOSS_IMPLS: tuple[str, ...] = get_args(LossImpl)


# Bytes for one chunk's logits and their float32 arithmetic (512 MiB): the token count follows the
# vocabulary, and a bf16 chunk (logits + float32 copy, 6 B a logit) weighs what a float32 one (4 B) does.
# The default of a bare call, and the least a run's budget (chunk_budget) gets.
CHUNK_BYTES = 2**29
# The most a run's budget gets (4 GiB): 8,192 bf16 tokens at a vocabulary of 50,304, so a 65,536-token
# micro-batch updates the float32 weight gradient 8 times, not 37 as at 512 MiB (each update reads and
# writes all of it: 155 MB at 124m).
MAX_CHUNK_BYTES = 2**32
# A run's budget is this fraction of the device's free memory at setup, before the model and its
# activations take theirs (an H100's ~79 GB free: 4.9 GB, so the 4 GiB cap).
_FREE_FRACTION = 16

# fp16 holds no number below 6e-8: a softmax entry of 1e-9 (there are many at a vocabulary of 50k)
# would be lost in an fp16 gradient. The fp16 gradient is lifted by this power of two (exact) and the
# lift taken off in float32 after the matmuls; |softmax - one_hot| <= 1, so 2**14 stays below fp16's 65504.
_FP16_LIFT = 2.0**14

# The float8 head (``head_float8``): hidden states and weight in e4m3 (largest 448) scaled by their amax, as
# torchao's tensorwise recipe does, and the logits' gradient in e5m2 by a static scale that needs no amax:
# |softmax - one_hot| <= 1, so 2**15 maps it below e5m2's largest 57344 and keeps entries down to 2**-31
# (e5m2's smallest 2**-16, scaled), well below the 1 / vocabulary of an average softmax entry.
_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_E4M3_MAX = 448.0
_GRAD_SCALE = 2.0**15


def chunk_tokens(vocab_size: int, compute_dtype: torch.dtype, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's logits and their float32 arithmetic fit in ``chunk_bytes``:
    a power of two, so that the usual token counts (micro-batch x a power-of-two sequence) split into
    whole chunks and the padded tail of :func:`linear_cross_entropy`'s compiled path costs nothing.

    Example::

        >>> chunk_tokens(50304, torch.float32), chunk_tokens(50304, torch.bfloat16)
        (2048, 1024)
        >>> chunk_tokens(50304, torch.bfloat16, MAX_CHUNK_BYTES)
        8192
    """
    itemsize = torch.empty((), dtype=compute_dtype).element_size()
    per_logit = itemsize + 4 if itemsize < 4 else itemsize  # bf16: the logit and its float32 copy
    tokens = max(1, chunk_bytes // (vocab_size * per_logit))
    return 1 << (tokens.bit_length() - 1)


def chunk_budget(free_bytes: Optional[int]) -> int:
    """A run's bytes for one chunk (:func:`chunk_tokens`) from the device's free memory at setup: a sixteenth
    of it, at least :data:`CHUNK_BYTES` and at most :data:`MAX_CHUNK_BYTES`; ``None`` (not known): ``CHUNK_BYTES``.

    Example::

        >>> chunk_budget(79 * 10**9) == MAX_CHUNK_BYTES, chunk_budget(4 * 10**9) == CHUNK_BYTES
        (True, True)
    """
    if free_bytes is None:
        return CHUNK_BYTES
    check_int("chunk_budget", "free_bytes", free_bytes, minimum=0)
    return min(max(free_bytes // _FREE_FRACTION, CHUNK_BYTES), MAX_CHUNK_BYTES)


def device_free_bytes(device: torch.device) -> Optional[int]:
    """Free memory of ``device`` now: the CUDA allocator's view (``torch.cuda.mem_get_info``), the host's
    available memory on a CPU (Linux), ``None`` where neither is known."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):  # a platform without these names
            return None
    return None


def run_chunk_tokens(vocab_rows: int, compute_dtype: torch.dtype, free_bytes: Optional[int]) -> int:
    """The chunk of a run: chosen once, at setup, from the free memory then, and kept for the whole run (saved
    with its checkpoints), so the weight gradient is summed in the same order after a resume.

    Example::

        >>> run_chunk_tokens(50304, torch.bfloat16, 79 * 10**9), run_chunk_tokens(50304, torch.bfloat16, None)
        (8192, 1024)
    """
    return chunk_tokens(vocab_rows, compute_dtype, chunk_budget(free_bytes))


def _grad_dtype(compute_dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype of the logits' gradient in the two gradient matmuls."""
    # CUDA multiplies bf16/fp16 operands into a float32 result (mm with out_dtype, float32 accumulation).
    # Elsewhere aten::mm.dtype does not exist (CUDA-only in torch 2.13): float32 there, exact and, without
    # bf16 units, faster.
    if device_type == "cuda" or compute_dtype == torch.float64:
        return compute_dtype
    return torch.float32


def _exp_and_loss(logits: Tensor, targets: Tensor, ignore_index: int):
    """``exp(x - max)`` of the float32 logits (in place in ``x``), its row sums, and the chunk's loss sum."""
    x = logits.float()  # (n, V); the same tensor when the logits are float32
    del logits  # the only reference (the caller passed the matmul itself): bf16 logits die once x exists
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0).unsqueeze(1)  # (n, 1)
    row_max = x.amax(dim=1, keepdim=True)  # (n, 1)
    picked = x.gather(1, safe) - row_max  # (n, 1) target logit, shifted
    exp = x.sub_(row_max).exp_()  # in place (torch.logsumexp would allocate two more (n, V) tensors)
    total = exp.sum(dim=1, keepdim=True)  # (n, 1)
    loss_sum = torch.where(valid, (total.log() - picked).squeeze(1), 0.0).sum()  # logsumexp - target logit
    return exp, total, loss_sum, valid, safe


def _chunk_loss_and_grad(
    h_c: Tensor, w: Tensor, targets: Tensor, ignore_index: int, grad_dtype: torch.dtype, lift: float
) -> tuple[Tensor, Tensor]:
    """Sum of token losses of one chunk and ``lift * d(sum)/d logits`` in ``grad_dtype``, not yet divided by the
    token count (the backward pass applies it, with a GradScaler's scale, to the float32 matmul results)."""
    # The logits are made in the call, so no frame keeps them alive beside their float32 copy.
    exp, total, loss_sum, valid, safe = _exp_and_loss(h_c @ w.t(), targets, ignore_index)  # (n, V) logits
    grad = _minus_one_hot(exp.div_(total), safe)  # softmax - one_hot(target)
    grad.mul_((valid.to(grad.dtype) * lift).unsqueeze(1))  # ignored positions get no gradient
    return loss_sum, grad.to(grad_dtype)


def _minus_one_hot(probs: Tensor, safe: Tensor, owned: Optional[Tensor] = None) -> Tensor:
    """``probs - one_hot(safe)`` (only on the rows where ``owned``, if given); ``probs`` is (n, V), ``safe`` (n, 1)."""
    if torch.compiler.is_compiling():
        # Pointwise, from a comparison with the column index: Inductor fuses it into the softmax's pass.
        # A scatter is a mutation: it would make Inductor write the float32 softmax out, scatter into it
        # and read it back in a second kernel (8 more bytes a logit).
        hot = torch.arange(probs.size(1), device=probs.device) == safe  # (n, V)
        if owned is not None:
            hot = hot & owned.unsqueeze(1)
        return probs - hot.to(probs.dtype)
    # Eagerly each operation is its own pass: the scatter writes n entries in place, where the comparison
    # would make an (n, V) mask and a new (n, V) result.
    one = torch.full_like(safe, -1, dtype=probs.dtype) if owned is None else torch.where(owned, -1.0, 0.0).unsqueeze(1)
    return probs.scatter_add_(1, safe, one.to(probs.dtype))


def _chunk_loss(h_c: Tensor, w: Tensor, targets: Tensor, ignore_index: int) -> Tensor:
    """Sum of token losses of one chunk (evaluation), in the same memory as training."""
    return _exp_and_loss(h_c @ w.t(), targets, ignore_index)[2]


def _to_e4m3(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` in float8 e4m3 scaled by its amax (tensorwise), and the scale that undoes it (``torch._scaled_mm``'s)."""
    amax = x.detach().abs().amax().float().clamp(min=1e-12)
    scaled = (x.float() * (_E4M3_MAX / amax)).clamp(-_E4M3_MAX, _E4M3_MAX)
    return scaled.to(_E4M3), amax / _E4M3_MAX


def _float8_chunk(h_c: Tensor, w8: Tensor, w_inv: Tensor, targets: Tensor, ignore_index: int, needs_grad: bool):
    """The float8 head's chunk: the loss sum and, when ``needs_grad``, ``_GRAD_SCALE * (softmax - one_hot)`` in e5m2
    row-major (n, V) and transposed (V, n), and the chunk's e4m3 hidden states column-major with their scale: the
    operands of the two gradient GEMMs (``torch._scaled_mm`` takes its left operand row-major, its right one
    column-major)."""
    h8, h_inv = _to_e4m3(h_c)  # (n, C), scaled per chunk
    # (n, V) bf16 logits made in the call, so no frame keeps them alive beside their float32 copy; fast accumulation
    # in this forward GEMM only, as torchao's tensorwise recipe does (the gradients' GEMMs accumulate exactly)
    exp, total, loss_sum, valid, safe = _exp_and_loss(
        torch._scaled_mm(h8, w8.t(), h_inv, w_inv, out_dtype=torch.bfloat16, use_fast_accum=True), targets, ignore_index
    )
    if not needs_grad:
        return loss_sum, None, None, None, None
    grad = _minus_one_hot(exp.div_(total), safe)
    grad.mul_((valid.to(grad.dtype) * _GRAD_SCALE).unsqueeze(1))  # ignored positions get no gradient
    g8 = grad.to(_E5M2)  # (n, V)
    del exp, grad  # the float32 softmax (one tensor, changed in place) dies before the transposed copy is made
    return loss_sum, g8, g8.t().contiguous(), h8.t().contiguous().t(), h_inv  # (V, n); (n, C) column-major


class _VocabShard(NamedTuple):
    """This rank's rows of a vocabulary-parallel head: the first row's token id and the group holding the others."""

    start: int
    group: Any


def _shard_logits(h_c: Tensor, w: Tensor, targets: Tensor, ignore_index: int, start: int):
    """This rank's columns of a chunk's float32 logits, their row maxima, and where the targets are."""
    x = (h_c @ w.t()).float()  # (n, V / tp)
    valid = targets != ignore_index
    local = targets - start
    owned = valid & (local >= 0) & (local < x.size(1))  # the target's column is on this rank
    safe = torch.where(owned, local, 0).unsqueeze(1)  # (n, 1)
    return x, x.amax(dim=1, keepdim=True), valid, owned, safe


def _shard_exp(x: Tensor, row_max: Tensor, owned: Tensor, safe: Tensor) -> tuple[Tensor, Tensor]:
    """``exp(x - max)`` in place in ``x``, and this rank's parts of the row sums and of the shifted target logits."""
    picked = torch.where(owned.unsqueeze(1), x.gather(1, safe) - row_max, 0.0)  # (n, 1), zero off this rank
    exp = x.sub_(row_max).exp_()
    return exp, torch.cat((exp.sum(dim=1, keepdim=True), picked), dim=1)  # (n, V / tp), (n, 2)


def _shard_grad(exp: Tensor, total: Tensor, valid: Tensor, owned: Tensor, safe: Tensor, grad_dtype: torch.dtype,
                lift: float) -> Tensor:
    """``lift * (softmax - one_hot)`` on this rank's columns (as ``_chunk_loss_and_grad``)."""
    grad = _minus_one_hot(exp.div_(total), safe, owned)  # the one-hot on the target's rank only
    grad.mul_((valid.to(grad.dtype) * lift).unsqueeze(1))
    return grad.to(grad_dtype)


def _shard_chunk(h_c: Tensor, w: Tensor, targets: Tensor, ignore_index: int, shard: _VocabShard, compile_chunk: bool,
                 grad_dtype: Optional[torch.dtype] = None, lift: float = 1.0) -> tuple[Tensor, Optional[Tensor]]:
    """``_chunk_loss_and_grad`` on this rank's columns, its two row reductions completed over the tensor-parallel
    group (no gradient without ``grad_dtype``: evaluation)."""
    import torch.distributed as dist

    logits, exp_sums, grad_of = (
        (_compiled(f) for f in (_shard_logits, _shard_exp, _shard_grad)) if compile_chunk
        else (_shard_logits, _shard_exp, _shard_grad)
    )
    x, row_max, valid, owned, safe = logits(h_c, w, targets, ignore_index, shard.start)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=shard.group)  # the max over every rank's columns
    exp, sums = exp_sums(x, row_max, owned, safe)
    dist.all_reduce(sums, group=shard.group)  # the softmax denominators and the target logits, whole
    total, picked = sums[:, :1], sums[:, 1:]
    loss_sum = torch.where(valid, (total.log() - picked).squeeze(1), 0.0).sum()
    if grad_dtype is None:
        return loss_sum, None
    return loss_sum, grad_of(exp, total, valid, owned, safe, grad_dtype, lift)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    # Static shapes: every chunk has the run's chunk rows (the tail is padded, _chunk_rows), so one graph
    # serves the run and Inductor sizes its kernels for that row count, not for a symbolic one hinted by
    # whichever call came first. No split reduction: with fewer rows than ~64 per SM (8,192 on an H100)
    # Inductor would split the reduction over the vocabulary into several kernels, which turns its
    # online softmax (max and sum in one pass) off. A per-compile option: the rest of the model keeps it.
    return torch.compile(fn, dynamic=False, options={"split_reductions": False})


def _chunk_rows(tokens: int, chunk_size: int) -> int:
    """The rows of every compiled chunk: ``chunk_size``, or for fewer tokens the next power of two (few shapes)."""
    return chunk_size if tokens >= chunk_size else min(chunk_size, 1 << max(tokens - 1, 1).bit_length())


def _float8_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of 16, as ``torch._scaled_mm`` needs (the weight gradient's GEMM multiplies
    over the chunk's rows)."""
    return max(16, -(-rows // 16) * 16)


def _padded(h_c: Tensor, t_c: Tensor, rows: int, ignore_index: int) -> tuple[Tensor, Tensor]:
    """A chunk of its own storage with ``rows`` rows: zero hidden states and ignored targets below the real ones
    (they add no loss and a zero gradient)."""
    pad = rows - h_c.size(0)
    if pad == 0:
        return h_c.clone(), t_c.clone()
    return F.pad(h_c, (0, 0, 0, pad)), F.pad(t_c, (0, pad), value=ignore_index)


def _mm_into(out: Tensor, a: Tensor, b: Tensor, accumulate: bool) -> None:
    """``out (+)= a @ b`` with ``out`` float32, accumulated there in place (no (V, C) temporary)."""
    if a.dtype != out.dtype and a.device.type != "cuda":
        # The CUDA kernel's arithmetic where torch has no such kernel (tests run the CUDA branch on a CPU):
        # widening bf16/fp16 operands to float32 is exact, and the products are summed in float32 as there.
        a, b = a.to(out.dtype), b.to(out.dtype)
    if a.dtype == out.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif accumulate:  # bf16/fp16 operands on CUDA (see _grad_dtype)
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        torch.mm(a, b, out_dtype=out.dtype, out=out)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, targets, ignore_index, chunk_size, compute_dtype, needs_grad, compile_chunk, shard,
        float8,
    ):
        # A tensor, not a Python number: no host sync. With every target ignored it is inf and the
        # loss 0 * inf = NaN, as F.cross_entropy's mean over no tokens.
        scale = 1.0 / (targets != ignore_index).sum().float()
        if float8:
            loss_sum, grad_h, grad_w = _float8_loop(hidden, weight, targets, ignore_index, chunk_size, needs_grad,
                                                    compile_chunk)
            ctx.scale = scale
            ctx.dtypes = (hidden.dtype, weight.dtype)
            ctx.save_for_backward(grad_h, grad_w)
            return loss_sum * scale
        w, h = weight.to(compute_dtype), hidden.to(compute_dtype)
        grad_dtype = _grad_dtype(compute_dtype, hidden.device.type)
        lift = _FP16_LIFT if grad_dtype == torch.float16 else 1.0
        # The gradient matmuls' operands: on CUDA those of the logits' matmul (the same dtype: no second cast of
        # the float32 weight), elsewhere float32 (the weight itself, no copy)
        w_g, h_g = (w, h) if grad_dtype == compute_dtype else (weight.to(grad_dtype), hidden.to(grad_dtype))
        acc = torch.float64 if compute_dtype == torch.float64 else torch.float32
        loss_sum = hidden.new_zeros((), dtype=torch.float32)
        if shard is None:
            grad_fn = _compiled(_chunk_loss_and_grad) if compile_chunk else _chunk_loss_and_grad
            loss_fn = _compiled(_chunk_loss) if compile_chunk else _chunk_loss
        else:  # this rank's rows of a vocabulary-parallel head (the loss still over the whole vocabulary)
            def grad_fn(h_c, w, t_c, ignore_index, grad_dtype, lift):
                return _shard_chunk(h_c, w, t_c, ignore_index, shard, compile_chunk, grad_dtype, lift)

            def loss_fn(h_c, w, t_c, ignore_index):
                return _shard_chunk(h_c, w, t_c, ignore_index, shard, compile_chunk)[0]
        grad_h = hidden.new_empty(hidden.shape, dtype=acc) if needs_grad[0] else None
        grad_w = weight.new_zeros(weight.shape, dtype=acc) if needs_grad[1] else None
        rows = _chunk_rows(h.size(0), chunk_size)
        for start in range(0, h.size(0), chunk_size):
            end = min(start + chunk_size, h.size(0))
            h_c, t_c = h[start:end], targets[start:end].clone()
            if compile_chunk:
                # Every chunk of one shape (the tail padded), each of its own storage: a view would make the
                # compiled kernel guard on the whole batch's size (the hidden chunk is n x C, small).
                h_c, t_c = _padded(h_c, t_c, rows, ignore_index)
            if grad_h is None and grad_w is None:  # evaluation
                loss_sum += loss_fn(h_c, w, t_c, ignore_index)
                continue
            chunk_loss, g = grad_fn(h_c, w, t_c, ignore_index, grad_dtype, lift)  # g: (rows, V) (V / tp under TP)
            g = g[: end - start]  # the padded rows' gradient is zero
            loss_sum += chunk_loss
            if grad_h is not None:
                _mm_into(grad_h[start:end], g, w_g, accumulate=False)  # (n, C)
            if grad_w is not None:
                _mm_into(grad_w, g.t(), h_g[start:end], accumulate=True)  # (V, C), float32, in place
            del g  # before the next chunk's logits exist: one chunk alive at a time
        ctx.scale = scale / lift
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.save_for_backward(grad_h, grad_w)
        return loss_sum * scale

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        # grad_out carries 1 / accumulation and a GradScaler's scale; with 1 / tokens (and 1 / the fp16
        # lift) it meets the float32 sums here. Scaling costs one pass, checking costs a sync.
        factor = grad_out * ctx.scale
        grad_h = (grad_h * factor).to(ctx.dtypes[0]) if grad_h is not None else None
        grad_w = (grad_w * factor).to(ctx.dtypes[1]) if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None, None, None, None, None


def _float8_loop(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, chunk_size: int,
                 needs_grad: tuple[bool, bool], compile_chunk: bool):
    """The chunk loop of the float8 head: the loss sum and the float32 gradient sums (not yet divided by the token
    count). The weight is cast once (amax, then e4m3 in both layouts); each chunk's three GEMMs run in
    ``torch._scaled_mm`` with float32 results, the logits' in bf16."""
    cast = _compiled(_to_e4m3) if compile_chunk else _to_e4m3  # compiled: the amax, then one fused pass
    w8, w_inv = cast(weight)  # (V, C) row-major: the logits' right operand as w8.t(), column-major
    w8_cols = w8.t().contiguous().t() if needs_grad[0] else None  # (V, C) column-major: the input gradient's
    grad_inv = hidden.new_full((), 1.0 / _GRAD_SCALE, dtype=torch.float32)  # a fill on the device: no host copy
    chunk = _compiled(_float8_chunk) if compile_chunk else _float8_chunk
    grads = needs_grad[0] or needs_grad[1]
    grad_h = hidden.new_empty(hidden.shape, dtype=torch.float32) if needs_grad[0] else None
    grad_w = None
    loss_sum = hidden.new_zeros((), dtype=torch.float32)
    n_all = hidden.size(0)
    # Compiled: every chunk of one shape (the tail padded), as the bf16 loop's; eager: each chunk padded to 16 rows.
    rows = _float8_rows(_chunk_rows(n_all, chunk_size)) if compile_chunk else None
    for start in range(0, n_all, chunk_size):
        end = min(start + chunk_size, n_all)
        h_c, t_c = _padded(hidden[start:end], targets[start:end], rows or _float8_rows(end - start), ignore_index)
        chunk_loss, g8, g8_t, h8_cols, h_inv = chunk(h_c, w8, w_inv, t_c, ignore_index, grads)
        loss_sum += chunk_loss
        if not grads:  # evaluation
            continue
        if grad_h is not None:
            grad_h[start:end] = torch._scaled_mm(g8, w8_cols, grad_inv, w_inv, out_dtype=torch.float32)[: end - start]
        if needs_grad[1]:
            part = torch._scaled_mm(g8_t, h8_cols, grad_inv, h_inv, out_dtype=torch.float32)  # (V, C)
            grad_w = part if grad_w is None else grad_w.add_(part)  # one chunk (the usual case on a GPU): no add
            del part  # added: not alive beside the next chunk's
        del g8, g8_t  # before the next chunk's logits exist: one chunk alive at a time
    if needs_grad[1] and grad_w is None:  # no tokens
        grad_w = weight.new_zeros(weight.shape, dtype=torch.float32)
    return loss_sum, grad_h, grad_w


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


# What "auto" is, per device type: the fastest implementation that keeps the loss's promises (exact float32
# loss, fp16 gradients without underflow, the vocabulary-parallel form) in the loss microbenchmark
# (benchmarks/loss_bench.py), and whether it compiles its chunk kernel when asked to (compile_chunk). CPU:
# measured (benchmarks/results/cpu/loss-bench/: the eager chunk 7.7 s, the compiled one 8.9 s). CUDA: the
# compiled chunk until a GPU measurement exists. Any other device: "chunked" as asked, which runs everywhere.
_AUTO_IMPL = {"cpu": "chunked", "cuda": "chunked"}
_AUTO_COMPILES_CHUNK = {"cpu": False, "cuda": True}


def resolve_loss_impl(impl: str, device: torch.device) -> str:
    """The implementation ``impl`` stands for on ``device``: ``"auto"`` is the measured default of the device type
    (``"chunked"`` on every device today)."""
    check_choice("linear_cross_entropy", "impl", impl, LOSS_IMPLS)
    if impl == "liger" and device.type != "cuda":
        raise ValueError(f"loss_impl='liger' runs on CUDA only, not on {device.type}: use loss_impl='chunked'.")
    return _AUTO_IMPL.get(device.type, "chunked") if impl == "auto" else impl


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int = -1,
    chunk_size: Optional[int] = None,
    impl: LossImpl = "auto",
    compile_chunk: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
    head_float8: bool = False,
) -> Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``, without the full logits.

    Under autocast the matmuls run in the autocast dtype and the loss arithmetic in float32, as
    ``F.cross_entropy(F.linear(hidden, weight).float(), targets)`` would.

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
        chunk_size: Tokens per chunk; ``None``: as many as fit in ``chunk_bytes`` (:func:`chunk_tokens`).
        impl: ``"chunked"`` (this module), ``"liger"`` (Liger-Kernel, CUDA), ``"plain"`` (full logits, the
            reference), or ``"auto"`` (:func:`resolve_loss_impl`).
        compile_chunk: Compile the per-chunk loss and gradient (``"chunked"`` only; under ``"auto"`` only where
            the device's measured default compiles it: on CUDA, not on a CPU, where the eager chunk is faster).
        chunk_bytes: Bytes for one chunk's logits and their float32 arithmetic when ``chunk_size`` is ``None``.
        head_float8: Run the head's three GEMMs (logits, hidden-state and weight gradients) in float8 with
            ``torch._scaled_mm`` (``"chunked"`` only): hidden states and weight in e4m3 scaled by their amax, the
            logits' gradient in e5m2 by a fixed scale (it lies in [-1, 1]); the loss arithmetic stays float32.
            ``Float8Precision`` turns it on where a timing says it pays (``docs/precision.md``). Needs the hidden
            size, the vocabulary rows and the chunk multiples of 16, and a CPU or a GPU with float8 matmuls.
    """
    own = "linear_cross_entropy"
    check_int(own, "chunk_size", chunk_size, minimum=1, optional=True, hint=" (None: from chunk_bytes)")
    check_int(own, "chunk_bytes", chunk_bytes, minimum=1)
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"linear_cross_entropy: targets of shape {tuple(targets.shape)} do not match hidden states of "
            f"shape {tuple(hidden.shape)} (expected {tuple(hidden.shape[:-1])})."
        )
    if impl == "auto" and not _AUTO_COMPILES_CHUNK.get(hidden.device.type, True):
        compile_chunk = False  # this device's measured default: the eager chunk is the faster
    impl = resolve_loss_impl(impl, hidden.device)
    shard = None
    if _is_dtensor(weight):  # a tensor-parallel head, sharded by vocabulary rows
        if impl != "chunked":
            raise ValueError(
                f"loss_impl={impl!r} needs the whole output head on one rank, and under tensor parallelism it is "
                "sharded by vocabulary over the tensor-parallel group: use loss_impl='chunked' (or 'auto'), which "
                "computes the same loss from the shards."
            )
        hidden, weight, shard = _vocab_parallel_operands(hidden, weight)
    device_type = hidden.device.type
    autocast = torch.is_autocast_enabled(device_type)
    compute_dtype = torch.get_autocast_dtype(device_type) if autocast else hidden.dtype
    hidden, targets = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    if head_float8 and impl != "chunked":
        raise ValueError(f"linear_cross_entropy(head_float8=True) runs in the chunked loss: use impl='chunked' (or "
                         f"'auto'), not {impl!r}.")
    if impl == "plain":
        return F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=ignore_index)
    if impl == "liger":
        return _liger(hidden, weight, targets, ignore_index, compute_dtype)
    if chunk_size is None:
        chunk_size = chunk_tokens(weight.size(0), compute_dtype, chunk_bytes)  # this rank's rows under TP
    if head_float8:
        _check_float8_head(shard, hidden, weight, chunk_size)
    return _chunked(hidden, weight, targets, ignore_index, chunk_size, compute_dtype, compile_chunk, shard,
                    head_float8)


def _check_float8_head(shard: Optional[_VocabShard], hidden: Tensor, weight: Tensor, chunk_size: int) -> None:
    own = "linear_cross_entropy(head_float8=True)"
    if shard is not None:
        raise ValueError(
            f"{own} does not run on a tensor-parallel head (vocabulary shards): use head_float8=False there."
        )
    if hidden.size(-1) % 16 or weight.size(0) % 16 or chunk_size % 16:
        raise ValueError(
            f"{own} needs the hidden size ({hidden.size(-1)}), the head's vocabulary rows ({weight.size(0)}) and the "
            f"chunk ({chunk_size} tokens) to be multiples of 16 (torch._scaled_mm's): pad the vocabulary "
            "(GPTConfig.padding_multiple), choose such a chunk_size, or use head_float8=False."
        )


def _is_dtensor(tensor: Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _vocab_parallel_operands(hidden: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, _VocabShard]:
    """The hidden states of every position (gathered; their gradient is reduce-scattered back by DTensor's
    backward), this rank's rows of the head weight, and where those rows start."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(
            f"linear_cross_entropy: a DTensor head weight must be sharded by vocabulary rows over one mesh dimension "
            f"(placements (Shard(0),), as ColwiseParallel shards an output head), got {tuple(weight.placements)} over "
            f"a {mesh.ndim}-D mesh: shard the head with model.tensor_parallel.parallelize_gpt."
        )
    if weight.size(0) % mesh.size() != 0:
        raise ValueError(
            f"linear_cross_entropy: the head's {weight.size(0)} vocabulary rows do not split evenly over "
            f"{mesh.size()} tensor-parallel ranks: pad the vocabulary to a multiple of {mesh.size()} "
            "(GPTConfig.padding_multiple)."
        )
    if not isinstance(hidden, DTensor):  # the same hidden states on every rank
        hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    hidden = hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    local = weight.to_local()
    return hidden, local, _VocabShard(mesh.get_local_rank() * local.size(0), mesh.get_group())


# A whole-model torch.compile stops here and runs the chunk loop eagerly: the loop's length follows the
# token count, and the per-chunk kernel inside is compiled on its own (compile_chunk).
@torch.compiler.disable
def _chunked(hidden, weight, targets, ignore_index, chunk_size, compute_dtype, compile_chunk, shard=None,
             float8=False) -> Tensor:
    grad = torch.is_grad_enabled()
    needs_grad = (grad and hidden.requires_grad, grad and weight.requires_grad)
    with torch.autocast(hidden.device.type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(
            hidden, weight, targets, ignore_index, chunk_size, compute_dtype, needs_grad, compile_chunk, shard, float8
        )
