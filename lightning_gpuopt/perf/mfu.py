"""MFU arithmetic: the peaks MFU divides by, the metrics of one timing window, and the end-of-fit report.

Plain functions, no Trainer: :class:`~lightning_gpuopt.callbacks.MFUMonitor` times the windows,
counts tokens and FLOPs, and calls these. MFU is against the device's dense **bf16** peak whatever
the run computes in (the usual convention, so fp32, bf16 and fp8 runs compare on one scale); fp8
runs also get ``perf/mfu_fp8`` against the fp8 peak.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gpuopt.perf.device import DeviceFacts
from lightning_gpuopt.perf.peaks import peak_flops as table_peak_flops
from lightning_gpuopt.perf.units import GiB

__all__ = [
    "MFU_DTYPES",
    "input_ids_of",
    "memory_stats",
    "mfu_peaks",
    "summarise_windows",
    "window_metrics",
]

MFU_DTYPE = "bf16"
MFU_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
"""Matmul dtypes ``MFUMonitor(dtype=...)`` accepts."""


def input_ids_of(batch: Any) -> Optional[Tensor]:
    """The token-id tensor of a batch: ``batch[0]`` of a tuple, ``batch["input_ids"]`` of a dict, or the batch.

    Example::

        >>> input_ids_of({"input_ids": torch.zeros(2, 16, dtype=torch.long)}).shape
        torch.Size([2, 16])

    Args:
        batch: A training batch; anything else gives ``None``.
    """
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], Tensor):
        return batch[0]
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), Tensor):
        return batch["input_ids"]
    return None


def memory_stats(facts: DeviceFacts) -> dict[str, float]:
    """``mem/*`` metrics of a CUDA device in GiB (no synchronisation); empty elsewhere.

    Example::

        memory_stats(read_device("cuda:0"))  # {"mem/allocated_gb": 12.3, ..., "mem/peak_pct": 41.0}

    Args:
        facts: The training device (:func:`~lightning_gpuopt.perf.device.read_device`).
    """
    if not facts.is_cuda or not facts.total_memory:
        return {}
    device = torch.device("cuda", facts.index)
    # Measurements of the run's own GPU: what its caching allocator holds now and at its peak.
    peak = torch.cuda.max_memory_allocated(device)
    return {
        "mem/allocated_gb": torch.cuda.memory_allocated(device) / GiB,
        "mem/reserved_gb": torch.cuda.memory_reserved(device) / GiB,
        "mem/peak_gb": peak / GiB,
        "mem/peak_pct": 100 * peak / facts.total_memory,
    }


def mfu_peaks(
    facts: DeviceFacts, dtype: str, peak_flops: Optional[float] = None
) -> tuple[Optional[float], Optional[float], str]:
    """``(bf16 peak, fp8 peak, device name)`` in FLOP/s for MFU on a device; a peak is ``None`` when unknown.

    Example::

        mfu_peaks(REFERENCE_DEVICES["H100 SXM"], "fp8")  # (989.4e12, 1978.9e12, "NVIDIA H100 80GB HBM3")

    Args:
        facts: The training device (peaks are looked up for CUDA devices only, by the name in ``facts``).
        dtype: The run's matmul dtype (``fp8`` adds the fp8 peak).
        peak_flops: The user's dense bf16 peak, which replaces the table's.
    """
    peak = peak_fp8 = None
    if facts.is_cuda:
        name = facts.name
        peak = table_peak_flops(name, MFU_DTYPE)  # the fp16 peak where the GPU has no bf16 tensor cores
        if dtype == "fp8":
            peak_fp8 = table_peak_flops(name, "fp8")
    else:
        name = f"a {facts.type} device"
    if peak_flops is not None:
        peak = peak_flops
    return peak, peak_fp8, name


def window_metrics(
    *,
    tokens: int,
    flops: Optional[float],
    elapsed: float,
    steps: int,
    wait: float,
    replicas: int,
    peak: Optional[float] = None,
    peak_fp8: Optional[float] = None,
    measured_peak: Optional[float] = None,
) -> dict[str, float]:
    """The ``perf/*`` metrics of one window of ``steps`` optimizer steps (see ``MFUMonitor``'s key table).

    Example::

        >>> m = window_metrics(tokens=8192, flops=8192 * 1e9, elapsed=2.0, steps=4, wait=0.1, replicas=2, peak=1e13)
        >>> m["perf/tokens_per_sec"], m["perf/mfu"], m["perf/step_time_ms"]
        (8192.0, 0.4096, 500.0)

    Args:
        tokens: Tokens this device trained on in the window.
        flops: Model FLOPs of those tokens; ``None`` when some micro-batch's count is unknown.
        elapsed: Seconds the window took (synchronised at both ends).
        steps: Optimizer steps in the window.
        wait: Seconds spent waiting for batches.
        replicas: Data-parallel size (:func:`~lightning_gpuopt.perf.parallel.data_parallel_size`).
        peak: Dense bf16 peak FLOP/s per device, for ``perf/mfu``.
        peak_fp8: fp8 peak, for ``perf/mfu_fp8``.
        measured_peak: A timed bf16 matmul's FLOP/s, for ``perf/mfu_measured``.
    """
    elapsed = max(elapsed, 1e-12)
    per_device = tokens / elapsed
    metrics = {
        "perf/tokens_per_sec": per_device * replicas,
        "perf/tokens_per_sec_per_device": per_device,
        "perf/step_time_ms": 1000 * elapsed / steps,
        "perf/dataloader_wait_pct": 100 * wait / elapsed,
    }
    if flops is not None:
        achieved = flops / elapsed
        metrics["perf/tflops_per_device"] = achieved / 1e12
        for key, divisor in (("perf/mfu", peak), ("perf/mfu_fp8", peak_fp8), ("perf/mfu_measured", measured_peak)):
            if divisor is not None:
                metrics[key] = achieved / divisor
    return metrics


def _advice(
    history: list[dict[str, float]], mean: dict[str, float], dtype: str, on_cuda: bool, compiled: bool
) -> list[str]:
    advice = []
    peak_pct = max((m["mem/peak_pct"] for m in history if "mem/peak_pct" in m), default=None)
    if peak_pct is not None and peak_pct < 50:
        advice.append(
            f"Memory is mostly unused (peak {peak_pct:.0f}%): raise the micro-batch size (fewer "
            "accumulation steps) or add the AutoBatchSize callback."
        )
    if mean["perf/dataloader_wait_pct"] > 5:
        advice.append(
            f"The model waits for data {mean['perf/dataloader_wait_pct']:.0f}% of the time: raise the DataLoader's "
            "num_workers (TextDataModule(num_workers=...)) or pin_memory."
        )
    if dtype == "fp32" and on_cuda:
        advice.append(
            "Matmuls run in fp32 without TF32: add CUDASettings(tf32=True) or train with precision='bf16-mixed'."
        )
    if dtype == "fp8" and not compiled:
        advice.append("FP8 without torch.compile leaves most of its speed-up unused: compile the model.")
    return advice


def summarise_windows(
    history: list[dict[str, float]],
    *,
    window: int,
    warmup_steps: int,
    dtype: str,
    total_tokens: int,
    total_flops: float,
    on_cuda: bool = False,
    compiled: bool = False,
) -> dict[str, Any]:
    """The end-of-fit report: ``{"text", "advice", "mean"}`` from the logged windows, with advice that names the fix.

    Example::

        report = summarise_windows(monitor.history, window=20, warmup_steps=3, dtype="bf16",
                                   total_tokens=10**6, total_flops=1e15, on_cuda=True)
        print(report["text"])

    Args:
        history: The metrics of every logged window (:func:`window_metrics` plus ``mem/*``).
        window: Optimizer steps per window.
        warmup_steps: Optimizer steps left out at the start.
        dtype: The matmul dtype of the run.
        total_tokens: Tokens per device in the fit.
        total_flops: Model FLOPs of those tokens.
        on_cuda: Whether the run is on a CUDA device (the fp32 advice applies there only).
        compiled: Whether the module runs under ``torch.compile`` (the fp8 advice).
    """
    if not history:
        text = (
            f"MFUMonitor: the run was too short to measure: it needs {warmup_steps + window} optimizer steps "
            f"(warmup_steps={warmup_steps} + log_every_n_steps={window})."
        )
        return {"text": text, "advice": []}
    keys = {k for m in history for k in m}
    mean = {k: sum(m[k] for m in history if k in m) / sum(k in m for m in history) for k in keys}
    lines = [f"MFUMonitor report ({len(history)} windows of {window} steps, {dtype} matmuls):"]
    if "perf/mfu" in mean:
        fp8 = f" (fp8 peak: {100 * mean['perf/mfu_fp8']:.1f}%)" if "perf/mfu_fp8" in mean else ""
        lines.append(f"  MFU {100 * mean['perf/mfu']:.1f}%{fp8}")
    if "perf/tflops_per_device" in mean:
        lines.append(f"  {mean['perf/tflops_per_device']:.3g} TFLOP/s per device")
    lines.append(f"  {mean['perf/tokens_per_sec']:,.0f} tokens/s ({mean['perf/step_time_ms']:.1f} ms/step)")
    if "mem/peak_pct" in mean:
        lines.append(f"  peak memory {max(m.get('mem/peak_pct', 0) for m in history):.0f}% of the device")
    lines.append(f"  data-loader wait {mean['perf/dataloader_wait_pct']:.1f}%")
    lines.append(f"  {total_tokens:,} tokens per device in this fit ({total_flops / 1e12:.3g} model TFLOP)")
    advice = _advice(history, mean, dtype, on_cuda, compiled)
    lines += [f"  advice: {a}" for a in advice]
    return {"text": "\n".join(lines), "advice": advice, "mean": mean}
