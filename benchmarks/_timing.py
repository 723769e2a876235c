"""Timing of training steps: one mark per optimizer step, CUDA events on a GPU, wall clock on CPU.

A mark is recorded at the same point of every optimizer step; the step time is the interval
between consecutive marks. On CUDA the marks are events in the device's stream, so no
synchronisation is added to the loop being measured (events are read once, at the end); a
step's time then includes any time the GPU sat idle waiting for the host, as it should.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

import torch

__all__ = ["StepClock", "step_stats"]


class StepClock:
    """Marks the end of each optimizer step and gives the intervals between marks, in seconds.

    Example::

        clock = StepClock(torch.device("cuda"))
        for step in range(n):
            train_step()
            clock.mark()
        seconds = clock.intervals()  # n - 1 step times

    Args:
        device: The training device: CUDA events there, ``time.perf_counter`` elsewhere.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._marks: list[Any] = []
        self._wall: list[float] = []  # host time of each mark (for warm-up and start-up times)

    def mark(self) -> None:
        """Record the end of an optimizer step (does not synchronise)."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())
        self._wall.append(time.perf_counter())

    def __len__(self) -> int:
        return len(self._marks)

    def wall(self, index: int) -> float:
        """Host ``time.perf_counter()`` at mark ``index``."""
        return self._wall[index]

    def intervals(self, start: int = 0) -> list[float]:
        """Seconds between marks ``start``, ``start + 1``, ... (synchronises once on CUDA)."""
        marks = self._marks[start:]
        if self.device.type == "cuda" and marks:
            marks[-1].synchronize()
            return [a.elapsed_time(b) / 1000 for a, b in zip(marks, marks[1:])]
        return [b - a for a, b in zip(marks, marks[1:])]


def step_stats(seconds: list[float]) -> dict[str, Optional[float]]:
    """Median, mean, spread and extremes of step times, in milliseconds.

    ``spread_pct`` is the interquartile range over the median: how steady the steps are.

    Example::

        step_stats([0.10, 0.11, 0.10])["median_ms"]  # 100.0

    Args:
        seconds: Step times in seconds.
    """
    if not seconds:
        return {k: None for k in ("median_ms", "mean_ms", "p10_ms", "p90_ms", "min_ms", "max_ms", "spread_pct")}
    ms = sorted(1000 * s for s in seconds)
    median = statistics.median(ms)
    if len(ms) >= 4:
        q1, _, q3 = statistics.quantiles(ms, n=4)
        deciles = statistics.quantiles(ms, n=10)
        p10, p90 = deciles[0], deciles[-1]
    else:
        q1, q3, p10, p90 = ms[0], ms[-1], ms[0], ms[-1]
    return {
        "median_ms": median,
        "mean_ms": statistics.fmean(ms),
        "p10_ms": p10,
        "p90_ms": p90,
        "min_ms": ms[0],
        "max_ms": ms[-1],
        "spread_pct": 100 * (q3 - q1) / median if median > 0 else None,
    }
