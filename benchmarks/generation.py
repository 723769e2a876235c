"""Generation throughput: sequential batch-1 fp32 sampling against batched bf16 KV-cache sampling.

The same GPT (random weights: speed does not depend on them) continues the same prompts by the
same number of tokens in four ways, side by side in one process on one device:

===========================  ==================================================================
``seq-fp32-nocache``         one prompt at a time, fp32, the whole context recomputed per token
``seq-fp32``                 one prompt at a time, fp32, KV cache (the baseline: a plain loop)
``batched-fp32``             ``--batch-size`` prompts at a time, fp32, KV cache
``batched-bf16``             ``--batch-size`` prompts at a time, bf16 autocast, KV cache: what
                             ``gpuopt predict --generate.prompts_file`` runs
===========================  ==================================================================

Example::

    python -m benchmarks.generation                                   # CPU, small model
    python -m benchmarks.generation --device cuda --n-layer 12 --n-embd 768 --n-head 12 --prompts 256

Reports generated tokens/s (median of ``--repeats`` timed runs, in alternating order, after one
warm-up run each) and the
speed-up over ``seq-fp32``; writes ``generation.json`` and ``generation.md`` to
``--out`` (default ``benchmark-results/<device-slug>/`` in the current folder).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks._report import device_slug, write_text
from lightning_gpuopt.model import GPT, GPTConfig

__all__ = ["CONFIGS", "main", "run_config"]

# name -> (batched, dtype, use_cache)
CONFIGS: dict[str, tuple[bool, Optional[torch.dtype], bool]] = {
    "seq-fp32-nocache": (False, None, False),
    "seq-fp32": (False, None, True),
    "batched-fp32": (True, None, True),
    "batched-bf16": (True, torch.bfloat16, True),
}
BASELINE = "seq-fp32"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_config(
    model: GPT, prompts: torch.Tensor, new_tokens: int, batched: bool, batch_size: int,
    dtype: Optional[torch.dtype], use_cache: bool, seed: int = 0,
) -> float:
    """Seconds to continue every row of ``prompts`` (N, T) by ``new_tokens`` tokens in one configuration.

    Example::

        seconds = run_config(model, prompts, 64, batched=True, batch_size=32, dtype=torch.bfloat16, use_cache=True)
    """
    device = prompts.device
    step = batch_size if batched else 1
    generator = torch.Generator(device=device).manual_seed(seed)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
    _sync(device)
    start = time.perf_counter()
    with autocast:
        for i in range(0, prompts.size(0), step):
            model.generate(prompts[i : i + step], new_tokens, temperature=1.0, top_k=50, use_cache=use_cache,
                           generator=generator)
    _sync(device)
    return time.perf_counter() - start


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| configuration | batch | dtype | KV cache | tokens/s | speed-up vs `seq-fp32` |", "|---|---:|---|---|---:|---:|"]
    for r in rows:
        lines.append(f"| `{r['config']}` | {r['batch']} | {r['dtype']} | {'yes' if r['kv_cache'] else 'no'} | "
                     f"{r['tokens_per_sec']:,.0f} | {r['speedup']:.2f}x |")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    """The machine a figure was measured on: CPU model, cores, and the load average (other work shares the
    cores: a load above the core count slows every configuration and widens the repeats' spread)."""
    model = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpu": model, "cores": os.cpu_count(), "load_average_1min": load}


def _machine_line(m: dict[str, Any]) -> str:
    load = "" if m["load_average_1min"] is None else f", load average {m['load_average_1min']:.1f} at the start"
    return f"Measured on {m['cpu']}, {m['cores']} cores{load}."


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--prompts", type=int, default=32, help="number of prompts")
    p.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per batch in the batched configurations")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (the median is reported)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ", ".join(CONFIGS))
    p.add_argument("--out", default=None, help="output folder (default: benchmark-results/<device-slug> in the current folder)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        p.error(f"unknown --configs {unknown}: choose from {list(CONFIGS)}")
    if args.prompt_len + args.new_tokens > args.block_size:
        p.error(f"--prompt-len + --new-tokens ({args.prompt_len + args.new_tokens}) must fit in --block-size ({args.block_size}).")

    device = torch.device(args.device)
    torch.manual_seed(0)
    config = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                       vocab_size=args.vocab_size, block_size=args.block_size)
    model = GPT(config).to(device).eval()
    prompts = torch.randint(0, args.vocab_size, (args.prompts, args.prompt_len), device=device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")

    def run(name: str) -> float:
        batched, dtype, use_cache = CONFIGS[name]
        return run_config(model, prompts, args.new_tokens, batched, args.batch_size, dtype, use_cache)

    measured_on = machine()
    for name in names:
        run(name)  # warm-up: allocator, kernels, autocast caches
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(args.repeats):  # alternating order: a load change on the machine hits every configuration
        for name in names if repeat % 2 == 0 else names[::-1]:
            times[name].append(run(name))
            print(f"repeat {repeat + 1}: {name:18s} {args.prompts * args.new_tokens / times[name][-1]:12,.0f} tokens/s", flush=True)
    rows = []
    for name in names:
        batched, dtype, use_cache = CONFIGS[name]
        seconds = statistics.median(times[name])
        rows.append({"config": name, "batch": args.batch_size if batched else 1,
                     "dtype": "bf16" if dtype is torch.bfloat16 else "fp32", "kv_cache": use_cache,
                     "seconds": seconds, "seconds_all": times[name],
                     "tokens_per_sec": args.prompts * args.new_tokens / seconds})
    base = next((r["tokens_per_sec"] for r in rows if r["config"] == BASELINE), None)
    for r in rows:
        r["speedup"] = r["tokens_per_sec"] / base if base else float("nan")

    report = {"device": device_name, "machine": measured_on, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "model": {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head,
                        "vocab_size": args.vocab_size, "params": model.num_params()},
              "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "repeats": args.repeats, "results": rows}
    out = Path(args.out) if args.out else Path("benchmark-results") / device_slug(device_name)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "generation.json", json.dumps(report, indent=2) + "\n")
    table = _table(rows)
    write_text(out / "generation.md", f"# Generation on {device_name}\n\n{_machine_line(measured_on)}\n\n{table}\n")
    print(table)
    return report


if __name__ == "__main__":
    main()
