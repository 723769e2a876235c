"""The headline figures of the package on one GPU, in one command with a hard time budget.

Runs, in value order, each part with its own limit (``benchmarks/_headline_plan.py``): the device
facts and ``gpuopt doctor``; throughput at 124m, T 1024 (plain Lightning fp32, Lightning bf16-mixed,
the gpuopt stack in bf16 and in float8, compiled, at a fixed micro-batch); generation at 124m (one
prompt at a time, continuous batching, transformers' batched generate on the same weights); the
gpu-marked tests, correctness first; then what is left of the budget: 774m bf16 against float8, AutoBatchSize's search
and choice, float8 rowwise. It prints the plan first (``--plan`` prints only that), skips a part that
would not fit in what is left and says why, stops a part that reaches its limit and goes on with the
next, and rewrites its results after every part, so a stop from outside keeps what finished:
``headline.json``, ``headline.md``, ``headline.png``, ``gpu-tests.xml`` and ``headline.log`` in ``--out``.

    python -m benchmarks.headline --time-budget 420 --out results/
    python -m benchmarks.headline --plan --device h100      # the plan for an H100, on any machine
    python -m benchmarks.headline --tiny --time-budget 120  # every part at the tiny preset: a CPU smoke run

The exit status is 1 when a part failed (a child's error, a failed test or configuration), 0 otherwise.
"""

from __future__ import annotations

import time

_STARTED = time.monotonic()  # before the heavy imports: the budget counts the command's own start-up

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import difflib  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

from benchmarks._headline_plan import (  # noqa: E402
    ESTIMATES,
    GPU_TEST_FILES,
    GRACE_S,
    MEASURED,
    PARTS,
    Part,
    config_estimates,
    decide,
    estimate_family,
    format_plan,
    measured_part,
    part_estimate,
    part_micro_batch,
    part_repeats,
    plan,
)
from benchmarks._headline_report import headline_rows, junit_summary, markdown, plot  # noqa: E402
from benchmarks._report import check_out_folder, device_slug, write_json, write_text  # noqa: E402
from lightning_gpuopt.perf.device import REFERENCE_DEVICES, DeviceFacts, cuda_device_count, read_device  # noqa: E402

__all__ = ["OptionError", "later_commands", "main", "parse_args", "run_child"]

log = logging.getLogger("benchmarks.headline")
child_log = logging.getLogger("benchmarks.headline.children")  # the parts' output: to headline.log only
child_log.propagate = False

ROOT = Path(__file__).resolve().parents[1]
FILES = ("headline.json", "headline.md", "headline.png", "gpu-tests.xml", "headline.log")
_LOG_HEAD, _LOG_TAIL = 200_000, 800_000  # bytes of a part's output kept in the log: its start and its end
# --device for --plan: a few short names, and every REFERENCE_DEVICES key.
_DEVICE_NAMES = {"h100": "H100 SXM", "h200": "H200", "a100": "A100", "l4": "L4", "cpu": "cpu",
                 **{k.lower().replace(" ", "-"): k for k in REFERENCE_DEVICES}}
_VERSIONS = ("python", "torch", "lightning", "torchao", "triton", "torchmetrics", "tokenizers", "jsonargparse")
# The smoke run's scale: tiny model and data, 2 measured steps; the GPU scale is throughput's defaults.
_TINY = dict(block_size=32, micro_batch_size=8, global_batch_size=16, steps=2, warmup_steps=1,
             tokenizer_vocab_size=384, num_workers=0, max_micro_batch_size=8)
# Every configuration accumulates to the global batch of 64 sequences (65,536 tokens an optimizer step), so 10
# measured steps are 640 sequences, as many as 20 steps of micro-batch 32.
_GPU = dict(block_size=1024, global_batch_size=64, steps=10, warmup_steps=3, tokenizer_vocab_size=4096, num_workers=2)
# benchmarks.generation's options: the GPU's at 124m (GPT-2 shape; 96 rows of 16 to 256 prompt tokens, answers of
# about 24 tokens, batches of 32: rows end and are refilled), the smoke run's at a tiny width.
_GENERATION_GPU = ("--device", "cuda", "--dtype", "bf16", "--n-layer", "12", "--n-embd", "768", "--n-head", "12",
                   "--vocab-size", "50304", "--block-size", "1024", "--prompts", "24", "--samples", "4", "--min-len",
                   "16", "--max-len", "256", "--new-tokens", "96", "--answer-len", "24", "--batch-size", "32")
_GENERATION_TINY = ("--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--vocab-size", "384", "--block-size", "64",
                    "--prompts", "8", "--samples", "2", "--min-len", "2", "--max-len", "16", "--new-tokens", "16",
                    "--answer-len", "4", "--batch-size", "4", "--threads", "1")


# The JSON each child part writes into its folder, by the part's kind (a throughput part's is found by its name).
_RESULT_FILES = {"doctor": "doctor.json", "loss": "loss-bench.json", "generation": "generation.json",
                 "float8": "float8.json", "curve": "residual-curve.json"}


class OptionError(ValueError):
    """A bad option, found before any work: the command prints it in one line."""


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line (``--help`` lists every option)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.headline", description=__doc__.splitlines()[0])
    p.add_argument("--time-budget", type=float, default=420.0,
                   help="seconds for the whole command, its start-up included (default 420)")
    p.add_argument("--out", default=None,
                   help="output folder (default: benchmark-results/<device-slug> in the current folder)")
    p.add_argument("--plan", action="store_true", help="print the plan with its time estimates and exit")
    p.add_argument("--device", default=None, choices=sorted(_DEVICE_NAMES),
                   help="with --plan: plan for this device instead of the one here")
    p.add_argument("--parts", default=None,
                   help="comma-separated parts to run (the device facts always run): "
                   + ",".join(x.name for x in PARTS[1:]))
    p.add_argument("--tiny", action="store_true",
                   help="every part at the tiny preset with torch.compile disabled and float8 emulated: checks the "
                   "command end to end in about a minute on a CPU; measures nothing")
    p.add_argument("--micro-batch-size", type=int, default=8, help="the fixed micro-batch of the throughput parts")
    p.add_argument("--max-micro-batch-size", type=int, default=None,
                   help="largest micro-batch AutoBatchSize tries (default: none on a GPU, 8 with --tiny)")
    p.add_argument("--data", default="auto",
                   help="training text for the throughput parts (benchmarks.throughput --data)")
    p.add_argument("--cache-dir", default=None, help="token cache (benchmarks.throughput --cache-dir)")
    p.add_argument("--test-timeout", type=float, default=150.0, help="seconds per gpu test (pytest-timeout)")
    p.add_argument("--no-plot", action="store_true", help="do not draw headline.png")
    return p.parse_args(argv)


def _check_args(args: argparse.Namespace) -> Optional[set[str]]:
    """Refuse bad options before any work; return the parts asked for (``None``: all)."""
    if not 0 < args.time_budget < float("inf"):  # a budget is what ends the command: inf would never
        raise OptionError(f"--time-budget must be a positive, finite number of seconds, got {args.time_budget:g}.")
    if args.device is not None and not args.plan:
        raise OptionError(f"--device {args.device} picks the estimates of --plan; a run measures the device it finds: "
                         "add --plan, or leave --device out.")
    for name in ("micro_batch_size", "max_micro_batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise OptionError(f"--{name.replace('_', '-')} must be >= 1, got {value}.")
    if not args.test_timeout > 0:
        raise OptionError(f"--test-timeout must be a positive number of seconds, got {args.test_timeout:g}.")
    if args.out is not None and Path(args.out).is_file():
        raise OptionError(f"--out {args.out} is a file: name a folder.")
    if args.parts is None:
        return None
    wanted = {n.strip() for n in args.parts.split(",") if n.strip()}
    unknown = sorted(wanted - {p.name for p in PARTS})
    names = [p.name for p in PARTS[1:]]
    if not wanted:
        raise OptionError(f"--parts names no part: choose from {','.join(names)}.")
    if unknown:
        close = {u: difflib.get_close_matches(u.lower(), names, n=1, cutoff=0.6) for u in unknown}
        hints = "; ".join(f"for {u!r} did you mean {c[0]!r}?" for u, c in close.items() if c)
        raise OptionError(f"--parts has unknown names {unknown}{' (' + hints + ')' if hints else ''}: choose from "
                          f"{','.join(names)}.")
    return wanted


def _read_device() -> DeviceFacts:
    """This machine's training device. A GPU is read in a child process, so this one holds no CUDA context
    (it would take memory from the parts and AutoBatchSize's choice)."""
    if cuda_device_count() == 0:
        return read_device("cpu")
    code = "import dataclasses, json; from lightning_gpuopt.perf.device import read_device; " \
           "print(json.dumps(dataclasses.asdict(read_device('cuda'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=_child_env(tiny=False))
    if out.returncode != 0:
        raise RuntimeError(f"Reading the GPU failed: {out.stderr.strip()[-1000:]}\nCheck the driver with nvidia-smi.")
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    facts["capability"] = tuple(facts["capability"]) if facts["capability"] else None
    return DeviceFacts(**facts)


def _version(package: str) -> Optional[str]:
    if package == "python":
        return sys.version.split()[0]
    if package == "torch":
        import torch

        return torch.__version__  # with its build: 2.11.0+cu130
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _device_part(facts: DeviceFacts) -> dict[str, Any]:
    """Part a's facts: the device, what it can run, its datasheet peaks, the versions (no CUDA context here)."""
    import torch

    peaks = facts.peaks
    return {**dataclasses.asdict(facts), "describe": facts.describe(), "bf16": facts.bf16, "fp8": facts.fp8,
            "flash_attention": facts.flash_attention,
            "peak_tflops": None if peaks is None else {"name": peaks.name, "bf16": peaks.bf16, "fp8": peaks.fp8,
                                                       "source": peaks.source},
            "cuda": torch.version.cuda, "versions": {name: _version(name) for name in _VERSIONS}}


def _git_commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _child_env(tiny: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])  # this checkout first
    if tiny:
        env["TORCH_COMPILE_DISABLE"] = "1"  # torch's switch: compiled configurations run eagerly (said in the results)
        env["OMP_NUM_THREADS"] = "1"  # a tiny model gains nothing from more threads; on shared cores they spin
    return env


@dataclasses.dataclass
class ChildRun:
    """How a child process ended: its exit status (``None`` if it was stopped), its wall and CPU seconds, its output."""

    returncode: Optional[int]
    seconds: float
    stopped: bool
    output: str
    cpu_s: float = 0.0  # of the child and its own children: against the wall seconds, how busy the machine was


def run_child(cmd: list[str], limit_s: float, env: dict[str, str], grace_s: float = GRACE_S,
              cwd: Optional[Path] = None) -> ChildRun:
    """Run ``cmd`` (in ``cwd``, default this process's) in its own process group; at ``limit_s`` interrupt it
    (SIGINT: pytest still writes its XML), ``grace_s`` later kill the group. Whatever its end, nothing of the
    group is left running.

    Example::

        run_child([sys.executable, "-c", "print(1)"], limit_s=10, env=dict(os.environ)).output  # "1\\n"
    """
    began, cpu = time.monotonic(), _children_cpu_s()
    with tempfile.TemporaryFile("w+", errors="replace") as sink:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        stopped = False
        try:
            proc.wait(timeout=max(limit_s, 0.0))
        except subprocess.TimeoutExpired:
            stopped = True
            _signal_group(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        finally:
            if proc.poll() is None:  # this process was interrupted itself: do not leave the child running
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
            _signal_group(proc.pid, signal.SIGKILL)  # grandchildren the child left (compile workers, loaders)
        sink.seek(0)
        output = sink.read()
    return ChildRun(None if stopped else proc.returncode, time.monotonic() - began, stopped, output,
                    _children_cpu_s() - cpu)


def _die_with_parent() -> None:
    """In the child, before it runs: a SIGKILL when this command dies (Linux's ``PR_SET_PDEATHSIG``), so a
    ``kill -9`` of the command, which runs no ``finally``, does not leave its part running in its own session."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl: the part outlives a kill -9 as before
        pass


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _throughput_cmd(part: Part, args: argparse.Namespace, limit_s: float, folder: Path, estimates: dict[str, float]
                    ) -> list[str]:
    scale = _TINY if args.tiny else _GPU
    micro_batch = part_micro_batch(part, args.tiny, args.micro_batch_size)
    cmd = [sys.executable, "-m", "benchmarks.throughput", "--preset", "tiny" if args.tiny else part.preset,
           "--configs", ",".join(part.configs), "--fp8-recipe", part.fp8_recipe,
           "--repeats", str(part_repeats(part, args.tiny)), "--no-plot",
           "--micro-batch-size", str(micro_batch), "--data", args.data, "--out", str(folder)]
    for key in ("block_size", "global_batch_size", "steps", "warmup_steps", "tokenizer_vocab_size", "num_workers"):
        cmd += [f"--{key.replace('_', '-')}", str(scale[key])]
    bound = args.max_micro_batch_size or (scale.get("max_micro_batch_size") if args.tiny else None)
    if bound is not None and any(c.endswith("-auto") for c in part.configs):
        cmd += ["--max-micro-batch-size", str(bound)]
    if args.cache_dir:
        cmd += ["--cache-dir", args.cache_dir]
    if args.tiny:
        cmd.append("--fp8-emulate")
    # Its own budget starts no configuration that could not finish before the limit.
    soft = max(limit_s - max(config_estimates(part, estimates, args.tiny)), 1.0)
    return cmd + ["--time-budget", f"{soft:.0f}"]


def _tests_cmd(args: argparse.Namespace, xml: Path) -> list[str]:
    # -n 0: in this process, one test at a time (pyproject's addopts start xdist workers): the tests share one GPU.
    return [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-rs", "-p", "no:cacheprovider", "-n", "0",
            "--timeout", f"{args.test_timeout:g}", "--durations=0", f"--junitxml={xml}", *GPU_TEST_FILES]


def _cannot_run(part: Part) -> Optional[str]:
    """Why ``part`` cannot run in this checkout and environment (before its time is spent), or ``None``."""
    if part.kind == "generation" and importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install transformers): it is the peer this part compares with"
    if part.kind == "tests":
        missing = [f for f in GPU_TEST_FILES if not (ROOT / f).is_file()]
        if missing:
            return f"the gpu tests need the repository's tests/ folder; missing here: {', '.join(missing)}"
        for module, pip, why in (("pytest", "pytest", "the gpu tests run with it"),
                                 ("pytest_timeout", "pytest-timeout", "the gpu tests run with a timeout per test"),
                                 ("xdist", "pytest-xdist", "the checkout's pytest options name its -n")):
            if importlib.util.find_spec(module) is None:
                return f"{pip} is not installed (pip install {pip}): {why}"
    return None


def _run_part(part: Part, args: argparse.Namespace, limit_s: float, work: Path, out: Path,
              estimates: dict[str, float]) -> tuple[dict[str, Any], str]:
    """Run one child part within ``limit_s``; its entry in the results, and its output for the log."""
    folder = work / part.name
    folder.mkdir()
    if part.kind == "doctor":
        cmd = [sys.executable, "-m", "lightning_gpuopt", "doctor", "--steps", "1" if args.tiny else "5",
               "--json", str(folder / "doctor.json")]
    elif part.kind == "tests":
        cmd = _tests_cmd(args, out / "gpu-tests.xml")
    elif part.kind == "loss":
        cmd = [sys.executable, "-m", "benchmarks.loss_bench", "--out", str(folder), *(["--tiny"] if args.tiny else [])]
    elif part.kind == "generation":
        cmd = [sys.executable, "-m", "benchmarks.generation", *(_GENERATION_TINY if args.tiny else _GENERATION_GPU),
               "--repeats", "1", "--configs", "sequential,continuous,transformers", "--out", str(folder)]
    elif part.kind == "float8":
        cmd = [sys.executable, "-m", "benchmarks.float8_bench", "--out", str(folder), "--data", args.data,
               "--time-budget", f"{max(limit_s - 10, 1):.0f}", *(["--tiny"] if args.tiny else []),
               *(["--cache-dir", args.cache_dir] if args.cache_dir else [])]
    elif part.kind == "curve":
        cmd = [sys.executable, "-m", "benchmarks.residual_curve", "--out", str(folder), *(["--tiny"] if args.tiny else
               ["--data", args.data]), *(["--cache-dir", args.cache_dir] if args.cache_dir else [])]
    else:
        cmd = _throughput_cmd(part, args, limit_s, folder, estimates)
    # pytest from the checkout's root (its configuration, the test paths); the others where the command was
    # started, so relative --data and --cache-dir paths mean what they meant there.
    run = run_child(cmd, limit_s, _child_env(args.tiny), cwd=ROOT if part.kind == "tests" else None)
    entry: dict[str, Any] = {"command": shlex.join(["python", *cmd[1:]]), "seconds": run.seconds,
                             "cpu_s": run.cpu_s, "exit_code": run.returncode}
    if part.kind == "tests":
        entry["result"] = junit_summary(out / "gpu-tests.xml")
    elif part.kind in _RESULT_FILES:
        entry["result"] = _load_json(folder / _RESULT_FILES[part.kind])
    else:
        found = sorted(folder.glob("throughput-*.json"))
        entry["result"] = _load_json(found[0]) if found else None
    entry["status"], entry["reason"] = _status(part, run, entry["result"], limit_s)
    return entry, run.output


def _load_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _status(part: Part, run: ChildRun, result: Optional[dict[str, Any]], limit_s: float) -> tuple[str, str]:
    """``ok``, ``stopped`` (reached its limit: what finished is kept) or ``failed``, and why."""
    if run.stopped:
        kept = "the tests that finished are in gpu-tests.xml" if part.kind == "tests" else "what finished is kept"
        return "stopped", f"reached its limit of {limit_s:.0f} s and was stopped; {kept}"
    if run.returncode == 0:
        return ("ok", "") if result is not None else ("failed", "exited 0 but wrote no results (see headline.log)")
    last = [line for line in run.output.strip().splitlines() if line.strip()][-1:] or ["no output"]
    if part.kind == "tests" and result is not None and run.returncode == 1:
        return "failed", f"{len(result['failed'])} of {result['tests']} tests failed"
    if part.kind == "doctor" and result is not None:
        failed = [c["name"] for c in result["checks"] if c["status"] == "fail"]
        return "failed", f"failed checks: {', '.join(failed) or '?'} (their fixes are in the doctor section)"
    if part.kind == "throughput" and result is not None:
        failed = [n for n, e in result["summary"].items() if e["status"] == "failed"]
        return "failed", f"{', '.join(failed) or 'a configuration'} failed (see the table and headline.log)"
    return "failed", f"exit status {run.returncode}: {last[0][:500]}"


def _log_output(name: str, entry: dict[str, Any], output: str) -> None:
    data = output.encode(errors="replace")
    if len(data) > _LOG_HEAD + _LOG_TAIL:
        cut = len(data) - _LOG_HEAD - _LOG_TAIL
        output = (data[:_LOG_HEAD].decode(errors="replace") + f"\n[... {cut} bytes left out ...]\n"
                  + data[-_LOG_TAIL:].decode(errors="replace"))
    child_log.info("== %s: %s (%.0f s, exit %s)\n%s", name, entry["command"], entry["seconds"], entry["exit_code"],
                   output)


class _Results:
    """The results on disk, rewritten after every part: JSON, Markdown and the chart."""

    def __init__(self, out: Path, head: dict[str, Any], started: float, plot_ok: bool) -> None:
        self.out, self.head, self.started, self.plot_ok = out, head, started, plot_ok
        self.parts: dict[str, dict[str, Any]] = {}

    def write(self, complete: bool) -> dict[str, Any]:
        report = {**self.head, "complete": complete, "elapsed_s": time.monotonic() - self.started,
                  "parts": self.parts, "headline": headline_rows(self.parts)}
        write_json(self.out / "headline.json", report)
        write_text(self.out / "headline.md", markdown(report))
        if self.plot_ok and report["headline"]:
            plot(self.out / "headline.png", report)
        return report


def _facts_for(args: argparse.Namespace) -> DeviceFacts:
    if args.device is not None:
        return REFERENCE_DEVICES[_DEVICE_NAMES[args.device]]
    facts = _read_device()
    if not facts.is_cuda and not args.tiny:
        raise OptionError(
            "No CUDA GPU here: the headline figures need one. --plan --device h100 (or h200) prints a GPU's plan on "
            "any machine; --tiny runs every part at the tiny preset on this device (a smoke run: measures nothing)."
        )
    return facts


def _plot_ok(args: argparse.Namespace) -> bool:
    if args.no_plot:
        log.info("--no-plot: no headline.png")
        return False
    if importlib.util.find_spec("matplotlib") is None:
        log.warning("matplotlib is not installed (pip install matplotlib): no headline.png; the figures are in "
                    "headline.json and headline.md")
        return False
    return True


def main(argv: Optional[list[str]] = None, started: Optional[float] = None) -> int:  # long: one part after another
    """Print the plan, then run the parts that fit; return the exit status (1 if a part failed).

    Args:
        argv: Command-line arguments (default ``sys.argv[1:]``).
        started: ``time.monotonic()`` when the command started (default: now); the budget counts from it.
    """
    started = time.monotonic() if started is None else started
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    wanted = _check_args(args)
    facts = _facts_for(args)
    out = (Path(args.out) if args.out else Path("benchmark-results") / device_slug(facts.name)).resolve()
    if not args.plan:
        try:
            check_out_folder(out)  # before the plan: a folder that cannot be written would lose every part's results
        except ValueError as err:
            raise OptionError(str(err)) from None
    family, note = estimate_family(facts, args.tiny)
    estimates = ESTIMATES[family]
    measured = {p.name for p in PARTS if measured_part(p, family, args.tiny)}
    measured |= {k for k in ("start-up", "finish") if k in MEASURED[family]}
    if args.tiny:
        basis = "from runs on a 2-core CPU"
    elif MEASURED[family]:
        basis = f"'run': measured on an {family}; 'est': estimated (see the file)"
    else:
        basis = "estimates, not yet measured on this GPU"
    est_note = f"{family} row of benchmarks/_headline_plan.py ({basis})" + (f"; {note}" if note else "")
    rows, end = plan(list(PARTS), estimates, args.tiny, args.time_budget, wanted)
    scale = " (--tiny: every part at the tiny preset, T 32, measures nothing)" if args.tiny else ""
    print(format_plan(rows, end, args.time_budget, f"Plan for {facts.describe()}{scale}, time {est_note}:", estimates,
                      measured))
    late = [r.part for r in rows if r.limit_s is None and r.reason.startswith("needs")]
    if late:
        commands = later_commands(late, estimates, args.tiny, args.time_budget)
        print("Skipped for the budget; further commands of the same budget run them: "
              + "; ".join(f"--parts {','.join(c)}" for c in commands))
    sys.stdout.flush()
    if args.plan:
        return 0

    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:  # a stale file of an earlier run must not pass for this one's
        (out / name).unlink(missing_ok=True)
    handler = logging.FileHandler(out / "headline.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    child_log.addHandler(handler)
    child_log.setLevel(logging.INFO)
    try:
        head = {"command": shlex.join(["python", "-m", "benchmarks.headline", *argv]), "tiny": args.tiny,
                "budget_s": args.time_budget, "git_commit": _git_commit(),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "estimates": {"family": family, "measured": sorted(measured), "note": est_note, "seconds": estimates},
                "device": _device_part(facts)}
        log.info("plan:\n%s", format_plan(rows, end, args.time_budget, est_note, estimates))
        results = _Results(out, head, started, _plot_ok(args))
        with tempfile.TemporaryDirectory(prefix="headline-") as tmp:
            for part in PARTS:
                entry = _one_part(part, args, wanted, estimates, started, Path(tmp), out)
                results.parts[part.name] = entry
                log.info("%s: %s%s", part.name, entry["status"], f" ({entry['reason']})" if entry.get("reason") else "")
                results.write(complete=False)
        report = results.write(complete=True)
    finally:
        log.removeHandler(handler)
        child_log.removeHandler(handler)
        handler.close()
    print(markdown(report))
    return 1 if any(p["status"] == "failed" for p in report["parts"].values()) else 0


def later_commands(late: list[str], estimates: dict[str, float], tiny: bool, budget_s: float) -> list[list[str]]:
    """``late`` (parts the budget skipped) split into commands of the same budget, in value order: each takes the
    parts that fit after the ones before it; a part that fits no budget of its own is left out (said by its plan).

    Example::

        later_commands(["throughput-774m", "auto-batch-124m"], ESTIMATES["H100"], False, 420)  # [[both]]
    """
    commands, left = [], list(late)
    while left:
        rows, _ = plan(list(PARTS), estimates, tiny, budget_s, wanted=set(left))
        ran = [r.part for r in rows if r.part in left and r.limit_s is not None]
        if not ran:
            break
        commands.append(ran)
        left = [p for p in left if p not in ran]
    return commands


def _one_part(part: Part, args: argparse.Namespace, wanted: Optional[set[str]], estimates: dict[str, float],
              started: float, work: Path, out: Path) -> dict[str, Any]:
    """Decide and run one part: its entry in the results."""
    asked = [p for p in PARTS if p.kind != "device" and (wanted is None or p.name in wanted)]
    estimate = part_estimate(part, estimates, args.tiny)
    entry: dict[str, Any] = {"kind": part.kind, "what": part.what, "estimate_s": estimate, "limit_s": None}
    if part.kind == "device":
        return {**entry, "status": "ok", "reason": "", "seconds": 0.0}
    if wanted is not None and part.name not in wanted:
        return {**entry, "status": "skipped", "reason": "not asked for (--parts)"}
    left = args.time_budget - (time.monotonic() - started)
    limit, reason = decide(part, estimates, args.tiny, left, asked[asked.index(part) + 1:])
    reason = reason or _cannot_run(part) or ""
    if limit is None or reason:
        log.warning("%s skipped: %s", part.name, reason)
        return {**entry, "status": "skipped", "reason": reason}
    log.info("%s: starting, limit %.0f s (estimate %.0f s) ...", part.name, limit, estimate)
    ran, output = _run_part(part, args, limit, work, out, estimates)
    _log_output(part.name, ran, output)
    return {**entry, "limit_s": limit, **ran}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    # SIGTERM (a machine's own time limit) ends the command through its finally blocks, which stop the running part.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        sys.exit(main(started=_STARTED))
    except OptionError as err:
        sys.exit(f"error: {err}")
