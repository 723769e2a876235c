"""`MFUMonitor`: tokens/s, TFLOP/s and model FLOPs utilisation (MFU) you can trust, with no per-step GPU sync."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_gpuopt.lightning_internals import show_in_progress_bar
from lightning_gpuopt.perf.compiled import is_compiled
from lightning_gpuopt.perf.flops import count_flops_per_token, model_flops_per_token
from lightning_gpuopt.perf.peaks import measure_peak_flops, peak_flops as table_peak_flops
from lightning_gpuopt.perf.parallel import data_parallel_size
from lightning_gpuopt.perf.precision import compute_dtype_name, is_fp8
from lightning_gpuopt.perf.units import GiB

__all__ = ["MFUMonitor"]


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: called only on steps that log."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _memory_stats(device: torch.device) -> dict[str, float]:
    """``mem/*`` metrics of a CUDA device (no synchronisation); empty elsewhere."""
    if device.type != "cuda":
        return {}
    total = torch.cuda.get_device_properties(device).total_memory
    peak = torch.cuda.max_memory_allocated(device)
    return {
        "mem/allocated_gb": torch.cuda.memory_allocated(device) / GiB,
        "mem/reserved_gb": torch.cuda.memory_reserved(device) / GiB,
        "mem/peak_gb": peak / GiB,
        "mem/peak_pct": 100 * peak / total,
    }


def _input_ids(batch: Any) -> Optional[Tensor]:
    """The token-id tensor of a batch: ``batch[0]`` of a tuple, ``batch["input_ids"]`` of a dict, or the batch."""
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], Tensor):
        return batch[0]
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), Tensor):
        return batch["input_ids"]
    return None


class MFUMonitor(Callback):
    """Logs throughput, TFLOP/s per device, MFU and memory every few optimizer steps, and a report at the end of ``fit``.

    Tokens per micro-batch are the element count of the input ids (``batch[0]`` for tuples,
    ``batch["input_ids"]`` for dicts) or ``tokens_fn(batch)``. Training FLOPs per token come from
    ``flops_per_token=``, else the module's ``flops_per_token(seq_len)`` method (``GPTModule`` has one),
    else they are counted once per sequence length with ``FlopCounterMode`` on meta tensors (no memory
    used, no host sync) over what training runs: the module's ``training_step`` on the first batch and
    the backward of its loss. Where the step cannot run on meta tensors (it reads a value, or optimises
    manually) ``forward(input_ids)`` is counted instead, with a warning when its output does not cover
    every position (nanoGPT's forward without targets computes the head for the last one only).
    ``flops_source`` says which was used. The peak is the **dense, per-GPU**
    datasheet number for the compute dtype of the precision plugin (see
    :mod:`lightning_gpuopt.perf.peaks`).

    The first ``warmup_steps`` optimizer steps (compilation, cuDNN autotuning, allocator growth) are
    left out; after that, one value per window of ``log_every_n_steps`` optimizer steps is logged.
    The device is synchronised only at the end of a window: steps in between queue work freely.

    ============================== ==========================================================================
    Key                            Meaning
    ============================== ==========================================================================
    ``perf/tokens_per_sec``        Tokens per second, all devices (per-device rate times data-parallel size)
    ``perf/tokens_per_sec_per_device`` Tokens per second on one device
    ``perf/tflops_per_device``     Achieved model TFLOP/s per device (FLOPs per token x tokens/s)
    ``perf/mfu``                   ``tflops_per_device / peak``: the device's dense bf16 peak, whatever the dtype
    ``perf/mfu_fp8``               Under FP8 only: against the fp8 peak
    ``perf/mfu_measured``          With ``measure_peak=True``: against a timed bf16 matmul
    ``perf/step_time_ms``          Wall time of one optimizer step (all its micro-batches)
    ``perf/dataloader_wait_pct``   Share of the window spent waiting for the next batch
    ``mem/allocated_gb``           CUDA memory held by tensors now (GiB)
    ``mem/reserved_gb``            CUDA memory reserved by the caching allocator (GiB)
    ``mem/peak_gb``                Peak memory held by tensors since the start (GiB)
    ``mem/peak_pct``               ``peak_gb`` as a percentage of the device's memory
    ============================== ==========================================================================

    ``tok/s`` and ``mfu`` are also shown in the progress bar.

    Example::

        trainer = Trainer(
            precision="bf16-mixed",
            callbacks=[CUDASettings(), MFUMonitor(log_every_n_steps=20)],
            logger=WandbLogger(project="gpt"),
        )

    Args:
        log_every_n_steps: Optimizer steps per logging window; ``None`` uses the Trainer's.
        warmup_steps: Optimizer steps left out at the start of ``fit``.
        peak_flops: Dense bf16 peak FLOP/s per device, for GPUs not in the table (or to override
            it). MFU is not logged when this is unknown.
        dtype: The matmul dtype (``fp32``, ``tf32``, ``bf16``, ``fp16``, ``fp8``) when the precision
            plugin does not say; ``None`` reads it from the plugin.
        flops_per_token: Training FLOPs per token; ``None`` asks the module or measures them.
        tokens_fn: ``tokens_fn(batch) -> int``: tokens in a micro-batch, for batches of another shape.
        measure_peak: Time a large bf16 matmul at fit start and also log ``perf/mfu_measured``.
        prog_bar: Show ``tok/s`` and ``mfu`` in the progress bar.
        report: Log a performance summary with advice at the end of ``fit`` (rank zero).
        clock: Function returning seconds (default ``time.perf_counter``); tests inject their own.

    Note:
        Global tokens/s assume data parallelism with equal micro-batches on every rank (DDP, FSDP2);
        the FLOPs are those of the whole model, so ``perf/mfu`` is per device either way.
    """

    def __init__(
        self,
        log_every_n_steps: Optional[int] = None,
        warmup_steps: int = 3,
        peak_flops: Optional[float] = None,
        dtype: Optional[str] = None,
        flops_per_token: Optional[float] = None,
        tokens_fn: Optional[Callable[[Any], int]] = None,
        measure_peak: bool = False,
        prog_bar: bool = True,
        report: bool = True,
        clock: Optional[Callable[[], float]] = None,
    ) -> None:
        if log_every_n_steps is not None and (isinstance(log_every_n_steps, bool) or log_every_n_steps < 1):
            raise ValueError(f"MFUMonitor.log_every_n_steps must be a positive integer or None, got {log_every_n_steps!r}.")
        if warmup_steps < 0:
            raise ValueError(f"MFUMonitor.warmup_steps must be >= 0, got {warmup_steps}.")
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"MFUMonitor.peak_flops must be > 0 FLOP/s (e.g. 989.4e12), got {peak_flops!r}.")
        if peak_flops is not None and peak_flops < 1e9:
            rank_zero_warn(f"MFUMonitor.peak_flops={peak_flops} looks like TFLOP/s; it is in FLOP/s (e.g. 989.4e12).")
        if dtype is not None and dtype not in ("fp32", "tf32", "bf16", "fp16", "fp8"):
            raise ValueError(f"MFUMonitor.dtype must be one of fp32, tf32, bf16, fp16, fp8 or None, got {dtype!r}.")
        if flops_per_token is not None and not flops_per_token > 0:
            raise ValueError(f"MFUMonitor.flops_per_token must be > 0, got {flops_per_token!r}.")
        self.log_every_n_steps = log_every_n_steps
        self.warmup_steps = warmup_steps
        self.peak_flops = peak_flops
        self.dtype = dtype
        self.flops_per_token = flops_per_token
        self.tokens_fn = tokens_fn
        self.measure_peak = measure_peak
        self.prog_bar = prog_bar
        self.report = report
        self._clock = clock or time.perf_counter
        self.history: list[dict[str, float]] = []  # one entry per logged window
        self.flops_source: Optional[str] = None  # how the FLOPs per token were found
        self.summary: dict[str, Any] = {}
        self.total_tokens = 0  # tokens trained on in this fit (per device), resumes included
        self.total_flops = 0.0  # model FLOPs of those tokens (per device)
        self._at_step = (0, 0.0)  # (total_tokens, total_flops) at the last optimizer step
        self._reset_run()

    def _reset_run(self) -> None:
        self._window = 1
        self._device = torch.device("cpu")
        self._dtype: Optional[str] = None
        self._peak: Optional[float] = None
        self._peak_fp8: Optional[float] = None
        self._measured_peak: Optional[float] = None
        self._flops_cache: dict[Optional[int], Optional[float]] = {}
        self._last_global_step: Optional[int] = None
        self._steps = 0  # optimizer steps seen in this fit
        self._window_start: Optional[float] = None
        self._last_batch_end: Optional[float] = None
        self._tokens = 0
        self._flops = 0.0
        self._flops_known = True
        self._wait = 0.0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset_run()
        self.history = []
        self.summary = {}
        self.total_tokens, self.total_flops, self._at_step = 0, 0.0, (0, 0.0)
        self._window = self.log_every_n_steps or trainer.log_every_n_steps
        self._device = trainer.strategy.root_device
        plugin = trainer.precision_plugin
        self._dtype = self.dtype or compute_dtype_name(plugin)
        if self._dtype is None:
            rank_zero_warn(
                f"MFUMonitor cannot tell the matmul dtype of the precision plugin {type(plugin).__name__}: assuming bf16. "
                "Give the plugin a `compute_dtype` property or pass MFUMonitor(dtype=...)."
            )
            self._dtype = "bf16"
        if is_fp8(plugin) and self.dtype is None:
            self._dtype = "fp8"
        # The usual convention: MFU against the dense bf16 peak whatever the run computes in, so fp32,
        # bf16 and fp8 runs compare on one scale (fp8 runs also get perf/mfu_fp8).
        mfu_dtype = "bf16"
        if self._device.type == "cuda":
            name = torch.cuda.get_device_name(self._device)
            self._peak = table_peak_flops(name, mfu_dtype)
            if self._dtype == "fp8":
                self._peak_fp8 = table_peak_flops(name, "fp8")
        else:
            name = f"a {self._device.type} device"
        if self.peak_flops is not None:
            self._peak = self.peak_flops
        if self._peak is None:
            rank_zero_warn(
                f"MFUMonitor has no {mfu_dtype} peak FLOP/s for {name}, so perf/mfu is not logged: pass "
                "MFUMonitor(peak_flops=...) with the dense per-device peak from the datasheet."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_global_step = trainer.global_step  # > 0 when resuming from a checkpoint
        if self.measure_peak:
            if self._device.type == "cuda":
                self._measured_peak = measure_peak_flops(self._device, torch.bfloat16)
                torch.cuda.reset_peak_memory_stats(self._device)  # the probe's matrices are not the model's
            else:
                rank_zero_warn("MFUMonitor(measure_peak=True) needs a CUDA device; perf/mfu_measured is not logged.")
        if self.warmup_steps == 0:
            self._start_window()

    def _flops_for(self, pl_module: pl.LightningModule, batch: Any, batch_idx: int, tokens: int) -> Optional[float]:
        input_ids = _input_ids(batch)
        seq_len = int(input_ids.shape[-1]) if input_ids is not None and input_ids.dim() > 0 else None
        if self.flops_per_token is not None:
            self.flops_source = "flops_per_token="
            return self.flops_per_token
        if seq_len in self._flops_cache:
            return self._flops_cache[seq_len]
        flops = model_flops_per_token(pl_module, seq_len)
        if flops is not None:
            self.flops_source = f"{type(pl_module).__name__}.flops_per_token"
        else:
            flops = self._count_flops(pl_module, batch, batch_idx, tokens, input_ids)
        self._flops_cache[seq_len] = flops
        return flops

    def _count_flops(
        self, pl_module: pl.LightningModule, batch: Any, batch_idx: int, tokens: int, input_ids: Optional[Tensor]
    ) -> Optional[float]:
        count = count_flops_per_token(pl_module, batch, batch_idx, tokens, input_ids)
        if count.warning:
            rank_zero_warn(f"MFUMonitor: {count.warning}")
        if count.info:
            rank_zero_info(f"MFUMonitor: {count.info}")
        self.flops_source = count.source
        return count.per_token

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._last_batch_end is not None:
            self._wait += self._clock() - self._last_batch_end

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        input_ids = _input_ids(batch)
        tokens = self.tokens_fn(batch) if self.tokens_fn is not None else (input_ids.numel() if input_ids is not None else 0)
        flops = self._flops_for(pl_module, batch, batch_idx, tokens)
        self._tokens += tokens
        self.total_tokens += tokens
        if flops is None:
            self._flops_known = False
        else:
            self._flops += tokens * flops
            self.total_flops += tokens * flops
        if trainer.global_step != self._last_global_step:  # an optimizer step finished with this batch
            self._last_global_step = trainer.global_step
            self._at_step = (self.total_tokens, self.total_flops)
            self._steps += 1
            if self._steps == self.warmup_steps:
                self._start_window()
            elif self._steps > self.warmup_steps and (self._steps - self.warmup_steps) % self._window == 0:
                self._end_window(trainer, pl_module)
        self._last_batch_end = self._clock()

    def _start_window(self) -> None:
        _synchronize(self._device)
        self._window_start = self._clock()
        self._tokens, self._flops, self._wait, self._flops_known = 0, 0.0, 0.0, True

    def _end_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _synchronize(self._device)
        now = self._clock()
        elapsed = max(now - self._window_start, 1e-12)
        per_device = self._tokens / elapsed
        metrics = {
            "perf/tokens_per_sec": per_device * data_parallel_size(trainer),
            "perf/tokens_per_sec_per_device": per_device,
            "perf/step_time_ms": 1000 * elapsed / self._window,
            "perf/dataloader_wait_pct": 100 * self._wait / elapsed,
        }
        if self._flops_known:
            achieved = self._flops / elapsed
            metrics["perf/tflops_per_device"] = achieved / 1e12
            if self._peak is not None:
                metrics["perf/mfu"] = achieved / self._peak
            if self._peak_fp8 is not None:
                metrics["perf/mfu_fp8"] = achieved / self._peak_fp8
            if self._measured_peak is not None:
                metrics["perf/mfu_measured"] = achieved / self._measured_peak
        metrics.update(_memory_stats(self._device))
        self.history.append(metrics)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
            if self.prog_bar:
                self._show_in_progress_bar(trainer, metrics)
        self._window_start = self._clock()
        self._tokens, self._flops, self._wait, self._flops_known = 0, 0.0, 0.0, True

    @override
    def state_dict(self) -> dict[str, Any]:
        """The logged windows and the token/FLOP totals at the last optimizer step, for resuming.

        Plain floats and ints only (loads with ``weights_only=True``). Timing windows are not
        saved: a resumed run warms up again (``warmup_steps``) before it measures.
        """
        tokens, flops = self._at_step
        return {"history": [dict(m) for m in self.history], "total_tokens": tokens, "total_flops": flops}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [dict(m) for m in state_dict.get("history", [])]
        self.total_tokens = int(state_dict.get("total_tokens", 0))
        self.total_flops = float(state_dict.get("total_flops", 0.0))
        self._at_step = (self.total_tokens, self.total_flops)

    @staticmethod
    def _show_in_progress_bar(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        # Plain floats, shown until the next window. (`self.log(prog_bar=True)` would store device
        # tensors that the bar reads with `.item()`, a GPU sync on every refresh.)
        shown = {"tok/s": round(metrics["perf/tokens_per_sec"])}
        if "perf/mfu" in metrics:
            shown["mfu"] = round(metrics["perf/mfu"], 4)
        show_in_progress_bar(trainer, shown)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.report:
            return
        self.summary = self._summarise(pl_module)
        if trainer.is_global_zero:
            rank_zero_info(self.summary["text"])

    def _summarise(self, pl_module: pl.LightningModule) -> dict[str, Any]:
        needed = self.warmup_steps + self._window
        if not self.history:
            text = (
                f"MFUMonitor: the run was too short to measure: it needs {needed} optimizer steps "
                f"(warmup_steps={self.warmup_steps} + log_every_n_steps={self._window})."
            )
            return {"text": text, "advice": []}
        keys = {k for m in self.history for k in m}
        mean = {k: sum(m[k] for m in self.history if k in m) / sum(k in m for m in self.history) for k in keys}
        lines = [f"MFUMonitor report ({len(self.history)} windows of {self._window} steps, {self._dtype} matmuls):"]
        if "perf/mfu" in mean:
            lines.append(f"  MFU {100 * mean['perf/mfu']:.1f}%" + (
                f" (fp8 peak: {100 * mean['perf/mfu_fp8']:.1f}%)" if "perf/mfu_fp8" in mean else ""))
        if "perf/tflops_per_device" in mean:
            lines.append(f"  {mean['perf/tflops_per_device']:.3g} TFLOP/s per device")
        lines.append(f"  {mean['perf/tokens_per_sec']:,.0f} tokens/s ({mean['perf/step_time_ms']:.1f} ms/step)")
        if "mem/peak_pct" in mean:
            lines.append(f"  peak memory {max(m.get('mem/peak_pct', 0) for m in self.history):.0f}% of the device")
        lines.append(f"  data-loader wait {mean['perf/dataloader_wait_pct']:.1f}%")
        lines.append(f"  {self.total_tokens:,} tokens per device in this fit ({self.total_flops / 1e12:.3g} model TFLOP)")
        advice = []
        peak_pct = max((m["mem/peak_pct"] for m in self.history if "mem/peak_pct" in m), default=None)
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
        if self._dtype == "fp32" and self._device.type == "cuda":
            advice.append(
                "Matmuls run in fp32 without TF32: add CUDASettings(tf32=True) or train with precision='bf16-mixed'."
            )
        if self._dtype == "fp8" and not is_compiled(pl_module):
            advice.append("FP8 without torch.compile leaves most of its speed-up unused: compile the model.")
        lines += [f"  advice: {a}" for a in advice]
        return {"text": "\n".join(lines), "advice": advice, "mean": mean}
