"""``gpuopt doctor``: what this package will do on this machine, checked in about a minute (``docs/doctor.md``).

Each group of checks is a plain function of the device's :class:`~lightning_gpuopt.perf.device.DeviceFacts`, so a
test gives it another device's facts; every check is a :class:`Check` that passes, fails (with its fix) or informs."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Literal, NamedTuple, Optional, Sequence

import torch

from lightning_gpuopt.cli.config_checks import check_writable
from lightning_gpuopt.callbacks.cuda_settings import CUDASettings, plan_settings
from lightning_gpuopt.cli.errors import TRACEBACK_ENV
from lightning_gpuopt.model.config import PRESETS, GPTConfig
from lightning_gpuopt.option_checks import check_choice, option
from lightning_gpuopt.model.gpt import GPT
from lightning_gpuopt.model.loss import run_chunk_tokens
from lightning_gpuopt.model.optim import build_adamw
from lightning_gpuopt.perf.device import REFERENCE_DEVICES, DeviceFacts, read_device
from lightning_gpuopt.perf.flops import model_flops_per_token
from lightning_gpuopt.perf.oom import free_memory, is_oom_error
from lightning_gpuopt.perf.sdpa import attention_kernel, auto_sdpa_order, set_sdpa_priority
from lightning_gpuopt.perf.units import GiB
from lightning_gpuopt.precision.bf16 import autocast_precision
from lightning_gpuopt.run.lock import PathInUse, hold_output
from lightning_gpuopt.precision.float8_layers import (
    FP8_INSTALL_HINT,
    candidate_shapes,
    convert_linears_to_float8,
    float8_config,
    nothing_converted_message,
    require_torchao,
)
from lightning_gpuopt.precision.float8_decision import loss_head_shape
from lightning_gpuopt.precision.float8_measure import ShapeTimer, measure_on_device

__all__ = [
    "COMPILE_TIMEOUT_S",
    "Check",
    "CompileProbe",
    "apply_cuda_settings",
    "attention_check",
    "compile_check",
    "compile_disabled",
    "device_checks",
    "exit_code",
    "float8_checks",
    "format_table",
    "gpu_differences",
    "main",
    "run_checks",
    "settings_checks",
    "start_compile_probe",
    "train_step_checks",
]

Status = Literal["pass", "fail", "info"]
COMPILE_TIMEOUT_S = 90.0
_COMPILE_NAME = "torch_compile"
# (pip extra, module) of the optional pieces the package uses when they are installed.
_EXTRAS = (("flash", "flash_attn"), ("liger", "liger_kernel"), (None, "triton"))
# A GPT-2-shaped model small enough for a CPU: 2 layers x 64 wide, dims multiples of 16.
_CPU_CONFIG = dict(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=512)


@dataclasses.dataclass(frozen=True)
class Check:
    """One line of the report; ``fix`` is ``""`` when there is nothing to do."""

    name: str
    status: Status
    detail: str
    fix: str = ""

    def __post_init__(self) -> None:
        check_choice("Check", "status", self.status, ("pass", "fail", "info"))


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _compute_dtype(facts: DeviceFacts) -> torch.dtype:
    """What the ``gpuopt`` stack computes in on this device: on a GPU ``BF16Precision``'s autocast dtype
    (bf16, float16 where bf16 is missing: T4, V100), on a CPU float32 (``cli.defaults.stack_precision_plugins``)."""
    if not facts.is_cuda:
        return torch.float32
    return torch.bfloat16 if autocast_precision(facts) == "bf16-mixed" else torch.float16


def _precision_words(dtype: torch.dtype) -> str:
    return "float32" if dtype == torch.float32 else f"{str(dtype).removeprefix('torch.')} autocast"


def _torch_device(facts: DeviceFacts) -> torch.device:
    return torch.device(facts.type, facts.index)


def device_checks(facts: DeviceFacts) -> list[Check]:
    """The device, what it can run, its datasheet peaks, and the versions of torch, Lightning, torchao and the
    extras."""
    can = (f"bf16 {_yes(facts.bf16)}, float8 {_yes(facts.fp8)}, flash attention {_yes(facts.flash_attention)}, "
           f"fused AdamW {_yes(facts.fused_adamw)}")
    checks = [Check("device", "info", f"{facts.describe()}: {can}")]
    if facts.peaks is not None:
        peaks = ", ".join(f"{d} {facts.peak_tflops(d)}" for d in ("bf16", "fp16", "fp8") if facts.peak_tflops(d))
        checks.append(Check("peak_flops", "pass", f"{facts.peaks.name}: dense TFLOP/s {peaks} ({facts.peaks.source})"))
    elif facts.is_cuda:
        checks.append(Check("peak_flops", "info", f"no datasheet peak for {facts.name}, so MFU is not reported",
                            f"set {option('MFUMonitor', 'peak_flops')} to its dense bf16 FLOP/s"))
    else:
        checks.append(Check("peak_flops", "info",
                            f"no datasheet peak for a {facts.type} device: MFU is not reported here"))
    versions = {name: _version(name) for name in ("torch", "lightning", "torchao")}
    checks.append(Check("versions", "info", ", ".join(f"{k} {v}" for k, v in versions.items())))
    return checks + [_extra_check(extra, module, facts) for extra, module in _EXTRAS]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _extra_check(extra: Optional[str], module: str, facts: DeviceFacts) -> Check:
    name = f"extra.{module}"
    install = f'pip install "lightning-gpuopt[{extra}]"' if extra else f"pip install {module}"
    if importlib.util.find_spec(module) is None:
        if module == "triton" and facts.is_cuda:
            return Check(name, "fail", "triton is not installed: torch.compile cannot generate GPU kernels",
                         f"{install} (the version torch {torch.__version__} was built with)")
        return Check(name, "info", "not installed (optional, CUDA only)", install)
    try:
        importlib.import_module(module)
    except Exception as err:  # an installed extension built for another torch fails in many ways
        return Check(name, "fail", f"installed but does not import: {type(err).__name__}: {err}",
                     f"reinstall it for torch {torch.__version__}: pip install --force-reinstall {module}")
    return Check(name, "pass", f"imports ({module} {_version(module.replace('_', '-'))})")


def apply_cuda_settings() -> tuple[CUDASettings, Callable[[], None]]:
    """Apply the default stack's ``CUDASettings`` as a fit does; return them and what undoes them.

    Call it before anything starts CUDA, as a fit constructs it: the allocator option must come first.
    ``sdpa_backends="auto"`` is applied for a device later (``auto_sdpa_order``), as at ``setup``; the table
    rows come from the device's facts (``CUDASettings.rows_for``), since the callback fills its own report
    only at a fit's ``setup``."""
    settings = CUDASettings()
    return settings, lambda: settings.teardown(None, None, "fit")  # type: ignore[arg-type]  # reads neither


def settings_checks(facts: DeviceFacts, rows: list[tuple[str, str, str]]) -> list[Check]:
    """One check per ``CUDASettings`` row on a GPU; on another device one line saying nothing takes effect."""
    if not facts.is_cuda:
        return [Check("cuda_settings", "info",
                      "no CUDA device: CUDASettings sets its flags but none takes effect here")]
    return [
        Check(f"cuda_settings.{name}", "fail" if status.startswith("not applied") else "pass", f"{value}: {status}",
              "construct CUDASettings before anything allocates CUDA memory"
              if status.startswith("not applied") else "")
        for name, value, status in rows
    ]


def attention_check(facts: DeviceFacts, config: GPTConfig) -> Check:
    """The SDPA kernel that runs the model's attention under the current backend settings."""
    dtype = _compute_dtype(facts)
    kernel = attention_kernel(_torch_device(facts), config.head_size, config.block_size, dtype, config.n_head,
                              config.dropout)
    detail = (f"SDPA runs {kernel} for head dim {config.head_size}, T {config.block_size}, {config.n_head} heads, "
              f"{str(dtype).removeprefix('torch.')}, causal")
    if not facts.is_cuda:
        return Check("attention_kernel", "info", detail)
    if kernel == "math":
        return Check("attention_kernel", "fail", detail + ": the math kernel materialises the T x T scores",
                     "use a head dim that is a multiple of 8 and at most 256, and BF16Precision (bf16/fp16 attention)")
    return Check("attention_kernel", "pass", detail)


def float8_checks(
    facts: DeviceFacts,
    config: GPTConfig,
    recipe: str = "tensorwise",
    timer: Optional[ShapeTimer] = None,
    micro_batch: int = 8,
    cache_root: Optional[Path] = None,
) -> list[Check]:
    """Which layers ``Float8Precision(recipe)`` converts in the model (found on meta tensors), and whether this device
    runs float8. On a float8 GPU (or with ``timer``) its shapes are timed at ``micro_batch`` as the plugin's
    ``"auto"`` filter times them (cached), and the per-shape table is one more check, ``float8_timing``."""
    if facts.fp8:
        device = Check("float8_device", "pass", f"float8 tensor cores (compute capability {facts.capability[0]}."
                       f"{facts.capability[1]}): Float8Precision runs float8 matmuls")
    else:
        device = Check("float8_device", "info", "no float8 tensor cores (compute capability >= 8.9 needed): "
                       f"{option('Float8Precision', 'emulate', True)} runs here in high precision, for testing, "
                       "without a speed-up")
    try:
        require_torchao()
    except ImportError as err:
        return [Check("float8_layers", "info", str(err), FP8_INSTALL_HINT), device]
    with torch.device("meta"):  # no memory, no time: only the layer shapes matter
        model = GPT(config)
    decision, timing = None, []
    if timer is not None or (facts.is_cuda and facts.fp8 and torch.cuda.is_available()):
        tokens = micro_batch * config.block_size
        flops, counts, head = model.flops_per_token(config.block_size) * tokens, candidate_shapes(model, tokens), None
        if recipe == "tensorwise":  # GPTModule's chunked loss, at the chunk a run takes here, runs its head in float8
            chunk = run_chunk_tokens(config.padded_vocab_size, torch.bfloat16, facts.total_memory)
            head, counts[head] = loss_head_shape(chunk, config.n_embd, config.padded_vocab_size, tokens)
        decision = measure_on_device(counts, recipe, "gemm", float8_config(recipe), flops, _torch_device(facts), facts,
                                     timer, cache_root, head)
        rows = "; ".join(f"{r.in_features}x{r.out_features}{' (loss head)' if r.loss_head else ''}: "
                         f"bf16 {r.bf16_ms:.3f} ms, float8 {r.float8_ms:.3f} ms, "
                         f"{'converted' if r.convert else 'not converted'}" for r in decision.shapes)
        declined = f" (whole model declined: {decision.declined})" if decision.declined else ""
        timing = [Check("float8_timing", "info", f"{tokens} tokens per micro-batch of {micro_batch}{declined}: {rows}")]
    config8 = float8_config(recipe, emulate=not facts.fp8)
    report = convert_linears_to_float8(model, config8, "auto", recipe, decision=decision)
    if decision is not None and decision.converts_loss_head():  # GPTModule's loss runs it in float8: the plugin's row
        report = [(name, shape, None if name == "lm_head" else why) for name, shape, why in report]
    converted = sorted({(re.sub(r"\.\d+\.", ".*.", name), shape) for name, shape, why in report if why is None})
    detail = (f"Float8Precision ({recipe}) converts {sum(why is None for *_, why in report)} of {len(report)} "
              "projection layers")
    if not converted:
        fix = nothing_converted_message(report, recipe, "GPT") or ""
        return [Check("float8_layers", "info", detail, fix), device, *timing]
    layers = ", ".join(f"{n} ({s})" for n, s in converted)
    return [Check("float8_layers", "info", detail + ": " + layers), device, *timing]


_COMPILE_PROBE = """
import sys, torch
x = torch.linspace(-2, 2, 64, device=sys.argv[1])
got = torch.compile(lambda t: torch.nn.functional.gelu(t * 3).sum())(x).item()
want = torch.nn.functional.gelu(x * 3).sum().item()
if abs(got - want) > 1e-4 * max(1.0, abs(want)):
    sys.exit(f"torch.compile computed {got}, eager {want}")
"""


def compile_disabled() -> bool:
    """Whether torch's own switch ``TORCH_COMPILE_DISABLE=1`` is set: ``torch.compile`` then runs everything eagerly."""
    return os.environ.get("TORCH_COMPILE_DISABLE", "0") == "1"


def _disabled_compile_check() -> Check:
    return Check(_COMPILE_NAME, "info", "torch.compile is switched off here (TORCH_COMPILE_DISABLE=1): not probed; "
                 "GPTModule(compile=True) trains eagerly", "unset TORCH_COMPILE_DISABLE to compile")


class CompileProbe(NamedTuple):
    process: subprocess.Popen
    started: float
    """``time.perf_counter()`` when it started."""


def start_compile_probe(facts: DeviceFacts) -> CompileProbe:
    """Compile and run a tiny function on the device in a child process (a hung compiler can be stopped there)."""
    process = subprocess.Popen([sys.executable, "-c", _COMPILE_PROBE, str(_torch_device(facts))],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return CompileProbe(process, time.perf_counter())


def compile_check(probe: CompileProbe, facts: DeviceFacts, timeout_s: float = COMPILE_TIMEOUT_S) -> Check:
    """Whether :func:`start_compile_probe`'s compile worked within ``timeout_s`` of its start, and the fix if not."""
    no_compile = "until then train without it (--model.compile false)"
    try:
        _, stderr = probe.process.communicate(timeout=max(0.0, timeout_s - (time.perf_counter() - probe.started)))
    except subprocess.TimeoutExpired:
        probe.process.kill()
        probe.process.communicate()
        return Check(_COMPILE_NAME, "fail", f"compiling a one-line function did not finish in {timeout_s:.0f} s",
                     f"run `gpuopt doctor` again (the compile cache makes the second faster); {no_compile}")
    if probe.process.returncode == 0:
        return Check(_COMPILE_NAME, "pass", f"compiled (inductor) and ran a function on {_torch_device(facts)}, "
                     f"done within {time.perf_counter() - probe.started:.1f} s")
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b.*:", line)]
    reason = (errors or lines or [f"exit status {probe.process.returncode}"])[-1]
    if "C++ compiler" in reason or "Cxx" in reason:
        fix = f"install a C++ compiler (apt install g++), or set CXX to one; {no_compile}"
    elif facts.is_cuda:
        fix = f"install the triton that torch {torch.__version__} was built with (pip install triton); {no_compile}"
    else:
        fix = f"rerun with TORCHDYNAMO_VERBOSE=1 for the full error; {no_compile}"
    return Check(_COMPILE_NAME, "fail", f"torch.compile failed on {_torch_device(facts)}: {reason}", fix)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_step(model: GPT, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, batch: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    with torch.autocast(batch.device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = model(batch[:, :-1], targets=batch[:, 1:])
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def train_step_checks(facts: DeviceFacts, config: GPTConfig, micro_batches: Sequence[int], steps: int) -> list[Check]:
    """Tokens/s, MFU and peak memory of ``steps`` timed training steps (after one untimed) per micro-batch size.

    A plain loop doing what the default stack does: on a GPU ``BF16Precision``'s autocast (float16 with a
    ``GradScaler`` without bf16), on a CPU float32; AdamW (fused where ``facts.fused_adamw``), the model's chunked loss.
    FLOPs per token are the model's own count (:func:`~lightning_gpuopt.perf.flops.model_flops_per_token`)."""
    device, dtype = _torch_device(facts), _compute_dtype(facts)
    with torch.random.fork_rng(devices=[device] if facts.is_cuda else [], device_type=facts.type):
        torch.manual_seed(0)
        model = GPT(config).to(device)
        optimizer = build_adamw(model, lr=1e-4, fused=facts.fused_adamw)
        scaler = torch.amp.GradScaler(facts.type, enabled=dtype == torch.float16)
        per_token = model_flops_per_token(model, config.block_size)
        return [_measure(model, optimizer, scaler, dtype, facts, b, steps, per_token) for b in micro_batches]


def _measure(model: GPT, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, dtype: torch.dtype,
             facts: DeviceFacts, micro_batch: int, steps: int, per_token: Optional[float]) -> Check:
    name, device, T = f"train_steps.micro_batch_{micro_batch}", _torch_device(facts), model.config.block_size
    oom = False
    try:
        if facts.is_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        batch = torch.randint(0, model.config.vocab_size, (micro_batch, T + 1), device=device)
        _train_step(model, optimizer, scaler, batch, dtype)  # untimed: first-call allocations and kernel choice
        _sync(device)
        start = time.perf_counter()
        losses = [_train_step(model, optimizer, scaler, batch, dtype) for _ in range(steps)]
        _sync(device)
        seconds = time.perf_counter() - start
    except Exception as err:
        if not is_oom_error(err):
            if os.environ.get(TRACEBACK_ENV) == "1":
                raise
            return Check(name, "fail", f"a training step raised {type(err).__name__}: {err}",
                         f"rerun with {TRACEBACK_ENV}=1 for the traceback; `gpuopt fit` would stop the same way")
        oom = True
    if oom:  # outside the except: its traceback held the step's activations
        free_memory(device)
        return Check(name, "info", f"micro-batch {micro_batch} x T {T} does not fit in memory on {facts.describe()}",
                     "AutoBatchSize finds the largest micro-batch that fits and keeps the global batch")
    loss = float(torch.stack(losses).float().mean())
    if loss != loss or abs(loss) == float("inf"):
        return Check(name, "fail", f"loss {loss} after {steps} steps at micro-batch {micro_batch}",
                     "report this with the output of `gpuopt doctor --json doctor.json`")
    tokens_s = steps * micro_batch * T / seconds
    peak = facts.peak_tflops("bf16" if dtype == torch.bfloat16 else "fp16")
    if per_token is None or peak is None:
        mfu = "MFU not reported (no datasheet peak)"
    else:
        mfu = f"{per_token * tokens_s / 1e12:.1f} TFLOP/s, MFU {per_token * tokens_s / (peak * 1e12):.1%}"
    memory = (f"peak memory {torch.cuda.max_memory_allocated(device) / GiB:.2f} GiB" if facts.is_cuda
              else "memory not measured off CUDA")
    return Check(name, "pass", f"{tokens_s:,.0f} tokens/s, {mfu}, {memory} ({steps} steps of {micro_batch} x {T} "
                 f"tokens, {_precision_words(dtype)}, loss {loss:.3f})")


def gpu_differences(here: DeviceFacts, gpu: DeviceFacts) -> list[Check]:
    """What training on ``gpu`` (e.g. ``REFERENCE_DEVICES["H100 SXM"]``) would change against ``here``.

    Args:
        here: This machine's device.
        gpu: The GPU to compare with.
    """
    if not gpu.is_cuda or gpu.capability is None:
        raise ValueError(f"gpu_differences compares with a CUDA GPU, got {gpu.describe()}: pass e.g. "
                         "REFERENCE_DEVICES['H100 SXM'].")
    dtype = "bf16" if gpu.bf16 else "fp16"
    changes = {
        "precision": f"{dtype} autocast on tensor cores ({gpu.peak_tflops(dtype)} dense TFLOP/s)"
                     + ("" if gpu.bf16 else " with a GradScaler: no bf16 before compute capability 8.0"),
        "optimizer": "fused AdamW (one kernel for all parameters)" if gpu.fused_adamw else "AdamW (foreach)",
        "attention": "Flash attention (SDPA)" if gpu.flash_attention
                     else "memory-efficient attention (no Flash before 8.0)",
        "float8": f"Float8Precision runs float8 matmuls ({gpu.peak_tflops('fp8')} dense TFLOP/s)" if gpu.fp8
                  else "no float8 tensor cores (compute capability 8.9 needed): Float8Precision only emulates",
        "cuda_settings": "CUDASettings sets " + ", ".join(f"{name}={value}" for name, value, _ in plan_settings(gpu)),
        "mfu": f"MFU against the datasheet peak of {gpu.peaks.name}" if gpu.peaks
               else "no datasheet peak: MFU not reported",
    }
    order, why = auto_sdpa_order(gpu)
    if order is not None:
        changes["attention"] += f"; CUDASettings sets SDPA's {why}"
    if here.bf16 and not gpu.bf16:
        changes["precision"] = changes["precision"].replace("autocast", "autocast instead of bf16")
    header = Check("on_gpu", "info", f"what training on a GPU would change: {gpu.describe()}")
    return [header] + [Check(f"on_gpu.{name}", "info", text) for name, text in changes.items()]


def run_checks(steps: Optional[int] = None, preset: Optional[str] = None,
               compile_timeout_s: float = COMPILE_TIMEOUT_S) -> list[Check]:
    """Every check on this machine's training device (the one ``accelerator="auto"`` picks).

    Args:
        steps: Timed training steps per micro-batch size; default 10 on a GPU, 3 elsewhere.
        preset: The ``GPTConfig`` preset to check; default ``124m`` on a GPU, a 2-layer, 64-wide model elsewhere.
        compile_timeout_s: How long the ``torch.compile`` check may take.
    """
    settings, restore = apply_cuda_settings()
    probe = None
    try:
        facts = read_device()
        order, _ = auto_sdpa_order(facts)
        if order is not None:
            set_sdpa_priority(order)
        rows = settings.rows_for(facts)  # tf32, matmul precision, cuDNN autotuning, the allocator, sdpa_backends
        # Compiles while the checks below run; the timed steps wait for it. Under TORCH_COMPILE_DISABLE=1 a probe
        # would run eagerly and pass without compiling anything: it is said instead.
        probe = None if compile_disabled() else start_compile_probe(facts)
        if preset is not None:
            config = GPTConfig.from_name(preset)
        else:
            config = GPTConfig.from_name("124m") if facts.is_cuda else GPTConfig(**_CPU_CONFIG)
        checks = device_checks(facts) + settings_checks(facts, rows) + [attention_check(facts, config)]
        checks += float8_checks(facts, config)
        checks.append(_disabled_compile_check() if probe is None else compile_check(probe, facts, compile_timeout_s))
        micro_batches = (8, 16) if facts.is_cuda else (2, 8)
        checks += train_step_checks(facts, config, micro_batches, steps or (10 if facts.is_cuda else 3))
        if not facts.is_cuda:
            checks += gpu_differences(facts, REFERENCE_DEVICES["H100 SXM"])
        return checks
    finally:
        if probe is not None and probe.process.poll() is None:  # an error above: stop the compile too
            probe.process.kill()
            probe.process.communicate()
        restore()


def exit_code(checks: Sequence[Check]) -> int:
    """``1`` when a check failed, else ``0``."""
    return int(any(c.status == "fail" for c in checks))


def format_table(checks: Sequence[Check]) -> str:
    """The checks as a text table, each fix on its own line under its check, and a count at the end."""
    width = max((len(c.name) for c in checks), default=5)
    lines = [f"{'check':<{width}}  status  detail"]
    for c in checks:
        lines.append(f"{c.name:<{width}}  {c.status:<6}  {c.detail}")
        if c.fix:
            lines.append(f"{'':<{width}}  {'':<6}  fix: {c.fix}")
    counts = {s: sum(c.status == s for c in checks) for s in ("pass", "fail", "info")}
    lines.append(f"{counts['pass']} passed, {counts['fail']} failed, {counts['info']} for information")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``gpuopt doctor [--json PATH] [--steps N] [--preset NAME]``: print the checks; return the exit status."""
    parser = argparse.ArgumentParser(prog="gpuopt doctor", description=(
        "What lightning_gpuopt will do on this machine: device, settings, attention kernel, torch.compile, "
        "float8, and measured training steps. Exit status 1 when a check failed."))
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the checks to this JSON file")
    parser.add_argument("--steps", type=int, default=None, metavar="N",
                        help="timed steps per micro-batch size (default 10 on a GPU, 3 elsewhere)")
    parser.add_argument("--preset", choices=list(PRESETS), default=None,
                        help="GPTConfig preset to check (default 124m on a GPU, a 2-layer, 64-wide model elsewhere)")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}.")
    if args.json is not None and not args.json.parent.is_dir():  # before the work, not after it
        what = ("is a file, not a folder; pick another path" if args.json.parent.exists()
                else "does not exist; create it or pick another path")
        parser.error(f"--json {args.json}: the folder {args.json.parent} {what}.")
    if args.json is not None:  # a folder, a read-only one, or one of another user: also before the work
        try:
            check_writable("--json", args.json, is_file=True,
                           fix="the checks are written there at the end. Give a file in a folder you can write, "
                           "--json PATH")
        except ValueError as err:
            parser.error(str(err))
    try:  # one writer: a second doctor writing the same file is refused, naming its pid, before the work
        lock = hold_output(args.json, "gpuopt doctor", "--json") if args.json is not None else None
    except PathInUse as err:
        parser.error(str(err))
    with lock or nullcontext():
        checks = run_checks(steps=args.steps, preset=args.preset)
        print(format_table(checks))
        code = exit_code(checks)
        if args.json is not None:
            payload = {"exit_code": code, "checks": [dataclasses.asdict(c) for c in checks]}
            args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return code
