"""`MFUMonitor`: tokens/s, TFLOP/s and model FLOPs utilisation (MFU) you can trust, with no per-step GPU sync."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_gpuopt.internals import show_in_progress_bar
from lightning_gpuopt.perf.compiled import is_compiled
from lightning_gpuopt.perf.device import DeviceFacts, training_device
from lightning_gpuopt.perf.flops import StepFlopCounter, model_flops_per_token
from lightning_gpuopt.perf.mfu import (MFU_DTYPES, TokenTally, WindowTotals, input_ids_of, mfu_peaks, padding_unreadable,
                                       real_tokens_of, summarise_windows, window_metrics)
from lightning_gpuopt.option_checks import check_choice, check_int, check_number, option
from lightning_gpuopt.perf import mfu
from lightning_gpuopt.perf.peaks import measure_peak_flops
from lightning_gpuopt.perf.parallel import data_parallel_size, tensor_parallel_size
from lightning_gpuopt.precision.dtype import compute_dtype_name, is_fp8
from lightning_gpuopt.precision.float8 import Float8Precision

__all__ = ["MFUMonitor"]


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: only where a window ends or validation or a save pauses it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a measurement: the window's time must include the GPU's queued work


def _seq_len(batch: Any) -> Optional[int]:
    """The sequence length of a batch's input ids (the key of a FLOPs count), ``None`` without them."""
    input_ids = input_ids_of(batch)
    return int(input_ids.shape[-1]) if input_ids is not None and input_ids.dim() > 0 else None


class MFUMonitor(Callback):
    """Logs throughput, TFLOP/s per device, MFU and memory every few optimizer steps, and a report after ``fit``.

    Tokens are counted from the batch's integer input ids (padding left out where an ``attention_mask``
    or ``labels`` of the ids' shape mark it; another shape is warned about once); FLOPs per token are given, asked from the module, or counted over the first
    real step at each sequence length. MFU is against the device's dense bf16 datasheet peak. The device
    is synchronised only at the end of a window. Logs ``perf/*`` and ``mem/*`` keys, shows ``tok/s`` and
    ``mfu`` in the progress bar; every key and how each is measured: ``docs/callbacks.md``.

    Example::

        trainer = Trainer(callbacks=[MFUMonitor(log_every_n_steps=20)], logger=WandbLogger(project="gpt"))

    Args:
        log_every_n_steps: Optimizer steps per logging window; ``None`` uses the Trainer's.
        warmup_steps: Optimizer steps left out at the start of ``fit`` (compilation, autotuning).
        peak_flops: Dense bf16 peak FLOP/s per device, for GPUs not in the table (or to override it).
        dtype: The matmul dtype (``fp32``, ``tf32``, ``bf16``, ``fp16``, ``fp8``) when the precision
            plugin does not say; ``None`` reads it from the plugin.
        flops_per_token: Training FLOPs per token; ``None`` asks the module or counts them.
        tokens_fn: ``tokens_fn(batch) -> int``: tokens in a micro-batch, for batches of another shape.
        measure_peak: Time a large bf16 matmul at fit start and also log ``perf/mfu_measured``.
        prog_bar: Show ``tok/s`` and ``mfu`` in the progress bar.
        report: Log a performance summary with advice at the end of ``fit`` (rank zero).
        clock: Function returning seconds (default ``time.perf_counter``).

    Note:
        Global tokens/s assume data parallelism with equal micro-batches on every rank (DDP, FSDP2);
        FLOPs are the whole model's, so ``perf/mfu`` is per device. Under tensor parallelism the devices
        of a group count their tokens once and are credited ``1/N`` of their FLOPs each.
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
        own = "MFUMonitor"
        check_int(own, "log_every_n_steps", log_every_n_steps, minimum=1, optional=True)
        check_int(own, "warmup_steps", warmup_steps, minimum=0)
        check_number(own, "peak_flops", peak_flops, low=0, low_open=True, optional=True, hint=" (in FLOP/s, e.g. 989.4e12)")
        if peak_flops is not None and peak_flops < 1e9:
            rank_zero_warn(f"MFUMonitor.peak_flops={peak_flops} looks like TFLOP/s; it is in FLOP/s (e.g. 989.4e12).")
        check_choice(own, "dtype", dtype, (*MFU_DTYPES, None))
        check_number(own, "flops_per_token", flops_per_token, low=0, low_open=True, optional=True)
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
        self.history: list[dict[str, float]] = []  # one entry per logged window, resumes included
        self.windows: list[WindowTotals] = []  # what each window of this fit measured: the report adds these up
        self.flops_source: Optional[str] = None  # how the FLOPs per token were found
        self.summary: dict[str, Any] = {}
        self._run_base = (0, 0.0)  # tokens and model FLOPs (per data-parallel rank) of the run before this fit, from a checkpoint
        self._run = TokenTally()  # those of this fit
        self._at_step = TokenTally()  # this fit's at the last optimizer step (what a checkpoint saves)
        self._at_fit_start = (0, 0.0)  # (total_tokens, total_flops) restored from a checkpoint
        self._counted_at_step: dict[Optional[int], float] = {}  # FLOPs per token counted up to the last optimizer step
        self._reset_run()

    def _reset_run(self) -> None:
        self._window = 1
        self._device, self._facts = torch.device("cpu"), DeviceFacts("cpu", "cpu")  # the training device, read at setup
        self._dtype: Optional[str] = None
        self._peak, self._peak_fp8, self._measured_peak = None, None, None  # FLOP/s: bf16, fp8, timed
        self._flops_cache: dict[Optional[int], Optional[float]] = {}
        self._counted_fpt: dict[Optional[int], float] = {}  # the entries of _flops_cache counted over a real step
        if getattr(self, "_counter", None) is not None:
            self._abandon_count()
        self._counter, self._counting = StepFlopCounter(), None  # the step being counted, by sequence length
        self._last_global_step: Optional[int] = None
        self._steps = 0  # optimizer steps seen in this fit
        self._window_start: Optional[float] = None
        self._last_batch_end: Optional[float] = None
        self._tally, self._wait = TokenTally(), 0.0  # the current window's tokens and FLOPs, its data-loader wait
        self._padding_seen = False  # a batch said which positions are padding (real_tokens_of)
        self._said_mask_shape = False  # a batch's mask could not say it (another shape than input_ids'), said once
        self._said_compiled = False
        self._paused = 0.0  # seconds of the current window spent in validation or checkpoint saves
        self._pause_start: Optional[float] = None
        self._gap_paused = 0.0  # of those, the seconds since the last training batch
        self._warned_no_tokens = False
        self._said_flops = False  # the counted FLOPs per token are said once, not once per sequence length

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset_run()
        self.history, self.windows, self.summary = [], [], {}
        self._run_base, self._run, self._at_step, self._at_fit_start = (0, 0.0), TokenTally(), TokenTally(), (0, 0.0)
        self._counted_at_step = {}
        self._window = self.log_every_n_steps or trainer.log_every_n_steps
        self._device, self._facts = trainer.strategy.root_device, training_device(trainer)  # binds the plugin too
        plugin = trainer.precision_plugin
        self._dtype = self.dtype or compute_dtype_name(plugin)
        if self._dtype is None:
            rank_zero_warn(
                f"MFUMonitor cannot tell the matmul dtype of the precision plugin {type(plugin).__name__}: assuming bf16. "
                f"Give the plugin a `compute_dtype` property or set {option('MFUMonitor', 'dtype')}."
            )
            self._dtype = "bf16"
        if is_fp8(plugin) and self.dtype is None:
            self._dtype = "fp8"
        # MFU against the dense bf16 peak whatever the run computes in (see perf/mfu.py).
        self._peak, self._peak_fp8, name = mfu_peaks(self._facts, self._dtype, self.peak_flops)
        if self._peak is None and not self._facts.is_cuda:  # expected off a GPU: said once, not as a warning
            rank_zero_info(f"MFUMonitor: no peak FLOP/s for {name}, so perf/mfu is not logged ({option('MFUMonitor', 'peak_flops')} sets one).")
        elif self._peak is None:
            rank_zero_warn(
                f"MFUMonitor has no bf16 peak FLOP/s for {name}, so perf/mfu is not logged: set "
                f"{option('MFUMonitor', 'peak_flops')} to the dense per-device peak from the datasheet."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._read_float8(trainer.precision_plugin)
        self._last_global_step = trainer.global_step  # > 0 when resuming from a checkpoint
        self._at_fit_start = self._run_base  # restored by load_state_dict when resuming
        if self.measure_peak:
            if self._facts.is_cuda:
                self._measured_peak = measure_peak_flops(self._device, torch.bfloat16)
                torch.cuda.reset_peak_memory_stats(self._device)  # memory of the run's own GPU: the probe's matrices are not the model's
            else:
                rank_zero_warn(f"{option('MFUMonitor', 'measure_peak', True)} needs a CUDA device; perf/mfu_measured is not logged.")
        if self.warmup_steps == 0:
            self._start_window()

    def _read_float8(self, plugin: Any) -> None:
        # Read here, not in setup: Float8Precision converts in configure_model, and says fp8 only when a layer
        # converted. The fp8 peak is weighted by the share of FLOPs that runs in float8 (perf/mfu.py).
        if self.dtype is not None or not is_fp8(plugin):
            return
        self._dtype = "fp8"
        self._peak, peak_fp8, _ = mfu_peaks(self._facts, "fp8", self.peak_flops)
        share = plugin.float8_flop_share() if isinstance(plugin, Float8Precision) else 1.0
        self._peak_fp8 = mfu.fp8_weighted_peak(self._peak, peak_fp8, share)
        if isinstance(plugin, Float8Precision) and self._peak_fp8 is not None:
            rank_zero_info(f"MFUMonitor: the float8 peak is weighted by the {100 * share:.1f}% of the FLOPs in "
                           "float8 layers.")

    def _flops_for(self, pl_module: pl.LightningModule, batch: Any, batch_idx: int, tokens: int) -> Optional[float]:
        """FLOPs per token: given, the module's own count, or counted once per sequence length."""
        if self.flops_per_token is not None:
            self.flops_source = "flops_per_token="
            return self.flops_per_token
        seq_len = _seq_len(batch)
        if self._counter.running:  # this step was counted (started at on_train_batch_start)
            counted = self._flops_cache[self._counting] = self._counted(pl_module, self._counter.stop(), tokens)
            if counted is not None:
                self._counted_fpt[self._counting] = counted
        if seq_len not in self._flops_cache:
            self._flops_cache[seq_len] = model_flops_per_token(pl_module, seq_len)
            if self._flops_cache[seq_len] is not None:
                self.flops_source = f"{type(pl_module).__name__}.flops_per_token"
        return self._flops_cache[seq_len]

    def _counted(self, pl_module: pl.LightningModule, flops: int, tokens: int) -> Optional[float]:
        """FLOPs per token from the counted step, or ``None`` with the warning naming the fix."""
        name = type(pl_module).__name__
        fix = f"define `flops_per_token(seq_len)` on {name} or set {option('MFUMonitor', 'flops_per_token')}."
        if tokens <= 0:  # said once by on_train_batch_end
            return None
        if flops <= 0:
            rank_zero_warn(f"MFUMonitor counted no matmul FLOPs in a training step of {name}, so TFLOP/s and MFU are not logged: {fix}")
            return None
        self.flops_source = f"{name}.training_step, counted over a real step"
        if not self._said_flops:
            self._said_flops = True
            rank_zero_info(f"MFUMonitor: {flops / tokens / 1e6:.4g} MFLOPs per token at sequence length {self._counting}, "
                           f"counted over a real training step of {name} (each new length is counted once, unsaid).")
        return flops / tokens

    def _start_count(self, pl_module: pl.LightningModule, batch: Any) -> None:
        """Count the FLOPs of this step when this sequence length has no count yet and nothing else gives one."""
        if self.flops_per_token is not None or self._counter.running or callable(getattr(pl_module, "flops_per_token", None)):
            return
        seq_len = _seq_len(batch)
        if seq_len not in self._flops_cache:
            if not self._said_compiled and is_compiled(pl_module):
                self._said_compiled = True
                rank_zero_info(
                    f"MFUMonitor: {type(pl_module).__name__} is compiled, so the step counted at each new sequence length "
                    "runs eagerly and its numbers differ from a compiled step's in the last bits; define "
                    f"`flops_per_token(seq_len)` on it or set {option('MFUMonitor', 'flops_per_token')} to keep every step compiled."
                )
            self._counting = seq_len
            self._counter.start()

    def _abandon_count(self) -> None:
        if self._counter.running:
            self._counter.stop()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        now = self._clock()
        self._end_pause(now)
        if self._last_batch_end is not None:
            self._wait += max(now - self._last_batch_end - self._gap_paused, 0.0)
        self._gap_paused = 0.0
        self._start_count(pl_module, batch)

    def _start_pause(self, trainer: pl.Trainer) -> None:
        """Validation or a checkpoint save begins between two training batches: its time is not the window's."""
        if self._last_batch_end is not None and self._pause_start is None and not trainer.sanity_checking:
            _synchronize(self._device)  # the training work queued so far belongs to the window
            self._pause_start = self._clock()

    def _end_pause(self, now: Optional[float] = None) -> None:
        """The pause (if one began) ends: its seconds are taken out of the window and the wait for the next batch."""
        if self._pause_start is None:
            return
        if now is None:
            _synchronize(self._device)
            now = self._clock()
        paused, self._pause_start = now - self._pause_start, None
        self._paused += paused
        self._gap_paused += paused

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_pause(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_pause()  # a checkpoint saved next starts a pause of its own

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._start_pause(trainer)  # ends at the next training batch: the write has no hook of its own

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        input_ids = input_ids_of(batch)
        tokens = self.tokens_fn(batch) if self.tokens_fn is not None else (input_ids.numel() if input_ids is not None else 0)
        if tokens <= 0 and not self._warned_no_tokens:
            self._warned_no_tokens = True
            rank_zero_warn(
                f"MFUMonitor found no tokens in the batch of {type(pl_module).__name__}, so tokens/s, TFLOP/s and MFU "
                f"are not measured: set {option('MFUMonitor', 'tokens_fn')} or give the batch an integer input-ids tensor "
                "(batch[0] or batch['input_ids']; float features are not counted as tokens)."
            )
        flops = self._flops_for(pl_module, batch, batch_idx, tokens)  # per token position, padding included
        real = self._real_tokens(batch) if self.tokens_fn is None else None
        real = tokens if real is None else real
        self._tally.add(tokens, real, flops)
        self._run.add(tokens, real, flops)
        if trainer.global_step != self._last_global_step:  # an optimizer step finished with this batch
            self._last_global_step = trainer.global_step
            self._at_step, self._counted_at_step = self._run.copy(), dict(self._counted_fpt)
            self._steps += 1
            if self._steps == self.warmup_steps:
                self._start_window()
            elif self._steps > self.warmup_steps and (self._steps - self.warmup_steps) % self._window == 0:
                self._end_window(trainer, pl_module)
        self._last_batch_end = self._clock()

    def _real_tokens(self, batch: Any) -> Optional[Any]:
        """The batch's tokens that are not padding (a device count, not read), said once; ``None`` without a mask."""
        found = real_tokens_of(batch)
        if found is None:
            unreadable = None if self._said_mask_shape else padding_unreadable(batch)
            if unreadable:
                self._said_mask_shape = True
                rank_zero_warn(f"MFUMonitor: {unreadable} {option('MFUMonitor', 'tokens_fn')} counts the real tokens.")
            return None
        count, key = found
        if not self._padding_seen:
            which = "the positions it keeps" if key == "attention_mask" else "the positions not -100"
            caveat = "" if key == "attention_mask" else (
                " Positions a batch leaves out of the loss (a fine-tuning prompt) count as padding too: an "
                f"attention_mask in the batch, or {option('MFUMonitor', 'tokens_fn')}, counts them."
            )
            rank_zero_info(
                f"MFUMonitor: tokens are counted from the batch's {key} ({which}), padding left out: perf/tokens_per_sec "
                f"and the MFU are those of the real tokens, perf/tokens_per_sec_padded the rate with padding.{caveat}"
            )
        self._padding_seen = True
        return count

    def _start_window(self) -> None:
        _synchronize(self._device)
        self._window_start = self._clock()
        self._tally, self._wait, self._paused = TokenTally(), 0.0, 0.0

    def _end_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _synchronize(self._device)
        now = self._clock()
        tokens, flops, known = self._tally.read()  # after the synchronisation: no wait of its own
        totals = WindowTotals(
            tokens=tokens,
            flops=flops if known else None,
            seconds=now - self._window_start - self._paused,
            steps=self._window,
            wait=self._wait,
            padded=self._tally.positions if self._padding_seen else None,
        )
        self.windows.append(totals)
        metrics = window_metrics(
            tokens=totals.tokens,
            flops=totals.flops,
            elapsed=totals.seconds,
            steps=totals.steps,
            wait=totals.wait,
            replicas=data_parallel_size(trainer),
            peak=self._peak,
            peak_fp8=self._peak_fp8,
            measured_peak=self._measured_peak,
            tensor_parallel=tensor_parallel_size(trainer),
            padded_tokens=totals.padded,
        )
        metrics.update(mfu.memory_stats(self._facts))
        self.history.append(metrics)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
            if self.prog_bar:
                self._show_in_progress_bar(trainer, metrics)
        self._window_start = self._clock()
        self._tally, self._wait, self._paused = TokenTally(), 0.0, 0.0

    @property
    def total_tokens(self) -> int:
        """Tokens trained on in the run, per device, with those before a resume (waits for the device)."""
        return self._run_base[0] + self._run.read()[0]

    @property
    def total_flops(self) -> float:
        """Model FLOPs of :attr:`total_tokens` (per device). Reading it waits for the device."""
        return self._run_base[1] + self._run.read()[1]

    @override
    def state_dict(self) -> dict[str, Any]:
        """The logged windows, the token/FLOP totals and the FLOPs per token counted, at the last optimizer step.

        Plain numbers only (``weights_only=True``). Timing windows are not saved: a resumed run warms up again.
        """
        tokens, flops, _ = self._at_step.read()
        return {
            "history": [dict(m) for m in self.history],
            "total_tokens": self._run_base[0] + tokens,
            "total_flops": self._run_base[1] + flops,
            "counted_flops_per_token": [[seq_len, fpt] for seq_len, fpt in self._counted_at_step.items()],
            "flops_source": self.flops_source,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [dict(m) for m in state_dict.get("history", [])]
        self._run_base = (int(state_dict.get("total_tokens", 0)), float(state_dict.get("total_flops", 0.0)))
        self._run, self._at_step = TokenTally(), TokenTally()
        counted = {seq_len: float(fpt) for seq_len, fpt in state_dict.get("counted_flops_per_token", [])}
        self._flops_cache.update(counted)
        self._counted_fpt.update(counted)
        self._counted_at_step = dict(self._counted_fpt)
        if counted:
            self.flops_source = state_dict.get("flops_source") or self.flops_source

    @staticmethod
    def _show_in_progress_bar(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        # Plain floats, shown until the next window. (`self.log(prog_bar=True)` would store device
        # tensors that the bar reads with `.item()`, a GPU sync on every refresh.)
        if "perf/tokens_per_sec" not in metrics:  # no tokens in the batches
            return
        shown = {"tok/s": round(metrics["perf/tokens_per_sec"])}
        if "perf/mfu" in metrics:
            shown["mfu"] = round(metrics["perf/mfu"], 4)
        show_in_progress_bar(trainer, shown)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._abandon_count()  # a step that raised mid-count: the counting mode must not outlive it

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._abandon_count()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.report:
            return
        self.summary = self._summarise(trainer, pl_module)
        if trainer.is_global_zero:
            rank_zero_info(self.summary["text"])

    def _summarise(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        start_tokens, start_flops = self._at_fit_start
        fit_tokens, fit_flops, _ = self._run.read()
        resumed = start_tokens > 0
        peak_pcts = [m["mem/peak_pct"] for m in self.history[len(self.history) - len(self.windows):] if "mem/peak_pct" in m]
        return summarise_windows(
            self.windows,
            window=self._window,
            warmup_steps=self.warmup_steps,
            dtype=self._dtype,
            fit_tokens=fit_tokens,
            fit_flops=fit_flops,
            replicas=data_parallel_size(trainer),
            peak=self._peak,
            peak_fp8=self._peak_fp8,
            measured_peak=self._measured_peak,
            peak_memory_pct=max(peak_pcts) if peak_pcts else None,
            run_tokens=start_tokens + fit_tokens if resumed else None,
            run_flops=start_flops + fit_flops if resumed else None,
            on_cuda=self._facts.is_cuda,
            compiled=is_compiled(pl_module),
            tensor_parallel=tensor_parallel_size(trainer),
            workers=_workers_option(trainer),
        )


def _workers_option(trainer: pl.Trainer) -> str:
    """What raises the training loader's workers: ``TextDataModule``'s option, or the loader's own ``num_workers``."""
    from lightning_gpuopt.data import TextDataModule

    if isinstance(trainer.datamodule, TextDataModule):
        return f"the loader's workers ({option('TextDataModule', 'num_workers')})"
    return "the training DataLoader's num_workers"
