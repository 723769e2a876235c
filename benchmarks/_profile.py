"""Where the time of a few training steps goes: ``torch.profiler`` over extra steps, folded into kernel categories.

Used by ``python -m benchmarks.throughput --profile-steps N``: after a configuration's measured
steps, N more optimizer steps run under the profiler (so profiling never slows the measured ones),
and the result says, per optimizer step, how long the device spent in matmuls, attention, the
optimizer, normalisation and the rest, how long it sat idle between kernels, and which kernels
took longest. That is the first question when MFU falls short: slow matmuls, or time outside them.

On CUDA the categories sum kernel times (``self_device_time_total`` of the device events) and idle
time is the profiled span minus the union of kernel intervals; on CPU they sum operator self times
and there is no idle time.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

__all__ = ["CATEGORIES", "StepProfiler", "categorise", "summarise_profile"]

# First match wins; names of CUDA kernels (cuBLAS, CUTLASS, Triton, flash) and of CPU aten operators.
CATEGORIES: list[tuple[str, re.Pattern[str]]] = [
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|scaled_dot_product", re.I)),
    ("matmul", re.compile(r"gemm|matmul|cutlass|xmma|nvjet|cublas|wgmma|_scaled_mm|aten::(mm|addmm|bmm|baddbmm)\b", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach|optimizer", re.I)),
    ("norm", re.compile(r"layer_norm|layernorm|rms_norm|_norm_", re.I)),
    ("communication", re.compile(r"nccl|gloo|all_reduce|allreduce|all_gather|reduce_scatter", re.I)),
    ("memcpy", re.compile(r"memcpy|memset|aten::copy_", re.I)),
]


def categorise(name: str) -> str:
    """The category of a kernel or operator name (``"other"`` when none matches).

    Example::

        >>> categorise("sm90_xmma_gemm_bf16bf16_bf16f32"), categorise("flash_fwd_kernel"), categorise("triton_poi_fused_add_0")
        ('matmul', 'attention', 'other')

    Args:
        name: A CUDA kernel name or a profiler operator name (``aten::mm``).
    """
    return next((category for category, pattern in CATEGORIES if pattern.search(name)), "other")


def _union_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy


def summarise_profile(prof: profile, steps: int, device: torch.device, top: int = 30) -> dict[str, Any]:
    """Per-step device time by category, idle time between kernels, and the longest kernels.

    Example::

        with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                train_step()
        summarise_profile(prof, steps=3, device=torch.device("cuda"))["categories"]["matmul"]["pct"]

    Args:
        prof: A stopped ``torch.profiler.profile``.
        steps: Optimizer steps it covered.
        device: The training device (CUDA: kernel times; otherwise: operator self times on the CPU).
        top: How many of the longest kernels / operators to list.

    Returns:
        ``{"steps", "source", "busy_ms_per_step", "idle_pct", "categories": {name: {"ms_per_step", "pct"}},
        "top": [[name, ms_per_step, pct, calls_per_step], ...]}``; ``idle_pct`` is ``None`` off CUDA.
    """
    cuda = device.type == "cuda"
    # GPU user annotations (record_function ranges such as "Optimizer.step#AdamW.step" or Inductor's
    # "## Call CompiledFxGraph ##") are device-side events too; they span kernels, they are not kernels.
    rows = [r for r in prof.key_averages() if not getattr(r, "is_user_annotation", False)]
    kernel_rows = [r for r in rows if r.device_type == DeviceType.CUDA]
    if cuda and kernel_rows:
        # Kernel rows only: an operator row's device time repeats the time of the kernels it launched.
        source, picked = "CUDA kernels", [(r, float(r.self_device_time_total)) for r in kernel_rows]
    elif cuda:
        source, picked = "operators (no kernel events)", [(r, float(r.self_device_time_total)) for r in rows]
    else:
        source = "CPU operators"
        picked = [(r, float(r.self_cpu_time_total)) for r in rows if r.device_type == DeviceType.CPU]
    times: dict[str, tuple[float, int]] = {}  # name -> (microseconds, calls)
    for row, us in picked:
        if us > 0:
            total, calls = times.get(row.key, (0.0, 0))
            times[row.key] = (total + us, calls + row.count)
    busy_us = sum(us for us, _ in times.values())
    idle_pct: Optional[float] = None
    if cuda:
        spans = [
            (e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        ]
        if spans:
            span = max(end for _, end in spans) - min(start for start, _ in spans)
            idle_pct = 100 * (1 - _union_us(spans) / span) if span > 0 else None
    categories: dict[str, float] = {}
    for name, (us, _) in times.items():
        category = categorise(name)
        categories[category] = categories.get(category, 0.0) + us
    longest = sorted(times.items(), key=lambda item: -item[1][0])[:top]
    pct = (lambda us: 100 * us / busy_us) if busy_us > 0 else (lambda us: 0.0)
    return {
        "steps": steps,
        "source": source,
        "busy_ms_per_step": busy_us / 1000 / steps,
        "idle_pct": idle_pct,
        "categories": {
            c: {"ms_per_step": us / 1000 / steps, "pct": pct(us)}
            for c, us in sorted(categories.items(), key=lambda item: -item[1])
        },
        "top": [[name, us / 1000 / steps, pct(us), calls / steps] for name, (us, calls) in longest],
    }


class StepProfiler:
    """Profiles the optimizer steps after the measured ones: ``tick()`` after every step's clock mark.

    Example::

        profiler = StepProfiler(device, first_step=25, steps=3)
        for step in range(28):
            train_step()
            clock.mark()
            profiler.tick(len(clock))
        profiler.summary  # None until the last profiled step has ended

    Args:
        device: The training device.
        first_step: Number of optimizer steps done when profiling starts.
        steps: Optimizer steps to profile (0: never starts).
    """

    def __init__(self, device: torch.device, first_step: int, steps: int) -> None:
        self.device, self.first_step, self.steps = device, first_step, steps
        self.summary: Optional[dict[str, Any]] = None  # summarise_profile's, or {"steps", "error"}
        self._prof: Optional[profile] = None

    def tick(self, steps_done: int) -> None:
        """Start or stop the profiler as the step count reaches the window."""
        if self.steps <= 0:
            return
        if steps_done == self.first_step and self._prof is None:
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities)
            self._prof.start()
        elif steps_done == self.first_step + self.steps and self._prof is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the last step's kernels belong in the window
            self._prof.stop()
            try:
                self.summary = summarise_profile(self._prof, self.steps, self.device)
            except Exception as err:  # a profiler API that moved must not cost the measurement
                self.summary = {"steps": self.steps, "error": f"{type(err).__name__}: {err}"}
            self._prof = None

    def close(self) -> None:
        """Stop a profiler a failed run left running."""
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
