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
from lightning_gpuopt.perf.device import training_device
from lightning_gpuopt.perf.mfu import MFU_DTYPES, WindowTotals, fp8_weighted_peak, input_ids_of, mfu_peaks
from lightning_gpuopt.perf.mfu_meter import FlopsPerToken, MFUMeter
from lightning_gpuopt.option_checks import check_choice, check_int, check_number, option
from lightning_gpuopt.perf.peaks import measure_peak_flops
from lightning_gpuopt.perf.parallel import data_parallel_size, tensor_parallel_size
from lightning_gpuopt.precision.dtype import compute_dtype_name, is_fp8
from lightning_gpuopt.precision.float8 import Float8Precision

__all__ = ["MFUMonitor"]


class MFUMonitor(Callback):
    """Logs throughput, TFLOP/s per device, MFU and memory every few optimizer steps, and a report after ``fit``.

    Tokens are counted from the batch's integer input ids (padding left out where an ``attention_mask``
    or ``labels`` of the ids' shape mark it; another shape is warned about once); FLOPs per token are given, asked from
    the module, or counted over the first
    real step at each sequence length. MFU is against the device's dense bf16 datasheet peak. The device
    is synchronised only at the end of a window. Logs ``perf/*`` and ``mem/*`` keys, shows ``tok/s`` and
    ``mfu`` in the progress bar; every key and how each is measured: ``docs/callbacks.md``. What a fit
    measures is kept by an :class:`~lightning_gpuopt.perf.mfu_meter.MFUMeter` (:attr:`meter`), made at ``setup``.

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
        check_number(
            own, "peak_flops", peak_flops, low=0, low_open=True, optional=True, hint=" (in FLOP/s, e.g. 989.4e12)"
        )
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
        self.summary: dict[str, Any] = {}
        self._dtype: Optional[str] = None  # the matmul dtype of this fit, read at setup
        # What this fit measures (the window, the tallies, the FLOPs per token, the history): made anew at setup.
        self._meter = MFUMeter(flops=FlopsPerToken(flops_per_token), clock=self._clock)

    @property
    def meter(self) -> MFUMeter:
        """What the current (or last) fit measured: windows, tallies, FLOPs per token; see :class:`MFUMeter`."""
        return self._meter

    @property
    def history(self) -> list[dict[str, float]]:
        """The metrics of every logged window, those before a resume included."""
        return self._meter.history

    @property
    def windows(self) -> list[WindowTotals]:
        """What each window of this fit measured: the report adds these up."""
        return self._meter.windows

    @property
    def flops_source(self) -> Optional[str]:
        """How the FLOPs per token were found."""
        return self._meter.flops.source

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._meter.flops.abandon()
        self.summary = {}
        device, facts = trainer.strategy.root_device, training_device(trainer)  # binds the plugin too
        plugin = trainer.precision_plugin
        self._dtype = self.dtype or compute_dtype_name(plugin)
        if self._dtype is None:
            rank_zero_warn(
                f"MFUMonitor cannot tell the matmul dtype of the precision plugin {type(plugin).__name__}: assuming "
                f"bf16. Give the plugin a `compute_dtype` property or set {option('MFUMonitor', 'dtype')}."
            )
            self._dtype = "bf16"
        if is_fp8(plugin) and self.dtype is None:
            self._dtype = "fp8"
        # MFU against the dense bf16 peak whatever the run computes in (see perf/mfu.py).
        peak, peak_fp8, name = mfu_peaks(facts, self._dtype, self.peak_flops)
        if peak is None and not facts.is_cuda:  # expected off a GPU: said once, not as a warning
            rank_zero_info(f"MFUMonitor: no peak FLOP/s for {name}, so perf/mfu is not logged "
                           f"({option('MFUMonitor', 'peak_flops')} sets one).")
        elif peak is None:
            rank_zero_warn(
                f"MFUMonitor has no bf16 peak FLOP/s for {name}, so perf/mfu is not logged: set "
                f"{option('MFUMonitor', 'peak_flops')} to the dense per-device peak from the datasheet."
            )
        self._meter = MFUMeter(
            window=self.log_every_n_steps or trainer.log_every_n_steps, warmup_steps=self.warmup_steps, device=device,
            facts=facts, peak=peak, peak_fp8=peak_fp8, clock=self._clock,
            flops=FlopsPerToken(self.flops_per_token, source=self._meter.flops.source),
        )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._read_float8(trainer.precision_plugin)
        meter = self._meter
        if self.measure_peak:
            if meter.facts.is_cuda:
                meter.measured_peak = measure_peak_flops(meter.device, torch.bfloat16)
                # memory of the run's own GPU: the probe's matrices are not the model's
                torch.cuda.reset_peak_memory_stats(meter.device)
            else:
                rank_zero_warn(f"{option('MFUMonitor', 'measure_peak', True)} needs a CUDA device; perf/mfu_measured "
                               "is not logged.")
        meter.start(trainer.global_step)  # > 0 when resuming from a checkpoint

    def _read_float8(self, plugin: Any) -> None:
        # Read here, not in setup: Float8Precision converts in configure_model, and says fp8 only when a layer
        # converted. The fp8 peak is weighted by the share of FLOPs that runs in float8 (perf/mfu.py).
        if self.dtype is not None or not is_fp8(plugin):
            return
        self._dtype = "fp8"
        peak, peak_fp8, _ = mfu_peaks(self._meter.facts, "fp8", self.peak_flops)
        share = plugin.float8_flop_share() if isinstance(plugin, Float8Precision) else 1.0
        self._meter.peak, self._meter.peak_fp8 = peak, fp8_weighted_peak(peak, peak_fp8, share)
        if isinstance(plugin, Float8Precision) and self._meter.peak_fp8 is not None:
            rank_zero_info(f"MFUMonitor: the float8 peak is weighted by the {100 * share:.1f}% of the FLOPs in "
                           "float8 layers.")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._meter.batch_starts()
        self._meter.flops.start_count(pl_module, batch)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._meter.pause()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._meter.resume()  # a checkpoint saved next starts a pause of its own

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if not trainer.sanity_checking:
            self._meter.pause()  # ends at the next training batch: the write has no hook of its own

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        meter = self._meter
        input_ids = input_ids_of(batch)
        tokens = (
            self.tokens_fn(batch) if self.tokens_fn is not None else (input_ids.numel() if input_ids is not None else 0)
        )
        if tokens <= 0 and meter.say_once("no tokens"):
            rank_zero_warn(
                f"MFUMonitor found no tokens in the batch of {type(pl_module).__name__}, so tokens/s, TFLOP/s and MFU "
                f"are not measured: set {option('MFUMonitor', 'tokens_fn')} or give the batch an integer input-ids "
                "tensor (batch[0] or batch['input_ids']; float features are not counted as tokens)."
            )
        flops = meter.flops.for_batch(pl_module, batch, tokens)  # per token position, padding included
        real = meter.real_tokens(batch) if self.tokens_fn is None else None
        meter.add(tokens, tokens if real is None else real, flops)
        if meter.step_ends(trainer.global_step):  # an optimizer step finished with this batch and closed a window
            metrics = meter.end_window(data_parallel_size(trainer), tensor_parallel_size(trainer))
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step)
                if self.prog_bar:
                    self._show_in_progress_bar(trainer, metrics)
        meter.batch_ends()

    @property
    def total_tokens(self) -> int:
        """Tokens trained on in the run, per device, with those before a resume (waits for the device)."""
        return self._meter.total_tokens

    @property
    def total_flops(self) -> float:
        """Model FLOPs of :attr:`total_tokens` (per device). Reading it waits for the device."""
        return self._meter.total_flops

    @override
    def state_dict(self) -> dict[str, Any]:
        """The logged windows, the token/FLOP totals and the FLOPs per token counted, at the last optimizer step.

        Plain numbers only (``weights_only=True``). Timing windows are not saved: a resumed run warms up again.
        """
        return self._meter.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._meter.load_state_dict(state_dict)

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
        self._meter.flops.abandon()  # a step that raised mid-count: the counting mode must not outlive it

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._meter.flops.abandon()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.report:
            return
        self.summary = self._meter.summarise(
            dtype=self._dtype,
            replicas=data_parallel_size(trainer),
            on_cuda=self._meter.facts.is_cuda,
            compiled=is_compiled(pl_module),
            tensor_parallel=tensor_parallel_size(trainer),
            workers=_workers_option(trainer),
        )
        if trainer.is_global_zero:
            rank_zero_info(self.summary["text"])


def _workers_option(trainer: pl.Trainer) -> str:
    """What raises the training loader's workers: ``TextDataModule``'s option, or the loader's own ``num_workers``."""
    from lightning_gpuopt.data import TextDataModule

    if isinstance(trainer.datamodule, TextDataModule):
        return f"the loader's workers ({option('TextDataModule', 'num_workers')})"
    return "the training DataLoader's num_workers"
