"""How many rows a generation batch can hold on a device: the KV cache and activations against its memory.

From :class:`~lightning_gpuopt.perf.device.DeviceFacts`, so a CPU test computes the batch an H100 would
get (the KV cache holds the grouped key/value heads: ``n_kv_head`` wide); a CPU has no device memory to size from and
gets :data:`CPU_ROWS`. The arithmetic: ``docs/generation.md``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from lightning_gpuopt.generation.batched import PREFILL_LOGITS_BYTES
from lightning_gpuopt.perf.device import DeviceFacts
from lightning_gpuopt.perf.units import GiB

__all__ = ["CPU_ROWS", "CacheShape", "GenerationMemory", "generation_batch_size"]

CPU_ROWS = 64  # rows of a batch on a device without known memory (a CPU): enough for batching to pay

_MARGIN = 0.10  # of the device's memory, kept free
_CUDA_CONTEXT = 1 * GiB  # the CUDA context, cuBLAS workspaces and allocator slack
_HIDDEN_COPIES = 16  # hidden-sized tensors alive in one decode step (qkv, attention output, MLP's 4x, residuals)


class CacheShape(Protocol):
    """What the arithmetic reads of a model's config (``GPTConfig`` has every field): generation sits below the
    model, so it names the fields rather than the class."""

    block_size: int
    n_layer: int
    n_kv_head: int
    head_size: int
    n_embd: int
    padded_vocab_size: int


@dataclass(frozen=True)
class GenerationMemory:
    """The outcome of :func:`generation_batch_size`."""

    rows: Optional[int]  # rows of the batch (None: the device's memory is unknown)
    per_row: int  # bytes one row takes (its KV cache and decode tensors)
    kv_per_row: int  # bytes of one row's KV cache
    fixed: int  # bytes taken whatever the batch: weights, the largest prefill
    reason: str  # one line saying how rows was chosen


def generation_batch_size(
    config: CacheShape, facts: DeviceFacts, weight_bytes: int, dtype_bytes: int, context: Optional[int] = None,
    most_rows: Optional[int] = None,
) -> GenerationMemory:
    """The largest batch the KV cache and activations allow on ``facts``'s device, with a margin.

    Args:
        config: The model's architecture (a ``GPTConfig``).
        facts: The device.
        weight_bytes: Bytes of the model's weights on the device.
        dtype_bytes: Bytes per element of the KV cache and activations (2 under bf16, 4 in float32).
        context: Columns of a row's cache (``None``: ``config.block_size``).
        most_rows: Rows there are to generate: the batch is never larger.
    """
    context = config.block_size if context is None else context
    width = config.n_kv_head * config.head_size  # the cache holds the grouped key/value heads, not n_head of them
    kv = 2 * config.n_layer * context * width * dtype_bytes
    # the decode step's transient tensors: the row's logits in the compute dtype and in float32 for sampling, and a
    # few hidden-sized ones
    decode = config.padded_vocab_size * (dtype_bytes + 8) + _HIDDEN_COPIES * config.n_embd * dtype_bytes
    per_row = kv + decode
    prefill_rows = most_rows if most_rows is not None else PREFILL_LOGITS_BYTES  # unknown: as many as a prefill takes
    # once, the largest prefill: its float32 logits (capped), with their probabilities and the compute-dtype logits
    prefill = 3 * min(PREFILL_LOGITS_BYTES, 4 * context * config.padded_vocab_size * prefill_rows)
    if facts.total_memory is None:
        rows = CPU_ROWS if most_rows is None else min(CPU_ROWS, most_rows)
        return GenerationMemory(rows, per_row, kv, weight_bytes + prefill,
                                f"{rows} rows ({facts.type}: no device memory to size the batch from)")
    margin = int(_MARGIN * facts.total_memory) + _CUDA_CONTEXT
    fixed = weight_bytes + prefill + margin
    fit = (facts.total_memory - fixed) // per_row
    if fit < 1:
        raise ValueError(
            f"Generation does not fit on {facts.describe()}: the weights ({weight_bytes / GiB:.1f} GiB), a prefill "
            f"({prefill / GiB:.1f} GiB) and one row's KV cache ({kv / GiB:.2f} GiB) leave nothing of "
            f"{facts.total_memory / GiB:.1f} GiB after a margin of {margin / GiB:.1f} GiB: load the weights in bf16 "
            "(--trainer.precision bf16-true) or use a device with more memory."
        )
    rows = int(fit if most_rows is None else min(fit, most_rows))
    capped = "" if rows == fit else f", of {int(fit)} that fit"
    reason = (
        f"{rows} rows{capped}: each row's KV cache takes {kv / 2**20:.1f} MiB ({context} positions x {config.n_layer} "
        f"layers x {width} x 2 x {dtype_bytes} bytes) of {facts.total_memory / GiB:.1f} GiB on "
        f"{facts.name}, after the weights ({weight_bytes / GiB:.2f} GiB), a prefill and a margin of {margin / GiB:.1f} "
        "GiB"
    )
    return GenerationMemory(rows, per_row, kv, fixed - margin, reason)
