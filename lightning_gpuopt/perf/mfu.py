"""MFU arithmetic: the peaks MFU divides by, the metrics of one timing window, and the end-of-fit report.

Plain functions called by ``MFUMonitor``. MFU is against the dense bf16 peak whatever the run computes
in, and counts real tokens only, padding left out (``docs/callbacks.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gpuopt.option_checks import option
from lightning_gpuopt.perf.device import DeviceFacts
from lightning_gpuopt.perf.peaks import peak_flops as table_peak_flops
from lightning_gpuopt.perf.units import GiB

__all__ = [
    "MFU_DTYPES",
    "TokenTally",
    "WindowTotals",
    "attended_count",
    "fp8_weighted_peak",
    "input_ids_of",
    "memory_stats",
    "mfu_peaks",
    "padding_unreadable",
    "real_tokens_of",
    "summarise_windows",
    "window_metrics",
]

MFU_DTYPE = "bf16"  # MFU's peak whatever the run computes in: fp32, bf16 and fp8 runs compare on one scale
MFU_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")  # what MFUMonitor(dtype=...) accepts


def input_ids_of(batch: Any) -> Optional[Tensor]:
    """The token-id tensor of a batch: ``batch[0]`` of a tuple, ``batch["input_ids"]`` of a dict, or the batch,
    when it holds integers; ``None`` otherwise (float features are not tokens)."""
    if isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]
    elif isinstance(batch, Mapping):
        batch = batch.get("input_ids")
    if isinstance(batch, Tensor) and not (batch.is_floating_point() or batch.is_complex() or batch.dtype == torch.bool):
        return batch
    return None


def real_tokens_of(batch: Any) -> Optional[tuple[Tensor, str]]:
    """The tokens of a batch that are not padding, and the key they were read from: ``attention_mask``, else
    ``labels`` (those not ``-100``), of ``input_ids``' shape in a mapping; ``None`` otherwise.
    The count is a 0-dim device tensor, not read (a host read would wait for the GPU at every micro-batch)."""
    input_ids = input_ids_of(batch)
    if input_ids is None or not isinstance(batch, Mapping):
        return None
    mask = batch.get("attention_mask")
    if isinstance(mask, Tensor) and mask.shape == input_ids.shape:
        return attended_count(mask), "attention_mask"
    labels = batch.get("labels")
    if isinstance(labels, Tensor) and labels.shape == input_ids.shape:
        return (labels != -100).sum(), "labels"
    return None


def attended_count(mask: Tensor) -> Tensor:
    """The positions a 2-D ``attention_mask`` keeps, as a 0-dim device tensor: its non-zero entries (``1``/``True``
    keep, as Hugging Face writes it), or, for a floating-point mask with a negative entry (an additive mask, ``0``
    keeps and ``-inf`` or a large negative drops) or only zeros, its zero entries."""
    if not mask.is_floating_point():
        return (mask != 0).sum()
    zeros = (mask == 0).sum()
    additive = (mask < 0).any() | (zeros == mask.numel())
    return torch.where(additive, zeros, mask.numel() - zeros)


def padding_unreadable(batch: Any) -> Optional[str]:
    """Why :func:`real_tokens_of` cannot tell a mapping batch's padding (its ``attention_mask`` or ``labels`` has
    another
    shape than the input ids: a 3-D or 4-D mask, shifted labels), or ``None``."""
    ids = input_ids_of(batch) if isinstance(batch, Mapping) else None
    for key in ("attention_mask", "labels"):
        value = batch.get(key) if ids is not None else None
        if isinstance(value, Tensor) and value.shape != ids.shape:
            return (f"the batch's {key} has shape {tuple(value.shape)}, not that of its input ids {tuple(ids.shape)}, "
                    "so which positions are padding cannot be read from it: tokens/s and MFU count every position, "
                    "padding included.")
    return None


class TokenTally:
    """Tokens and their model FLOPs over a span of micro-batches (a window, a run), read when asked for.

    Real tokens are kept apart by FLOPs per token, so their model FLOPs are exact over micro-batches of
    different lengths; device counts are summed on the device and read once, by :meth:`read`.
    """

    def __init__(self) -> None:
        self.positions = 0
        self._real: dict[Optional[float], Any] = {}  # FLOPs per token (None: unknown) -> real tokens, int or tensor

    def add(self, positions: int, real: Any, flops_per_token: Optional[float]) -> None:
        self.positions += positions
        self._real[flops_per_token] = self._real.get(flops_per_token, 0) + real

    def copy(self) -> "TokenTally":
        copied = TokenTally()
        copied.positions, copied._real = self.positions, dict(self._real)  # sums make new tensors: the copy stays
        return copied

    def read(self) -> tuple[int, float, bool]:
        """``(real tokens, model FLOPs of those whose FLOPs per token is known, all known?)``; waits for the device."""
        counts = {fpt: int(tokens) for fpt, tokens in self._real.items()}
        flops = float(sum(fpt * tokens for fpt, tokens in counts.items() if fpt is not None))
        return sum(counts.values()), flops, None not in counts


def memory_stats(facts: DeviceFacts) -> dict[str, float]:
    """``mem/*`` metrics of a CUDA device in GiB (no synchronisation); empty elsewhere."""
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
    """``(bf16 peak, fp8 peak, device name)`` in FLOP/s for MFU on a CUDA device (``None`` when unknown);
    ``dtype="fp8"`` adds the fp8 peak, ``peak_flops`` (the user's bf16 peak) replaces the table's."""
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


def fp8_weighted_peak(peak: Optional[float], peak_fp8: Optional[float], fp8_share: float) -> Optional[float]:
    """The peak FLOP/s of a run whose ``fp8_share`` of FLOPs runs float8 matmuls and the rest bf16 ones: the rate
    at which each part, at its own peak, takes its time (``1 / (share / peak_fp8 + (1 - share) / peak)``).

    Example::

        fp8_weighted_peak(1e15, 2e15, 0.5)  # 1.333e15; share 0: the bf16 peak; share 1: the fp8 peak
    """
    if peak is None or peak_fp8 is None:
        return None
    if not 0 <= fp8_share <= 1:
        raise ValueError(f"fp8_share must be in [0, 1], got {fp8_share}.")
    return 1 / (fp8_share / peak_fp8 + (1 - fp8_share) / peak)


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
    tensor_parallel: int = 1,
    padded_tokens: Optional[int] = None,
) -> dict[str, float]:
    """The ``perf/*`` metrics of one window of ``steps`` optimizer steps (``docs/callbacks.md``'s key table).

    Example::

        m = window_metrics(tokens=8192, flops=8192 * 1e9, elapsed=2.0, steps=4, wait=0.1, replicas=2, peak=1e13)
        m["perf/tokens_per_sec"], m["perf/mfu"], m["perf/step_time_ms"]  # 8192.0, 0.4096, 500.0

    Args:
        tokens: Tokens this device's data-parallel rank trained on (none: only step time and data wait).
        flops: Model FLOPs of those tokens (the whole model's); ``None`` when some count is unknown.
        elapsed, steps, wait: Seconds of the window, its optimizer steps, seconds spent waiting for batches.
        replicas: Data-parallel size.
        peak, peak_fp8, measured_peak: FLOP/s for ``perf/mfu``, ``perf/mfu_fp8``, ``perf/mfu_measured``.
        tensor_parallel: Devices that split each layer: a rank's tokens and FLOPs are divided over them.
        padded_tokens: Token positions, padding included, when the batches mark padding.
    """
    elapsed = max(elapsed, 1e-12)
    metrics = {"perf/step_time_ms": 1000 * elapsed / steps, "perf/dataloader_wait_pct": 100 * wait / elapsed}
    if tokens <= 0:  # no tokens found in the batches: no rate to report
        return metrics
    per_rank = tokens / elapsed  # a data-parallel rank: one device, or a tensor-parallel group of them
    metrics["perf/tokens_per_sec"] = per_rank * replicas
    metrics["perf/tokens_per_sec_per_device"] = per_rank / tensor_parallel
    if padded_tokens is not None:
        metrics["perf/tokens_per_sec_padded"] = padded_tokens / elapsed * replicas
    if flops is not None:
        achieved = flops / elapsed / tensor_parallel
        metrics["perf/tflops_per_device"] = achieved / 1e12
        for key, divisor in (("perf/mfu", peak), ("perf/mfu_fp8", peak_fp8), ("perf/mfu_measured", measured_peak)):
            if divisor is not None:
                metrics[key] = achieved / divisor
    return metrics


@dataclass
class WindowTotals:
    """What one timing window measured, as counts: reports add these up rather than average rates."""

    tokens: int  # this device's, padding left out when the batches mark it
    flops: Optional[float]  # model FLOPs of those tokens; None when some micro-batch's count is unknown
    seconds: float  # training seconds (validation and saves left out)
    steps: int
    wait: float  # seconds of `seconds` spent waiting for batches
    padded: Optional[int] = None  # token positions, padding included, when the batches mark padding


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def _advice(
    peak_pct: Optional[float], wait_pct: float, dtype: str, on_cuda: bool, compiled: bool, workers: str
) -> list[str]:
    advice = []
    if peak_pct is not None and peak_pct < 50:
        advice.append(
            f"Memory is mostly unused (peak {peak_pct:.0f}%): raise the micro-batch size (fewer "
            "accumulation steps) or add the AutoBatchSize callback."
        )
    if wait_pct > 5:
        advice.append(
            f"The model waits for data {wait_pct:.0f}% of the time: raise {workers} (or pin the loader's memory)."
        )
    if dtype == "fp32" and on_cuda:
        advice.append(
            f"Matmuls run in fp32 without TF32: add CUDASettings ({option('CUDASettings', 'tf32', True)}) or train "
            f"with {option('Trainer', 'precision', 'bf16-mixed')}."
        )
    if dtype == "fp8" and not compiled:
        advice.append("FP8 without torch.compile leaves most of its speed-up unused: compile the model.")
    return advice


def summarise_windows(
    windows: list[WindowTotals],
    *,
    window: int,
    warmup_steps: int,
    dtype: str,
    fit_tokens: int,
    fit_flops: float,
    replicas: int = 1,
    peak: Optional[float] = None,
    peak_fp8: Optional[float] = None,
    measured_peak: Optional[float] = None,
    peak_memory_pct: Optional[float] = None,
    run_tokens: Optional[int] = None,
    run_flops: Optional[float] = None,
    on_cuda: bool = False,
    compiled: bool = False,
    tensor_parallel: int = 1,
    workers: str = "the training DataLoader's num_workers",
) -> dict[str, Any]:
    """The end-of-fit report, ``{"text", "advice", "metrics"}`` over this fit's windows, with advice naming the fix.

    Every figure is a total over a total of the same span (tokens/s = all the windows' tokens / all their
    seconds), so the figures agree with each other however uneven the windows are.

    Args:
        windows: What each window of this fit measured; ``window``, ``warmup_steps``: the monitor's settings.
        fit_tokens, fit_flops: Tokens per data-parallel rank in this fit (warm-up included), and their FLOPs.
        run_tokens, run_flops: The same for the whole run when this fit resumed one; ``None`` for a fresh run.
        peak_memory_pct: The highest ``mem/peak_pct`` logged (CUDA only).
        on_cuda, compiled, workers: For the advice (fp32 on CUDA, fp8 uncompiled, the loader's workers).
        replicas, peak, peak_fp8, measured_peak, tensor_parallel: As :func:`window_metrics`'s.
    """
    if not windows:
        text = (
            f"MFUMonitor: the run was too short to measure: it needs {warmup_steps + window} optimizer steps "
            f"(warmup_steps={warmup_steps} + log_every_n_steps={window})."
        )
        return {"text": text, "advice": []}
    flops = [w.flops for w in windows]
    padded = [w.padded for w in windows]
    steps = sum(w.steps for w in windows)
    metrics = window_metrics(
        tokens=sum(w.tokens for w in windows),
        flops=None if None in flops else sum(flops),
        elapsed=sum(w.seconds for w in windows),
        steps=steps,
        wait=sum(w.wait for w in windows),
        replicas=replicas,
        peak=peak,
        peak_fp8=peak_fp8,
        measured_peak=measured_peak,
        tensor_parallel=tensor_parallel,
        padded_tokens=None if None in padded else sum(padded),
    )
    per = (
        "per device" if tensor_parallel == 1 else f"per data-parallel rank ({tensor_parallel} tensor-parallel devices)"
    )
    lines = [
        f"MFUMonitor report ({_plural(len(windows), 'window')} of {_plural(window, 'step')} in this fit, "
        f"{_plural(steps, 'step')} measured, {dtype} matmuls):"
    ]
    if "perf/mfu" in metrics:
        fp8 = f" (fp8 peak: {100 * metrics['perf/mfu_fp8']:.1f}%)" if "perf/mfu_fp8" in metrics else ""
        lines.append(f"  MFU {100 * metrics['perf/mfu']:.1f}%{fp8}")
    if "perf/tflops_per_device" in metrics:
        lines.append(f"  {metrics['perf/tflops_per_device']:.3g} TFLOP/s per device")
    if "perf/tokens_per_sec" in metrics:
        with_padding = metrics.get("perf/tokens_per_sec_padded")
        padding = f", {with_padding:,.0f} with padding" if with_padding is not None else ""
        lines.append(f"  {metrics['perf/tokens_per_sec']:,.0f} tokens/s{padding} ({metrics['perf/step_time_ms']:.1f} "
                     "ms/step)")
    else:
        lines.append(f"  {metrics['perf/step_time_ms']:.1f} ms/step (no tokens found in the batches: no tokens/s or "
                     "MFU)")
    if peak_memory_pct is not None:
        lines.append(f"  peak memory {peak_memory_pct:.0f}% of the device")
    lines.append(f"  data-loader wait {metrics['perf/dataloader_wait_pct']:.1f}%")
    if fit_tokens > 0:
        lines.append(f"  {fit_tokens:,} tokens {per} in this fit ({fit_flops / 1e12:.3g} model TFLOP)")
    if run_tokens is not None:
        lines.append(f"  the run so far, resumed: {run_tokens:,} tokens {per} ({(run_flops or 0.0) / 1e12:.3g} model "
                     "TFLOP)")
    advice = _advice(peak_memory_pct, metrics["perf/dataloader_wait_pct"], dtype, on_cuda, compiled, workers)
    lines += [f"  advice: {a}" for a in advice]
    return {"text": "\n".join(lines), "advice": advice, "metrics": metrics}
