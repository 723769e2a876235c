"""The parts of the headline command, their time estimates per device, and the plan that fits them into a budget.

The parts run in value order (``PARTS``). Each has an estimate (``ESTIMATES``, one table per device
family) and, when it starts, a limit: its estimate times ``MARGIN``, never more than what is left of
the budget. A part that reaches its limit is stopped and reported, and the next part still runs;
a part whose estimate no longer fits in what is left is skipped with the reason. The gpu tests are
the one part that is worth starting with less than its estimate: they run correctness first and
stop at their limit with the tests that finished. ``plan`` applies the same rules to the estimates
alone, for the plan printed before the run (and by ``--plan``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from lightning_gpuopt.perf.device import DeviceFacts

__all__ = ["ESTIMATES", "GPU_TEST_FILES", "GRACE_S", "MARGIN", "MEASURED", "PARTS", "Part", "PlanRow",
           "config_estimates", "decide", "estimate_family", "format_plan", "measured_part", "part_estimate",
           "part_keys", "part_micro_batch", "part_repeats", "plan"]

GRACE_S = 5.0  # from a part's interrupt (SIGINT) at its limit to its kill: pytest writes its XML in it
MARGIN = 1.5  # a part may run this many times its estimate before it is stopped (the estimates are guesses)


@dataclass(frozen=True)
class Part:
    """One part of the headline command.

    Args:
        name: Its name in ``--parts``, the results and the log.
        what: One line for the plan and the results.
        kind: ``device`` (in the command's own process), ``doctor``, ``throughput``, ``loss`` (the loss
            microbenchmark, ``benchmarks/loss_bench.py``), ``generation``, ``tests``, ``float8``
            (``benchmarks.float8_bench``) or ``curve`` (``benchmarks.residual_curve``: the loss curve of a bf16
            residual stream against float32) (each a child process with a hard time limit).
        preset: Model preset of a throughput part (``tiny`` under ``--tiny``).
        configs: Its ``benchmarks.throughput`` configurations, in run order.
        fp8_recipe: Its ``--fp8-recipe``.
        micro_batch_size: Its fixed micro-batch (accumulating to the global batch of 64); ``None``: the
            command's ``--micro-batch-size``. Under ``--tiny`` the tiny scale's.
        repeats: Its ``--repeats``, in alternating order: 3 or more where the part compares configurations
            whose difference may be within the run-to-run spread. Under ``--tiny`` one.

    A new throughput part is one ``Part`` here and one estimate per configuration in each ``ESTIMATES`` row
    (``part_keys`` names them; tests/benchmarks/test_headline.py checks that every key exists).
    """

    name: str
    what: str
    kind: Literal["device", "doctor", "throughput", "loss", "generation", "tests", "float8", "curve"]
    preset: Optional[str] = None
    configs: tuple[str, ...] = ()
    fp8_recipe: str = "tensorwise"
    micro_batch_size: Optional[int] = None
    repeats: int = 1


PARTS: tuple[Part, ...] = (
    Part("device", "device facts and versions", "device"),
    Part("doctor", "gpuopt doctor --json: settings, attention kernel, compile probe, float8 layers, measured steps",
         "doctor"),
    Part("throughput-124m", "124m, T 1024, fixed micro-batch: plain Lightning fp32, Lightning bf16-mixed, gpuopt bf16 "
         "+ compile, gpuopt float8 (tensorwise) + compile", "throughput", "124m",
         ("baseline", "lightning-bf16", "gpuopt-bf16-compile", "gpuopt-fp8-compile")),
    Part("loss-bench", "the loss's forward + backward at 65,536 tokens, width 768, vocabulary 50,304: the chunked loss "
         "before and now, with its head in float8, full logits compiled, torch's, Liger's, cut-cross-entropy", "loss"),
    Part("gpu-tests", "the gpu-marked tests, correctness first, each with a timeout", "tests"),
    Part("throughput-774m", "774m, T 1024, fixed micro-batch: gpuopt bf16 + compile against float8 (tensorwise) "
         "+ compile", "throughput", "774m", ("gpuopt-bf16-compile", "gpuopt-fp8-compile")),
    Part("auto-batch-124m", "124m: AutoBatchSize's search time and choice (bf16 + compile, global batch 64), then "
         "the hand-written nanoGPT-style loop from the same micro-batch", "throughput", "124m",
         ("gpuopt-bf16-compile-auto", "torch-loop")),
    Part("fp8-rowwise-124m", "124m, fixed micro-batch: gpuopt float8 (rowwise) + compile", "throughput", "124m",
         ("gpuopt-fp8-compile",), "rowwise"),
    # The step's elementwise options, whose defaults wait for these figures (benchmarks/README.md).
    Part("compile-residual-124m", "124m, micro-batch 64: per-block against whole-model compile (the loss inside), "
         "each with a float32 and a bf16 residual stream; 3 repeats, alternating", "throughput", "124m",
         ("gpuopt-bf16-compile", "gpuopt-bf16-compile-model", "gpuopt-bf16-compile-bf16res",
          "gpuopt-bf16-compile-model-bf16res"), micro_batch_size=64, repeats=3),
    Part("residual-curve-124m", "124m, micro-batch 64, 300 steps on WikiText-2 (--data), the same seed and data "
         "order: the loss curve of a bf16 residual stream against float32, and the tokens/s of each", "curve", "124m"),
    Part("774m-accum", "774m, micro-batch 16 x 4 (global batch 64): gpuopt bf16 against float8 (tensorwise), "
         "compiled; 3 repeats, alternating", "throughput", "774m", ("gpuopt-bf16-compile", "gpuopt-fp8-compile"),
         micro_batch_size=16, repeats=3),
    Part("cuda-graphs-124m", "124m, micro-batch 8 x 8, where the step is launch-bound: the default compile mode "
         "against reduce-overhead (CUDA graphs); 3 repeats, alternating", "throughput", "124m",
         ("gpuopt-bf16-compile", "gpuopt-bf16-compile-cudagraphs"), micro_batch_size=8, repeats=3),
    Part("autotune-124m", "124m, micro-batch 64: the default compile mode against max-autotune-no-cudagraphs "
         "(fused GEMM epilogues; minutes of compile, cached for the later repeats); 3 repeats, alternating",
         "throughput", "124m", ("gpuopt-bf16-compile", "gpuopt-bf16-compile-autotune"), micro_batch_size=64,
         repeats=3),
    Part("float8", "float8 per shape (124m, 774m, llama-1b, 1.5b; tensorwise, rowwise; the loss's head), "
         "float8-by-measurement against "
         "bf16 (3 repeats, alternating), the 124m float8 step profiled at micro-batch 8 and 64", "float8"),
    Part("generation", "124m (random weights), mixed-length prompts whose answers end early: one at a time, continuous "
         "batching, and transformers' batched generate (left-padded) on the same weights written by save_hf",
         "generation", "124m"),
)

# The gpu-marked test files, correctness first: float8 and bf16 numerics, the attention kernel and
# fused AdamW, the CUDA settings, MFU and memory, AutoBatchSize, exact resume; last the two that
# repeat the doctor and throughput parts as tests. tests/benchmarks/test_headline.py checks that the
# list names every file with a gpu-marked test.
GPU_TEST_FILES: tuple[str, ...] = (
    "tests/precision/test_gpu.py",
    "tests/model/test_gpt.py",
    "tests/model/test_llama.py",
    "tests/callbacks/test_cuda_settings.py",
    "tests/callbacks/test_mfu_monitor.py",
    "tests/callbacks/auto_batch/test_gpu.py",
    "tests/callbacks/test_exact_resume.py",
    "tests/cli/test_doctor.py",
    "tests/benchmarks/test_throughput.py",
)

# Seconds, per device family. Keys: "start-up" (Python, the imports and reading the device), "finish"
# (the last results and the chart), the parts "device" and "doctor", "process" (a throughput child:
# imports, CUDA, tokenising, cached after the first, and the timed matmul ceiling), "<preset>/<config>"
# (one run of one throughput configuration: building, warm-up with compilation, measured steps; "/rowwise"
# for float8 rowwise, "/mb<N>" at a part's own micro-batch), "loss" (the loss microbenchmark: its compilations
# and 3 x 5 timed steps of each: a guess, it never ran on a GPU), "generation" (its process, the export to
# transformers, a warm-up and a timed run of each of its three configurations: a guess, it never ran on a GPU),
# "curve" (benchmarks.residual_curve: its process, then two 124m runs of 300 steps at ~0.15 s, from the measured
# tokens/s at micro-batch 64, each with its per-block compile: an estimate, it never ran on a GPU),
# "pytest" (its start and collection) and one per gpu test file.
# H100: measured on an H100 80GB HBM3 (SXM), 16 host cores, on 2026-11-27 (benchmarks/results/h100/2026-11-27:
# every part's "seconds" in headline.json, every run's start-up, warm-up and steps in the throughput JSON, the
# pytest durations); the keys in _H100_RUN are those measurements, rounded up. The throughput configurations
# then ran 20 + 5 optimizer steps of 8 sequences without accumulation; they now run 10 + 3 steps of 64
# sequences (accumulation to the global batch), so their times are estimated from the measured tokens/s
# (1 + 64 x 1024 x 13 / tokens per s) plus the measured start-up and warm-up (compilation); configurations
# that never ran on it (the whole-model compile, the bf16 residual, the new torch-loop) are guesses. The H200
# has the H100's compute, and the compile time, which dominates, is the host's: the same row. The "tiny" row
# (--tiny, any device) is from runs on a 2-core CPU (one thread per process), with room for other work on it.
_H100: dict[str, float] = {
    "start-up": 27, "finish": 3, "device": 1, "doctor": 45, "process": 25,
    "124m/baseline": 18, "124m/lightning-bf16": 5, "124m/gpuopt-bf16-compile": 12, "124m/gpuopt-fp8-compile": 10,
    "124m/gpuopt-fp8-compile/rowwise": 8, "124m/gpuopt-bf16-compile-auto": 30, "124m/torch-loop": 45,
    "774m/gpuopt-bf16-compile": 24, "774m/gpuopt-fp8-compile": 24,
    "124m/gpuopt-bf16-compile/mb64": 12, "124m/gpuopt-bf16-compile-bf16res/mb64": 12,
    "124m/gpuopt-bf16-compile-model/mb64": 25, "124m/gpuopt-bf16-compile-model-bf16res/mb64": 25,
    "774m/gpuopt-bf16-compile/mb16": 26, "774m/gpuopt-fp8-compile/mb16": 26,
    "124m/gpuopt-bf16-compile/mb8": 12, "124m/gpuopt-bf16-compile-cudagraphs/mb8": 20,
    "124m/gpuopt-bf16-compile-autotune/mb64": 80,
    "loss": 100,  # a guess (above): 90 before the float8 head's row added a compile and its steps
    "generation": 75,
    "curve": 160,  # 25 process + 2 x (300 x 0.15 s + 20 s compile) + tokenising WikiText-2: an estimate
    # float8: shapes, then 124m compared, the profiles, the other presets: the part uses its whole limit, its own
    # budget skipping what does not fit; 380 s lets `--parts float8` run alone within 420 s (an estimate)
    "float8": 380,
    "pytest": 17,
    "tests/precision/test_gpu.py": 16, "tests/model/test_gpt.py": 2, "tests/model/test_llama.py": 2,
    "tests/callbacks/test_cuda_settings.py": 14,
    "tests/callbacks/test_mfu_monitor.py": 2, "tests/callbacks/auto_batch/test_gpu.py": 14,
    "tests/callbacks/test_exact_resume.py": 36, "tests/cli/test_doctor.py": 22,
    "tests/benchmarks/test_throughput.py": 2,
}
_H100_RUN = frozenset({"start-up", "finish", "device", "doctor", "process", "pytest", *GPU_TEST_FILES})
ESTIMATES: dict[str, dict[str, float]] = {
    "H100": _H100,
    "H200": dict(_H100),
    "tiny": {
        "start-up": 8, "finish": 2, "device": 1, "doctor": 10, "process": 7, "loss": 12,
        "tiny/baseline": 1, "tiny/lightning-bf16": 1, "tiny/gpuopt-bf16-compile": 1, "tiny/gpuopt-fp8-compile": 2,
        "tiny/gpuopt-fp8-compile/rowwise": 2, "tiny/gpuopt-bf16-compile-auto": 3, "tiny/torch-loop": 1,
        "tiny/gpuopt-bf16-compile-model": 1, "tiny/gpuopt-bf16-compile-bf16res": 1,
        "tiny/gpuopt-bf16-compile-model-bf16res": 1, "tiny/gpuopt-bf16-compile-cudagraphs": 1,
        "tiny/gpuopt-bf16-compile-autotune": 1, "generation": 14, "float8": 45, "curve": 20,
        "pytest": 7, **{f: 0.2 for f in GPU_TEST_FILES},
    },
}
# The keys of each family's row that come from runs on it; the others are estimates.
MEASURED: dict[str, frozenset[str]] = {"H100": _H100_RUN, "H200": frozenset(), "tiny": frozenset(ESTIMATES["tiny"])}


def estimate_family(facts: DeviceFacts, tiny: bool) -> tuple[str, Optional[str]]:
    """The ``ESTIMATES`` row for a device, and a note when it is another device's.

    Example::

        estimate_family(REFERENCE_DEVICES["H200"], tiny=False)  # ("H200", None)
    """
    if tiny:
        return "tiny", None
    peaks = facts.peaks
    family = peaks.name.split()[0] if peaks is not None else None
    if family in ESTIMATES:
        return family, None
    return "H100", f"no time estimates for {facts.name}: the H100's are used"


def _key(part: Part, config: str, tiny: bool) -> str:
    preset = "tiny" if tiny else part.preset
    rowwise = "/rowwise" if part.fp8_recipe == "rowwise" and "fp8" in config else ""
    own_batch = f"/mb{part.micro_batch_size}" if part.micro_batch_size is not None and not tiny else ""
    return f"{preset}/{config}{rowwise}{own_batch}"


def part_micro_batch(part: Part, tiny: bool, default: int) -> int:
    """The fixed micro-batch a throughput part runs with: its own, or ``default`` (the command's; ``--tiny``'s)."""
    return default if tiny or part.micro_batch_size is None else part.micro_batch_size


def part_repeats(part: Part, tiny: bool) -> int:
    """How often a throughput part runs its configurations (once under ``--tiny``: a smoke run compares nothing)."""
    return 1 if tiny else part.repeats


def part_keys(part: Part, tiny: bool) -> list[str]:
    """The ``ESTIMATES`` keys that ``part`` reads."""
    if part.kind in ("device", "doctor", "loss", "generation", "float8", "curve"):
        return [part.kind]
    if part.kind == "tests":
        return ["pytest", *GPU_TEST_FILES]
    return ["process", *(_key(part, c, tiny) for c in part.configs)]


def measured_part(part: Part, family: str, tiny: bool) -> bool:
    """Whether every estimate of ``part`` in ``family``'s row comes from runs on that device."""
    return set(part_keys(part, tiny)) <= MEASURED[family]


def part_estimate(part: Part, estimates: dict[str, float], tiny: bool) -> float:
    """Seconds ``part`` is expected to take (everything it runs)."""
    if part.kind in ("device", "doctor", "loss", "generation", "float8", "curve"):
        return estimates[part.kind]
    if part.kind == "tests":
        return estimates["pytest"] + sum(estimates[f] for f in GPU_TEST_FILES)
    return estimates["process"] + part_repeats(part, tiny) * sum(config_estimates(part, estimates, tiny))


def config_estimates(part: Part, estimates: dict[str, float], tiny: bool) -> list[float]:
    """Seconds of one run of each configuration of a throughput part."""
    return [estimates[_key(part, c, tiny)] for c in part.configs]


def _minimum(part: Part, estimates: dict[str, float], tiny: bool) -> float:
    """The least time worth starting ``part`` with: the gpu tests' start and first file; the whole part otherwise."""
    if part.kind == "tests":
        return estimates["pytest"] + estimates[GPU_TEST_FILES[0]]
    return part_estimate(part, estimates, tiny)


def _expected(parts: list[Part], estimates: dict[str, float], tiny: bool, left_s: float) -> float:
    """Seconds ``parts`` are expected to take in ``left_s``: each that fits at its estimate (tests: what is left)."""
    spent = 0.0
    for part in parts:
        usable = left_s - spent - GRACE_S - estimates["finish"]
        if _minimum(part, estimates, tiny) <= usable:
            spent += min(part_estimate(part, estimates, tiny), usable)
    return spent


def decide(part: Part, estimates: dict[str, float], tiny: bool, left_s: float, later: list[Part] = ()
           ) -> tuple[Optional[float], str]:
    """``(limit, "")`` for a part that fits in ``left_s`` seconds of the budget, else ``(None, why not)``.

    A part starts if its estimate fits in what is left after the stop grace and the finish (the gpu
    tests: their start and first file). Its limit is what the ``later`` parts leave it when each takes
    its estimate, but at least its estimate times ``MARGIN`` (the gpu tests: their estimate) and at most
    what is left: with a budget to spare every part may take longer; without, the earlier part, the
    more valuable, keeps its margin.
    """
    usable = left_s - GRACE_S - estimates["finish"]
    need = _minimum(part, estimates, tiny)
    if need > usable:
        return None, f"needs ~{need:.0f} s (estimate), {max(left_s, 0):.0f} s of the budget left"
    full = part_estimate(part, estimates, tiny)
    spare = usable - _expected(list(later), estimates, tiny, left_s - full)
    return min(max(full if part.kind == "tests" else MARGIN * full, spare), usable), ""


@dataclass(frozen=True)
class PlanRow:
    """One line of the plan: a part, its estimate, and its limit and expected start, or why it is skipped."""

    part: str
    what: str
    estimate_s: float
    limit_s: Optional[float]
    start_s: Optional[float]
    reason: str = ""


def plan(parts: list[Part], estimates: dict[str, float], tiny: bool, budget_s: float,
         wanted: Optional[set[str]] = None) -> tuple[list[PlanRow], float]:
    """The plan: every part with its estimate, and its limit and expected start or the reason it is skipped;
    and the expected end (seconds from the start). Parts not in ``wanted`` are skipped as not asked for.

    Example::

        rows, end = plan(list(PARTS), ESTIMATES["H100"], tiny=False, budget_s=420)
    """
    rows, t = [], estimates["start-up"]
    asked = [p for p in parts if p.kind == "device" or wanted is None or p.name in wanted]
    for part in parts:
        estimate = part_estimate(part, estimates, tiny)
        if part not in asked:
            rows.append(PlanRow(part.name, part.what, estimate, None, None, "not asked for (--parts)"))
            continue
        later = asked[asked.index(part) + 1:]
        limit, reason = (estimate, "") if part.kind == "device" else decide(part, estimates, tiny, budget_s - t, later)
        if limit is None:
            rows.append(PlanRow(part.name, part.what, estimate, None, None, reason))
            continue
        rows.append(PlanRow(part.name, part.what, estimate, limit, t))
        t += min(estimate, limit)
    return rows, t + estimates["finish"]


def format_plan(rows: list[PlanRow], end_s: float, budget_s: float, header: str, estimates: dict[str, float],
                measured: Optional[set[str]] = None) -> str:
    """The plan as a text table, the start-up and finish included, with its expected end against the budget.
    ``measured``: the parts whose estimates all come from runs on the device (marked ``run``; the others ``est``)."""
    def basis(part: str) -> str:
        return "" if measured is None else (" run" if part in measured else " est")

    lines = [header, f"{'part':<22} {'estimate':>12} {'limit':>7} {'starts':>7}  what",
             f"{'start-up':<22} {estimates['start-up']:>7.0f} s{basis('start-up'):4} {'':>7} {0:>5.0f} s  "
             "Python, imports, reading the device"]
    for r in rows:
        if r.limit_s is None:
            lines.append(f"{r.part:<22} {r.estimate_s:>7.0f} s{basis(r.part):4} {'-':>7} {'-':>7}  skipped: {r.reason}")
            continue
        short = r.part == "gpu-tests" and r.limit_s < r.estimate_s
        stops = ", stops at its limit with the tests that finished" if short else ""
        lines.append(f"{r.part:<22} {r.estimate_s:>7.0f} s{basis(r.part):4} {r.limit_s:>5.0f} s {r.start_s:>5.0f} s  "
                     f"{r.what}{stops}")
    lines.append(f"{'finish':<22} {estimates['finish']:>7.0f} s{basis('finish'):4} {'':>7} "
                 f"{end_s - estimates['finish']:>5.0f} s  results and chart")
    lines.append(f"expected end: {end_s:.0f} s of the {budget_s:.0f} s budget; a part that reaches its limit is "
                 f"stopped (within {GRACE_S:.0f} s) and the next one still runs")
    return "\n".join(lines)
