"""Compile time of the first training step: each block on its own vs the whole model as one graph.

Each measurement runs in a fresh process with an empty Inductor cache (so nothing is reused from an
earlier run): build a ``GPT``, compile it (``compile_blocks()`` or ``compile()``), and time the first
forward + backward, which is where Dynamo traces and Inductor compiles (one compile thread, so the
kernels are built by the measured process and the compilers it runs). Reported: wall seconds and
CPU seconds (user + system, of the process and its compiler processes), which a loaded machine
inflates less than the wall time.

Example::

    python -m benchmarks.compile_time                         # 12 and 36 layers, on the CPU
    python -m benchmarks.compile_time --layers 12,36 --device cuda --n-embd 768 --block-size 1024
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from typing import Any, Optional

from benchmarks._fresh_process import measure_in_fresh_process, write_rows

__all__ = ["first_step", "main"]


def first_step(scope: str, n_layer: int, args: argparse.Namespace) -> dict[str, Any]:
    """Compile and run one training step in this process; return its wall and CPU seconds."""
    import torch

    from lightning_gpuopt.model import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(n_layer=n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                       vocab_size=args.vocab_size)
    model = GPT(config).to(args.device)
    x = torch.randint(0, args.vocab_size, (args.batch_size, args.block_size), device=args.device)
    if scope == "block":
        model.compile_blocks()
    else:
        model.compile()
        model.compile_loss = True
    cpu0, wall0 = _cpu_seconds(), time.perf_counter()
    with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=args.device != "cpu"):
        loss = model(x, targets=x)
    loss.backward()
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    return {"scope": scope, "n_layer": n_layer, "wall_s": time.perf_counter() - wall0, "cpu_s": _cpu_seconds() - cpu0}


def _cpu_seconds() -> float:
    # This process and the compilers it ran (Inductor's C++ kernels are built by a g++ subprocess).
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _child(args: argparse.Namespace, scope: str, n_layer: int) -> dict[str, Any]:
    keys = ("n_head", "n_embd", "block_size", "vocab_size", "batch_size", "device")
    with tempfile.TemporaryDirectory() as cache:
        # One compile thread: Inductor then builds its kernels in this process, so its CPU time is counted.
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
               "TORCHINDUCTOR_AUTOGRAD_CACHE": "0", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        row = measure_in_fresh_process("benchmarks.compile_time", [scope, n_layer], args, keys, env)
    return {"scope": scope, "n_layer": n_layer, **row}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compile_time", description=__doc__.split("\n")[0])
    p.add_argument("--layers", default="12,36")
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="write the JSON here")
    p.add_argument("--child", nargs=2, metavar=("SCOPE", "N_LAYER"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(first_step(args.child[0], int(args.child[1]), args)))
        return 0
    rows = [_child(args, scope, int(n)) for n in args.layers.split(",") for scope in ("block", "model")]
    lines = ["| layers | per-block wall (s) | per-block CPU (s) | whole-model wall (s) | whole-model CPU (s) | whole / per-block (CPU) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for n in args.layers.split(","):
        block, whole = (next(r for r in rows if r["n_layer"] == int(n) and r["scope"] == s) for s in ("block", "model"))
        if "error" in block or "error" in whole:
            lines.append(f"| {n} | failed: {block.get('error') or whole.get('error')} |||||")
            continue
        lines.append(f"| {n} | {block['wall_s']:.1f} | {block['cpu_s']:.1f} | {whole['wall_s']:.1f} | "
                     f"{whole['cpu_s']:.1f} | {whole['cpu_s'] / block['cpu_s']:.2f}x |")
    table = "\n".join(lines)
    print(f"first training step (compile included), n_embd {args.n_embd}, T {args.block_size}, {args.device}\n{table}")
    return write_rows(args.out, args, rows, table)


if __name__ == "__main__":
    sys.exit(main())
