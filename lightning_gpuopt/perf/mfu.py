"""MFU arithmetic: the peaks MFU divides by, the metrics of one timing window, and the end-of-fit report.

Plain functions, no Trainer: :class:`~lightning_gpuopt.callbacks.MFUMonitor` times the windows,
counts tokens and FLOPs, and calls these. MFU is against the device's dense **bf16** peak whatever
the run computes in (the usual convention, so fp32, bf16 and fp8 runs compare on one scale); fp8
runs also get ``perf/mfu_fp8`` against the fp8 peak.

Tokens are real tokens: where a batch marks its padding (:func:`real_tokens_of`), tokens/s and the model
FLOPs behind TFLOP/s and MFU count the real tokens only. The GPU computes on the padding too, but that is
work the model did not need, as activation recomputation is not (PaLM's MFU leaves both out), so padding
shows as lower MFU, the speed packing or length-bucketing would win back; the rate of all positions is
logged beside it (``perf/tokens_per_sec_padded``).
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
    "input_ids_of",
    "memory_stats",
    "mfu_peaks",
    "padding_unreadable",
    "real_tokens_of",
    "summarise_windows",
    "window_metrics",
]

MFU_DTYPE = "bf16"
MFU_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
"""Matmul dtypes ``MFUMonitor(dtype=...)`` accepts."""


def input_ids_of(batch: Any) -> Optional[Tensor]:
    """The token-id tensor of a batch: ``batch[0]`` of a tuple, ``batch["input_ids"]`` of a dict, or the batch,
    when it holds integers; ``None`` otherwise (float features are not tokens).

    Example::

        >>> input_ids_of({"input_ids": torch.zeros(2, 16, dtype=torch.long)}).shape
        torch.Size([2, 16])
        >>> input_ids_of((torch.randn(2, 16), torch.randn(2, 1))) is None
        True

    Args:
        batch: A training batch; anything else gives ``None``.
    """
    if isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]
    elif isinstance(batch, Mapping):
        batch = batch.get("input_ids")
    if isinstance(batch, Tensor) and not (batch.is_floating_point() or batch.is_complex() or batch.dtype == torch.bool):
        return batch
    return None


def real_tokens_of(batch: Any) -> Optional[tuple[Tensor, str]]:
    """The tokens of a batch that are not padding, and the key they were read from: ``attention_mask`` (its non-zero
    entries), else ``labels`` (those not ``-100``), when the batch is a mapping holding one of ``input_ids``' shape;
    ``None`` otherwise (every position is a token).

    The count is a 0-dim tensor on the batch's device, not read: reading it on the host would wait for the GPU
    at every micro-batch. :class:`TokenTally` adds such counts up and reads them once.

    Example::

        >>> ids = torch.ones(2, 4, dtype=torch.long)
        >>> count, key = real_tokens_of({"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])})
        >>> int(count), key
        (6, 'attention_mask')

    Args:
        batch: A training batch.
    """
    input_ids = input_ids_of(batch)
    if input_ids is None or not isinstance(batch, Mapping):
        return None
    for key, padding in (("attention_mask", 0), ("labels", -100)):
        value = batch.get(key)
        if isinstance(value, Tensor) and value.shape == input_ids.shape:
            return (value != padding).sum(), key
    return None


def padding_unreadable(batch: Any) -> Optional[str]:
    """Why :func:`real_tokens_of` cannot tell a mapping batch's padding (its ``attention_mask`` or ``labels`` has another
    shape than the input ids: a 3-D or 4-D mask, shifted labels), or ``None``."""
    ids = input_ids_of(batch) if isinstance(batch, Mapping) else None
    for key in ("attention_mask", "labels"):
        value = batch.get(key) if ids is not None else None
        if isinstance(value, Tensor) and value.shape != ids.shape:
            return (f"the batch's {key} has shape {tuple(value.shape)}, not that of its input ids {tuple(ids.shape)}, so which "
                    "positions are padding cannot be read from it: tokens/s and MFU count every position, padding included.")
    return None


class TokenTally:
    """Tokens and their model FLOPs over a span of micro-batches (a window, a run), read when asked for.

    Each micro-batch adds its token positions (padding included, known on the host from the shapes), its real
    tokens (an ``int``, or a device tensor from :func:`real_tokens_of`) and the model FLOPs per token of its
    sequence length (``None`` when unknown). Real tokens are kept apart by FLOPs per token, so the model FLOPs of
    the real tokens are exact over micro-batches of different lengths; device counts are summed on the device
    and read once, by :meth:`read`.

    Example::

        tally = TokenTally()
        tally.add(positions=64, real=torch.tensor(48), flops_per_token=1e6)
        tally.read()  # (48, 4.8e7, True): real tokens, their model FLOPs, all counts known
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
        """``(real tokens, model FLOPs of those whose FLOPs per token is known, whether all are known)``.
        Waits for the device when a count is a device tensor."""
        counts = {fpt: int(tokens) for fpt, tokens in self._real.items()}
        flops = float(sum(fpt * tokens for fpt, tokens in counts.items() if fpt is not None))
        return sum(counts.values()), flops, None not in counts


def memory_stats(facts: DeviceFacts) -> dict[str, float]:
    """``mem/*`` metrics of a CUDA device in GiB (no synchronisation); empty elsewhere.

    Example::

        memory_stats(read_device("cuda:0"))  # {"mem/allocated_gb": 12.3, ..., "mem/peak_pct": 41.0}

    Args:
        facts: The training device (:func:`~lightning_gpuopt.perf.device.training_device`).
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
    tensor_parallel: int = 1,
    padded_tokens: Optional[int] = None,
) -> dict[str, float]:
    """The ``perf/*`` metrics of one window of ``steps`` optimizer steps (see ``MFUMonitor``'s key table).

    Example::

        >>> m = window_metrics(tokens=8192, flops=8192 * 1e9, elapsed=2.0, steps=4, wait=0.1, replicas=2, peak=1e13)
        >>> m["perf/tokens_per_sec"], m["perf/mfu"], m["perf/step_time_ms"]
        (8192.0, 0.4096, 500.0)

    Args:
        tokens: Tokens this device's data-parallel rank trained on in the window (the ``tensor_parallel`` devices
            of a rank train on the same tokens, counted once); with none, only the step time and the data-loader
            wait are returned.
        flops: Model FLOPs of those tokens (the whole model's); ``None`` when some micro-batch's count is unknown.
        elapsed: Seconds the window took (synchronised at both ends).
        steps: Optimizer steps in the window.
        wait: Seconds spent waiting for batches.
        replicas: Data-parallel size (:func:`~lightning_gpuopt.perf.parallel.data_parallel_size`).
        peak: Dense bf16 peak FLOP/s per device, for ``perf/mfu``.
        peak_fp8: fp8 peak, for ``perf/mfu_fp8``.
        measured_peak: A timed bf16 matmul's FLOP/s, for ``perf/mfu_measured``.
        tensor_parallel: Devices that split each layer (:func:`~lightning_gpuopt.perf.parallel.tensor_parallel_size`):
            the tokens and FLOPs of a data-parallel rank are divided over them, per device.
        padded_tokens: Token positions of the window, padding included, when the batches say which are padding
            (``tokens`` are then the real ones): ``perf/tokens_per_sec_padded``.
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
    """What one timing window measured, as counts: reports add these up rather than average rates.

    Args:
        tokens: Tokens this device trained on in the window (padding left out when the batches mark it).
        flops: Model FLOPs of those tokens; ``None`` when some micro-batch's count is unknown.
        seconds: Training seconds of the window (validation and saves left out).
        steps: Optimizer steps in the window.
        wait: Seconds of ``seconds`` spent waiting for batches.
        padded: Token positions of the window, padding included, when the batches mark padding; else ``None``.
    """

    tokens: int
    flops: Optional[float]
    seconds: float
    steps: int
    wait: float
    padded: Optional[int] = None


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def _advice(peak_pct: Optional[float], wait_pct: float, dtype: str, on_cuda: bool, compiled: bool, workers: str) -> list[str]:
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
    """The end-of-fit report: ``{"text", "advice", "metrics"}`` over this fit's measured windows, with advice that names the fix.

    Every figure is a total divided by a total over the same span (tokens/s = all the windows'
    tokens / all their seconds; ms/step = all their seconds / all their steps; MFU from the same
    FLOPs and seconds), so the figures agree with each other however uneven the windows are.

    Example::

        >>> r = summarise_windows([WindowTotals(4096, None, 1.0, 1, 0.0), WindowTotals(4096, None, 3.0, 1, 0.0)],
        ...                       window=1, warmup_steps=0, dtype="bf16", fit_tokens=8192, fit_flops=0.0)
        >>> r["metrics"]["perf/tokens_per_sec"], r["metrics"]["perf/step_time_ms"]
        (2048.0, 2000.0)

    Args:
        windows: What each window of this fit measured (:class:`WindowTotals`).
        window: Optimizer steps per window.
        warmup_steps: Optimizer steps left out at the start.
        dtype: The matmul dtype of the run.
        fit_tokens: Tokens per data-parallel rank trained on in this fit, warm-up included.
        fit_flops: Model FLOPs of those tokens.
        replicas: Data-parallel size (tokens/s is for all devices).
        peak: Dense bf16 peak FLOP/s per device, for MFU.
        peak_fp8: fp8 peak, for MFU against it.
        measured_peak: A timed bf16 matmul's FLOP/s.
        peak_memory_pct: The highest ``mem/peak_pct`` logged (CUDA only).
        run_tokens: Tokens per data-parallel rank of the whole run when this fit resumed one; ``None`` for a fresh run.
        run_flops: Model FLOPs of those tokens.
        on_cuda: Whether the run is on a CUDA device (the fp32 advice applies there only).
        compiled: Whether the module runs under ``torch.compile`` (the fp8 advice).
        tensor_parallel: Devices that split each layer (see :func:`window_metrics`).
        workers: The setting that raises the training loader's worker processes (the data-wait advice names it).
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
    per = "per device" if tensor_parallel == 1 else f"per data-parallel rank ({tensor_parallel} tensor-parallel devices)"
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
        lines.append(f"  {metrics['perf/tokens_per_sec']:,.0f} tokens/s{padding} ({metrics['perf/step_time_ms']:.1f} ms/step)")
    else:
        lines.append(f"  {metrics['perf/step_time_ms']:.1f} ms/step (no tokens found in the batches: no tokens/s or MFU)")
    if peak_memory_pct is not None:
        lines.append(f"  peak memory {peak_memory_pct:.0f}% of the device")
    lines.append(f"  data-loader wait {metrics['perf/dataloader_wait_pct']:.1f}%")
    if fit_tokens > 0:
        lines.append(f"  {fit_tokens:,} tokens {per} in this fit ({fit_flops / 1e12:.3g} model TFLOP)")
    if run_tokens is not None:
        lines.append(f"  the run so far, resumed: {run_tokens:,} tokens {per} ({(run_flops or 0.0) / 1e12:.3g} model TFLOP)")
    advice = _advice(peak_memory_pct, metrics["perf/dataloader_wait_pct"], dtype, on_cuda, compiled, workers)
    lines += [f"  advice: {a}" for a in advice]
    return {"text": "\n".join(lines), "advice": advice, "metrics": metrics}
