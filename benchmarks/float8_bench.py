"""The float8 measurements of the headline command: per-shape timings, float8-by-measurement against bf16, profiles.

Three steps, each child skipped (and said) when the rest of ``--time-budget`` cannot hold it; they run in value
order: the shapes, the 124m comparison, the profiles, then the other presets' comparisons.

1. ``shapes``: every distinct projection shape of each preset at its micro-batch, timed as ``Float8Precision``'s
   ``"auto"`` filter times it (the three GEMMs, casts modelled), for tensorwise and rowwise, and the decision;
   the ``124m`` shapes also as compiled ``Linear`` forward and backward (tensorwise), the slower way, to
   compare the two; and the output head inside the chunked loss (``loss_head``: one chunk at the chunk a run
   takes on this device, tensorwise, ``float8_timing.loss_head_timing``).
2. ``compare``: ``gpuopt-bf16-compile`` against ``gpuopt-fp8-compile`` (whose layers convert by measurement)
   per preset, 3 repeats in alternating order (``benchmarks.throughput`` children).
3. ``profile``: the 124m float8 step profiled at micro-batch 8 and 64 (``--profile-steps``).

Writes ``float8.json`` in ``--out``. ``--tiny`` runs all of it at the ``tiny`` preset on any device, emulated
(the CPU suite does, in seconds).

    python -m benchmarks.float8_bench --out results/float8 --time-budget 420
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = ["PRESETS", "STEPS", "child_commands", "main", "shape_rows"]

PRESETS = ("124m", "774m", "llama-1b", "1.5b")  # 1.5b last: it runs if the budget allows
STEPS = ("shapes", "compare", "profile")
_COMPARED = ("gpuopt-bf16-compile", "gpuopt-fp8-compile")
_RECIPES = ("tensorwise", "rowwise")


def shape_rows(preset: str, tokens: int, device: torch.device, recipes: tuple[str, ...] = _RECIPES,
               linear: bool = False, emulate: bool = False, repeats: int = 10) -> list[dict[str, Any]]:
    """Per recipe, each distinct projection shape of ``preset`` at ``tokens`` rows: bf16 and float8 milliseconds
    (the GEMM way, ``repeats`` runs; ``linear``: also the compiled-Linear way) and whether the ``"auto"`` filter
    converts it (on CUDA, where the step it is judged against is measured)."""
    from lightning_gpuopt.model import GPT
    from lightning_gpuopt.model.config import GPTConfig
    from lightning_gpuopt.perf.peaks import measure_peak_flops
    from lightning_gpuopt.precision.float8_decision import decide, loss_head_shape
    from lightning_gpuopt.precision.float8_layers import candidate_shapes, float8_config, require_torchao
    from lightning_gpuopt.model.loss import device_free_bytes, run_chunk_tokens
    from lightning_gpuopt.precision.float8_timing import copy_bandwidth, gemm_timing, linear_timing, loss_head_timing

    require_torchao()  # imported quietly here (torchao logs a line per kernel library this torch cannot load)
    config = GPTConfig.from_name(preset)
    with torch.device("meta"):
        model = GPT(config)
    counts = candidate_shapes(model, tokens)
    # the head inside the chunked loss, at the chunk a GPTModule run takes on this device (model/loss.py)
    chunk = run_chunk_tokens(config.padded_vocab_size, torch.bfloat16, device_free_bytes(device))
    head, chunks = loss_head_shape(chunk, config.n_embd, config.padded_vocab_size, tokens)
    bandwidth = copy_bandwidth(device, nbytes=1 << (30 if device.type == "cuda" else 22))
    ceiling = measure_peak_flops(device) if device.type == "cuda" else None
    step_ms = 1000 * model.flops_per_token(config.block_size) * tokens / ceiling if ceiling else None
    rows = []
    for recipe in recipes:
        try:
            timings = {s: gemm_timing(s[0], s[1], s[2], recipe, device, bandwidth, repeats) for s in counts}
            shapes = dict(counts)
            if recipe == "tensorwise":  # the loss's float8 head has tensorwise scales only
                timings[head] = loss_head_timing(*head[:3], chunks, device, bandwidth, repeats)
                shapes[head] = chunks
        except RuntimeError as err:  # e.g. torch 2.11's CPU _scaled_mm takes per-tensor scales only (not rowwise)
            reason = str(err).strip().splitlines()[-1]
            rows.append({"preset": preset, "recipe": recipe,
                         "skipped": f"torch {torch.__version__} cannot run its float8 GEMMs on {device.type}: {reason}"})
            continue
        decision = decide(timings, shapes, recipe, step_ms or 1.0, "gemm", loss_head=head) if step_ms else None
        for shape, t in timings.items():
            row_of = None if decision is None else (
                decision.loss_head() if shape == head else decision.shape(shape[1], shape[2], shape[3]))
            row = {"preset": preset, "recipe": recipe, "tokens": shape[0], "in": shape[1], "out": shape[2],
                   "bias": shape[3], "layers": shapes[shape], "bf16_ms": t.bf16_ms, "float8_ms": t.float8_ms,
                   "loss_head": shape == head, "converted": None if row_of is None else row_of.convert}
            if linear and recipe == "tensorwise" and shape != head:  # two compiles a shape: the default recipe only
                lt = linear_timing(*shape, float8_config(recipe, emulate), device)
                row.update(linear_bf16_ms=lt.bf16_ms, linear_float8_ms=lt.float8_ms)
            rows.append(row)
        if decision is not None and decision.declined:
            rows.append({"preset": preset, "recipe": recipe, "declined": decision.declined})
    return rows


def child_commands(tiny: bool, out: Path, data: str, cache_dir: Optional[str] = None) -> dict[str, list[list[str]]]:
    """The ``benchmarks.throughput`` commands of the ``compare`` and ``profile`` steps (``tiny``: the profile at
    micro-batch 8 only, to keep the smoke run short)."""
    scale = ["--block-size", "32", "--steps", "2", "--warmup-steps", "1", "--tokenizer-vocab-size", "384",
             "--num-workers", "0", "--fp8-emulate"] if tiny else ["--steps", "20", "--warmup-steps", "5"]
    base = [sys.executable, "-m", "benchmarks.throughput", "--no-plot", "--data", data, *scale]
    if cache_dir:
        base += ["--cache-dir", cache_dir]
    compare = [[*base, "--preset", "tiny" if tiny else preset, "--configs", ",".join(_COMPARED), "--repeats", "3",
                "--micro-batch-size", "8", "--out", str(out / f"compare-{preset}")]
               for preset in (("tiny",) if tiny else PRESETS)]
    profile = [[*base, "--preset", "tiny" if tiny else "124m", "--configs", "gpuopt-fp8-compile",
                "--micro-batch-size", str(micro), "--profile-steps", "1" if tiny else "3",
                "--out", str(out / f"profile-mb{micro}")] for micro in ((8,) if tiny else (8, 64))]
    return {"compare": compare, "profile": profile}


def _run_children(cmds: list[list[str]], deadline: float) -> list[dict[str, Any]]:
    done = []
    for cmd in cmds:
        left = deadline - time.monotonic()
        if left <= 5:
            done.append({"command": cmd[2:], "status": "skipped", "reason": "the time budget is spent"})
            continue
        # its own budget starts no configuration late, so a child near the end still writes what it measured
        cmd = [*cmd, "--time-budget", f"{max(0.7 * left, 1):.0f}"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            done.append({"command": cmd[2:], "status": "stopped", "reason": f"reached the budget ({left:.0f} s)"})
            continue
        out = Path(cmd[cmd.index("--out") + 1])
        found = sorted(out.glob("throughput-*.json"))
        done.append({"command": cmd[2:], "status": "ok" if proc.returncode == 0 else "failed",
                     "exit_code": proc.returncode, "output_tail": proc.stdout[-2000:] + proc.stderr[-2000:],
                     "result": json.loads(found[0].read_text()) if found else None})
    return done


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.float8_bench", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for float8.json and the children's results")
    p.add_argument("--tiny", action="store_true", help="the tiny preset, emulated, on any device (tests)")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, from: {','.join(STEPS)}")
    p.add_argument("--data", default="auto", help="training text of the throughput children (their --data)")
    p.add_argument("--cache-dir", default=None, help="their token cache (their --cache-dir)")
    p.add_argument("--time-budget", type=float, default=600.0, help="seconds for all steps; the rest are skipped")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    """Run the steps asked for within the budget; write ``float8.json``; 1 if a child failed."""
    args = parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        print(f"--steps has unknown names {unknown}: choose from {','.join(STEPS)}.", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.time_budget
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                              "tiny": args.tiny, "steps": {}}
    if "shapes" in steps:
        started = time.perf_counter()
        presets = ("tiny",) if args.tiny else PRESETS
        # 8 sequences of 1024 tokens, as the children train; tiny: one of 32, timed once (a CPU's float8 matmuls
        # are slow and decide nothing: the step only has to run)
        rows = [row for preset in presets
                for row in shape_rows(preset, 32 if args.tiny else 8 * 1024, device, linear=preset == "124m",
                                      emulate=args.tiny, repeats=1 if args.tiny else 10)]
        result["steps"]["shapes"] = {"rows": rows, "seconds": time.perf_counter() - started}
    commands = child_commands(args.tiny, out, args.data, args.cache_dir)
    compare, profile = (commands[s] if s in steps else [] for s in ("compare", "profile"))
    first = _run_children(compare[:1], deadline)  # 124m: where the static rule lost most
    profiled = _run_children(profile, deadline)
    rest = _run_children(compare[1:], deadline)
    for step, done in (("compare", first + rest), ("profile", profiled)):
        if step in steps:
            result["steps"][step] = done
    (out / "float8.json").write_text(json.dumps(result, indent=1))
    failed = any(c.get("status") == "failed" for s in ("compare", "profile") for c in result["steps"].get(s, []))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
