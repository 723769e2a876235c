"""What ``MFUMonitor`` measures in one fit, as objects that need no Trainer: the timing window, the FLOPs per
token, the token and FLOP tallies of the window and the run, the windows logged.

``MFUMeter`` is to ``MFUMonitor`` what Lightning's ``Throughput`` is to its ``ThroughputMonitor``: the callback
reads the Trainer and logs; the meter keeps the numbers. Its parts:

* :class:`TimingWindow`: the seconds of the current window, validation and checkpoint saves left out, and the
  data-loader wait between batches;
* :class:`FlopsPerToken`: FLOPs per token by sequence length, given, asked from the module, or counted over a
  real training step;
* :class:`MFUMeter`: both, with the optimizer steps (warm-up, then a window every ``window`` steps), the run's
  totals across a resume, the windows logged and what a checkpoint saves.

The device is synchronised only where a window ends or a pause begins or ends. The arithmetic of a window's
metrics and of the report is in :mod:`lightning_gpuopt.perf.mfu`.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_gpuopt.option_checks import option
from lightning_gpuopt.perf.compiled import is_compiled
from lightning_gpuopt.perf.device import DeviceFacts
from lightning_gpuopt.perf.flops import StepFlopCounter, model_flops_per_token
from lightning_gpuopt.perf import mfu
from lightning_gpuopt.perf.mfu import (TokenTally, WindowTotals, input_ids_of, padding_unreadable, real_tokens_of,
                                       summarise_windows, window_metrics)

__all__ = ["FlopsPerToken", "MFUMeter", "TimingWindow", "seq_len_of"]


def seq_len_of(batch: Any) -> Optional[int]:
    """The sequence length of a batch's input ids (the key of a FLOPs count), ``None`` without them."""
    input_ids = input_ids_of(batch)
    return int(input_ids.shape[-1]) if input_ids is not None and input_ids.dim() > 0 else None


class TimingWindow:
    """The seconds of the current window and its tokens: training time with pauses (validation, checkpoint
    saves) taken out, and the seconds spent waiting for the next batch.

    Times are given (``now``), so the window is plain arithmetic; :class:`MFUMeter` reads its clock.
    """

    def __init__(self) -> None:
        self.start: Optional[float] = None  # None: no window started (warm-up)
        self.tally = TokenTally()  # the window's tokens and FLOPs
        self.wait = 0.0  # seconds waiting for batches
        self.paused = 0.0  # seconds spent in validation or checkpoint saves
        self.pause_start: Optional[float] = None
        self.gap_paused = 0.0  # of those, the seconds since the last training batch
        self.last_batch_end: Optional[float] = None

    def restart(self, now: float) -> None:
        """A new window starts at ``now``: empty tally, no wait, no pause."""
        self.start = now
        self.tally, self.wait, self.paused = TokenTally(), 0.0, 0.0

    def batch_starts(self, now: float) -> None:
        """A training batch starts: a pause ends, the wait since the last batch (pauses left out) is added."""
        self.end_pause(now)
        if self.last_batch_end is not None:
            self.wait += max(now - self.last_batch_end - self.gap_paused, 0.0)
        self.gap_paused = 0.0

    def can_pause(self) -> bool:
        """A pause begins only between two training batches, and once."""
        return self.last_batch_end is not None and self.pause_start is None

    def begin_pause(self, now: float) -> None:
        self.pause_start = now

    def end_pause(self, now: float) -> None:
        """The pause (if one began) ends at ``now``: its seconds leave the window and the wait for the next batch."""
        if self.pause_start is None:
            return
        paused, self.pause_start = now - self.pause_start, None
        self.paused += paused
        self.gap_paused += paused

    def seconds(self, now: float) -> float:
        """Training seconds of the window up to ``now``."""
        return now - self.start - self.paused


class FlopsPerToken:
    """FLOPs per token by sequence length: ``given``, the module's own ``flops_per_token(seq_len)``, or counted
    over the first real training step at each new length (:meth:`start_count` before it, :meth:`for_batch` after).

    Args:
        given: Training FLOPs per token for every batch (``MFUMonitor(flops_per_token=...)``).
        source: How the FLOPs were found so far (carried over from an earlier fit).
    """

    def __init__(self, given: Optional[float] = None, source: Optional[str] = None) -> None:
        self.given = given
        self.source = source  # how the FLOPs per token were found
        self._cache: dict[Optional[int], Optional[float]] = {}  # by sequence length
        self._counted: dict[Optional[int], float] = {}  # the entries of _cache counted over a real step
        self._counted_at_step: dict[Optional[int], float] = {}  # those counted up to the last optimizer step
        self._counter, self._counting = StepFlopCounter(), None  # the step being counted, by sequence length
        self._said: set[str] = set()  # messages said once a fit

    @property
    def running(self) -> bool:
        """Whether a step is being counted now."""
        return self._counter.running

    def start_count(self, module: nn.Module, batch: Any) -> None:
        """Count the FLOPs of this step when its sequence length has no count yet and nothing else gives one."""
        if self.given is not None or self._counter.running or callable(getattr(module, "flops_per_token", None)):
            return
        seq_len = seq_len_of(batch)
        if seq_len not in self._cache:
            if "compiled" not in self._said and is_compiled(module):
                self._said.add("compiled")
                rank_zero_info(
                    f"MFUMonitor: {type(module).__name__} is compiled, so the step counted at each new sequence length "
                    "runs eagerly and its numbers differ from a compiled step's in the last bits; define "
                    f"`flops_per_token(seq_len)` on it or set {option('MFUMonitor', 'flops_per_token')} "
                    "to keep every step compiled."
                )
            self._counting = seq_len
            self._counter.start()

    def for_batch(self, module: nn.Module, batch: Any, tokens: int) -> Optional[float]:
        """FLOPs per token of a batch of ``tokens`` positions just trained on (ends a count started for it)."""
        if self.given is not None:
            self.source = "flops_per_token="
            return self.given
        seq_len = seq_len_of(batch)
        if self._counter.running:  # this step was counted (started by start_count)
            counted = self._cache[self._counting] = self._from_count(module, self._counter.stop(), tokens)
            if counted is not None:
                self._counted[self._counting] = counted
        if seq_len not in self._cache:
            self._cache[seq_len] = model_flops_per_token(module, seq_len)
            if self._cache[seq_len] is not None:
                self.source = f"{type(module).__name__}.flops_per_token"
        return self._cache[seq_len]

    def _from_count(self, module: nn.Module, flops: int, tokens: int) -> Optional[float]:
        """FLOPs per token from the counted step, or ``None`` with the warning naming the fix."""
        name = type(module).__name__
        fix = f"define `flops_per_token(seq_len)` on {name} or set {option('MFUMonitor', 'flops_per_token')}."
        if tokens <= 0:  # said once by the monitor
            return None
        if flops <= 0:
            rank_zero_warn(f"MFUMonitor counted no matmul FLOPs in a training step of {name}, "
                           f"so TFLOP/s and MFU are not logged: {fix}")
            return None
        self.source = f"{name}.training_step, counted over a real step"
        if "flops" not in self._said:  # once, not once per sequence length
            self._said.add("flops")
            rank_zero_info(f"MFUMonitor: {flops / tokens / 1e6:.4g} MFLOPs per token at sequence length "
                           f"{self._counting}, counted over a real training step of {name} "
                           "(each new length is counted once, unsaid).")
        return flops / tokens

    def abandon(self) -> None:
        """A step that raised mid-count, or the end of a fit: the counting mode must not outlive it."""
        if self._counter.running:
            self._counter.stop()

    def step_done(self) -> None:
        """An optimizer step finished: what a checkpoint saves is the counts up to here."""
        self._counted_at_step = dict(self._counted)

    def saved(self) -> list[list[Any]]:
        """The counts up to the last optimizer step, as ``[[seq_len, flops_per_token], ...]``."""
        return [[seq_len, fpt] for seq_len, fpt in self._counted_at_step.items()]

    def restore(self, counted: list[list[Any]], source: Optional[str]) -> None:
        """Counts saved by :meth:`saved`, not counted again; ``source`` is taken when there are any."""
        restored = {seq_len: float(fpt) for seq_len, fpt in counted}
        self._cache.update(restored)
        self._counted.update(restored)
        self._counted_at_step = dict(self._counted)
        if restored:
            self.source = source or self.source


class MFUMeter:
    """The measuring state of one fit: optimizer steps in windows, tokens and FLOPs, the windows' metrics.

    Example::

        meter = MFUMeter(window=10, warmup_steps=3, peak=989.4e12)
        meter.start(global_step=0)
        meter.batch_starts()                      # before each micro-batch
        meter.add(positions, real, fpt)          # after it: its token positions, real tokens, FLOPs per token
        if meter.step_ends(global_step):          # an optimizer step that closes a window
            metrics = meter.end_window(replicas, tensor_parallel)
        meter.batch_ends()

    Args:
        window: Optimizer steps per window.
        warmup_steps: Optimizer steps before the first window.
        device, facts: The training device (synchronised where a window ends) and its facts (``mem/*`` metrics).
        peak, peak_fp8: FLOP/s for ``perf/mfu`` and ``perf/mfu_fp8`` (``None``: not logged).
        flops: The FLOPs-per-token finder (default: counted or asked of the module).
        clock: Function returning seconds (default ``time.perf_counter``).
    """

    def __init__(
        self,
        window: int = 1,
        warmup_steps: int = 0,
        device: Optional[torch.device] = None,
        facts: Optional[DeviceFacts] = None,
        peak: Optional[float] = None,
        peak_fp8: Optional[float] = None,
        flops: Optional[FlopsPerToken] = None,
        clock: Optional[Callable[[], float]] = None,
    ) -> None:
        self.window, self.warmup_steps = window, warmup_steps
        self.device, self.facts = device or torch.device("cpu"), facts or DeviceFacts("cpu", "cpu")
        self.peak, self.peak_fp8, self.measured_peak = peak, peak_fp8, None  # FLOP/s: bf16, fp8, timed
        self.flops = flops or FlopsPerToken()
        self.clock = clock or time.perf_counter
        self.timing = TimingWindow()
        self.history: list[dict[str, float]] = []  # one entry per logged window, those before a resume included
        self.windows: list[WindowTotals] = []  # what each window of this fit measured: the report adds these up
        self.steps = 0  # optimizer steps seen in this fit
        self.last_global_step: Optional[int] = None
        self.run_base = (0, 0.0)  # tokens and model FLOPs (per data-parallel rank) before this fit, from a checkpoint
        self.at_fit_start = (0, 0.0)  # run_base when the fit started (the report's resumed run)
        self.run = TokenTally()  # this fit's tokens and FLOPs
        self.at_step = TokenTally()  # this fit's at the last optimizer step (what a checkpoint saves)
        self._said: set[str] = set()  # messages said once a fit; "padding": a batch said which positions are padding

    def synchronize(self) -> None:
        """Wait for the device's queued work: only where a window ends or validation or a save pauses it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a measurement: the window's time must include the GPU's queued work

    def start(self, global_step: int) -> None:
        """The fit's training starts at ``global_step`` (> 0 when resumed); without warm-up, the first window too."""
        self.last_global_step = global_step
        self.at_fit_start = self.run_base  # restored by load_state_dict when resuming
        if self.warmup_steps == 0:
            self.start_window()

    def start_window(self) -> None:
        self.synchronize()
        self.timing.restart(self.clock())

    def batch_starts(self) -> None:
        self.timing.batch_starts(self.clock())

    def batch_ends(self) -> None:
        self.timing.last_batch_end = self.clock()

    def pause(self) -> None:
        """Validation or a checkpoint save begins between two training batches: its time is not the window's."""
        if self.timing.can_pause():
            self.synchronize()  # the training work queued so far belongs to the window
            self.timing.begin_pause(self.clock())

    def resume(self) -> None:
        """A pause (if one began) ends now."""
        if self.timing.pause_start is not None:
            self.synchronize()
            self.timing.end_pause(self.clock())

    def real_tokens(self, batch: Any) -> Optional[Any]:
        """The batch's tokens that are not padding (a device count, not read), read from its ``attention_mask`` or
        ``labels`` (:func:`~lightning_gpuopt.perf.mfu.real_tokens_of`), said once; ``None`` without a mask."""
        found = real_tokens_of(batch)
        if found is None:
            unreadable = None if "mask shape" in self._said else padding_unreadable(batch)
            if unreadable:
                self._said.add("mask shape")
                rank_zero_warn(f"MFUMonitor: {unreadable} {option('MFUMonitor', 'tokens_fn')} counts the real tokens.")
            return None
        count, key = found
        if "padding" not in self._said:
            which = "the positions it keeps" if key == "attention_mask" else "the positions not -100"
            caveat = "" if key == "attention_mask" else (
                " Positions a batch leaves out of the loss (a fine-tuning prompt) count as padding too: an "
                f"attention_mask in the batch, or {option('MFUMonitor', 'tokens_fn')}, counts them."
            )
            rank_zero_info(
                f"MFUMonitor: tokens are counted from the batch's {key} ({which}), padding left out: "
                "perf/tokens_per_sec and the MFU are those of the real tokens, perf/tokens_per_sec_padded the rate "
                f"with padding.{caveat}"
            )
        self._said.add("padding")
        return count

    def say_once(self, key: str) -> bool:
        """``True`` the first time ``key`` is asked in this fit: for messages said once."""
        first = key not in self._said
        self._said.add(key)
        return first

    def add(self, tokens: int, real: Any, flops_per_token: Optional[float]) -> None:
        """A micro-batch's token positions, real tokens and FLOPs per token, to the window and the run."""
        self.timing.tally.add(tokens, real, flops_per_token)
        self.run.add(tokens, real, flops_per_token)

    def step_ends(self, global_step: int) -> bool:
        """After a micro-batch: whether it ended a window (the Trainer's ``global_step`` says whether an optimizer
        step ended with it)."""
        if global_step == self.last_global_step:
            return False
        self.last_global_step = global_step
        self.at_step = self.run.copy()
        self.flops.step_done()
        self.steps += 1
        if self.steps == self.warmup_steps:
            self.start_window()
            return False
        return self.steps > self.warmup_steps and (self.steps - self.warmup_steps) % self.window == 0

    def end_window(self, replicas: int = 1, tensor_parallel: int = 1) -> dict[str, float]:
        """Close the window: its metrics (kept in :attr:`history`, the counts in :attr:`windows`); the next starts."""
        self.synchronize()
        now = self.clock()
        tally = self.timing.tally
        tokens, flops, known = tally.read()  # after the synchronisation: no wait of its own
        totals = WindowTotals(
            tokens=tokens,
            flops=flops if known else None,
            seconds=self.timing.seconds(now),
            steps=self.window,
            wait=self.timing.wait,
            padded=tally.positions if "padding" in self._said else None,
        )
        self.windows.append(totals)
        metrics = window_metrics(
            tokens=totals.tokens,
            flops=totals.flops,
            elapsed=totals.seconds,
            steps=totals.steps,
            wait=totals.wait,
            replicas=replicas,
            peak=self.peak,
            peak_fp8=self.peak_fp8,
            measured_peak=self.measured_peak,
            tensor_parallel=tensor_parallel,
            padded_tokens=totals.padded,
        )
        metrics.update(mfu.memory_stats(self.facts))  # through the module: a test stands in CUDA's numbers
        self.history.append(metrics)
        self.timing.restart(self.clock())
        return metrics

    @property
    def total_tokens(self) -> int:
        """Tokens trained on in the run, per device, with those before a resume (waits for the device)."""
        return self.run_base[0] + self.run.read()[0]

    @property
    def total_flops(self) -> float:
        """Model FLOPs of :attr:`total_tokens` (per device). Reading it waits for the device."""
        return self.run_base[1] + self.run.read()[1]

    def state_dict(self) -> dict[str, Any]:
        """The logged windows, the token/FLOP totals and the FLOPs per token counted, at the last optimizer step.

        Plain numbers only (``weights_only=True``). Timing windows are not saved: a resumed run warms up again.
        """
        tokens, flops, _ = self.at_step.read()
        return {
            "history": [dict(m) for m in self.history],
            "total_tokens": self.run_base[0] + tokens,
            "total_flops": self.run_base[1] + flops,
            "counted_flops_per_token": self.flops.saved(),
            "flops_source": self.flops.source,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [dict(m) for m in state_dict.get("history", [])]
        self.run_base = (int(state_dict.get("total_tokens", 0)), float(state_dict.get("total_flops", 0.0)))
        self.run, self.at_step = TokenTally(), TokenTally()
        self.flops.restore(state_dict.get("counted_flops_per_token", []), state_dict.get("flops_source"))

    def summarise(self, *, dtype: str, **context: Any) -> dict[str, Any]:
        """The end-of-fit report over this fit's windows (:func:`~lightning_gpuopt.perf.mfu.summarise_windows`);
        ``context``: its ``replicas``, ``on_cuda``, ``compiled``, ``tensor_parallel`` and ``workers``."""
        start_tokens, start_flops = self.at_fit_start
        fit_tokens, fit_flops, _ = self.run.read()
        resumed = start_tokens > 0
        this_fit = self.history[len(self.history) - len(self.windows):]
        peak_pcts = [m["mem/peak_pct"] for m in this_fit if "mem/peak_pct" in m]
        return summarise_windows(
            self.windows,
            window=self.window,
            warmup_steps=self.warmup_steps,
            dtype=dtype,
            fit_tokens=fit_tokens,
            fit_flops=fit_flops,
            peak=self.peak,
            peak_fp8=self.peak_fp8,
            measured_peak=self.measured_peak,
            peak_memory_pct=max(peak_pcts) if peak_pcts else None,
            run_tokens=start_tokens + fit_tokens if resumed else None,
            run_flops=start_flops + fit_flops if resumed else None,
            **context,
        )
