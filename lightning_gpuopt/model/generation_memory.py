"""How many rows a generation batch can hold on a device: the KV cache and activations against its memory.

Design note: generation memory is the weights, plus per row the KV cache of its context (keys and
values of every layer: ``2 · n_layer · context · n_kv_head · head_size`` elements, ``n_embd`` wide without
grouped-query attention) and the decode step's transient
tensors (the row's logits in the compute dtype and in float32 for sampling, and a few hidden-sized
tensors), plus, once, the largest prefill forward (``batched_generation`` keeps a prefill's float32
logits under ``PREFILL_LOGITS_BYTES``; the probabilities and the logits in the compute dtype come with
them). A margin (a fraction of the memory, plus the CUDA context and allocator slack) is kept free.
The arithmetic reads :class:`~lightning_gpuopt.perf.device.DeviceFacts`, so a CPU test computes the
batch an H100 would get. A CPU has no device memory to size from: the batch is then a fixed number
of rows, and the caller says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_gpuopt.model.batched_generation import PREFILL_LOGITS_BYTES
from lightning_gpuopt.model.config import GPTConfig
from lightning_gpuopt.perf.device import DeviceFacts
from lightning_gpuopt.perf.units import GiB

__all__ = ["CPU_ROWS", "GenerationMemory", "generation_batch_size"]

CPU_ROWS = 64
"""Rows of a generation batch on a device without known memory (a CPU): enough for batching to pay."""

_MARGIN = 0.10  # of the device's memory, kept free
_CUDA_CONTEXT = 1 * GiB  # the CUDA context, cuBLAS workspaces and allocator slack
_HIDDEN_COPIES = 16  # hidden-sized tensors alive in one decode step (qkv, attention output, MLP's 4x, residuals)


@dataclass(frozen=True)
class GenerationMemory:
    """The outcome of :func:`generation_batch_size`.

    Attributes:
        rows: Rows of the batch (``None``: the device's memory is unknown).
        per_row: Bytes one row takes (its KV cache and decode tensors).
        kv_per_row: Bytes of one row's KV cache.
        fixed: Bytes taken whatever the batch: weights, the largest prefill, the margin.
        reason: One line saying how ``rows`` was chosen.
    """

    rows: Optional[int]
    per_row: int
    kv_per_row: int
    fixed: int
    reason: str


def generation_batch_size(
    config: GPTConfig, facts: DeviceFacts, weight_bytes: int, dtype_bytes: int, context: Optional[int] = None,
    most_rows: Optional[int] = None,
) -> GenerationMemory:
    """The largest batch the KV cache and activations allow on ``facts``'s device, with a margin.

    Example::

        mem = generation_batch_size(GPTConfig.from_name("124m"), REFERENCE_DEVICES["H100 SXM"],
                                    weight_bytes=124_000_000 * 2, dtype_bytes=2)
        mem.rows, mem.reason

    Args:
        config: The model's architecture.
        facts: The device.
        weight_bytes: Bytes of the model's weights on the device.
        dtype_bytes: Bytes per element of the KV cache and activations (2 under bf16, 4 in float32).
        context: Columns of a row's cache (``None``: ``config.block_size``).
        most_rows: Rows there are to generate: the batch is never larger.

    Raises:
        ValueError: The weights and one row do not fit in the device's memory.
    """
    context = config.block_size if context is None else context
    width = config.n_kv_head * config.head_size  # the cache holds the grouped key/value heads, not n_head of them
    kv = 2 * config.n_layer * context * width * dtype_bytes
    decode = config.padded_vocab_size * (dtype_bytes + 8) + _HIDDEN_COPIES * config.n_embd * dtype_bytes
    per_row = kv + decode
    prefill_rows = most_rows if most_rows is not None else PREFILL_LOGITS_BYTES  # unknown: as many as a prefill takes
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
        f"{facts.name}, after the weights ({weight_bytes / GiB:.2f} GiB), a prefill and a margin of {margin / GiB:.1f} GiB"
    )
    return GenerationMemory(rows, per_row, kv, fixed - margin, reason)
