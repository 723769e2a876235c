"""Peak memory of one training step, by loss implementation and micro-batch size.

Each measurement runs in a fresh process (so one cannot inherit another's allocator cache): build a
``GPT``, run one training step (forward with targets, backward, AdamW step) and report the peak:
``torch.cuda.max_memory_allocated`` on a GPU, the process's peak resident memory (``ru_maxrss``)
on the CPU. What matters is the growth from the smallest micro-batch to the largest: the extra
sequences' activations and, with ``loss_impl="plain"``, their full float32 logits.

Example::

    python -m benchmarks.step_memory                      # vocab 50257, T 1024, 2 x 128, mb 1 and 8
    python -m benchmarks.step_memory --device cuda --precision bf16 --micro-batches 1,8,32
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any, Optional

from benchmarks._fresh_process import measure_in_fresh_process, write_rows

__all__ = ["measure_step", "main"]


def measure_step(impl: str, micro_batch: int, device: str, precision: str, args: argparse.Namespace) -> dict[str, Any]:
    """One training step in this process; returns its peak memory (bytes) and time (s)."""
    import torch

    from lightning_gpuopt.model import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(
        n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
        vocab_size=args.vocab_size, loss_impl=impl, loss_chunk_size=args.chunk_size,
    )
    model = GPT(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, args.vocab_size, (micro_batch, args.block_size), device=device)
    y = torch.randint(0, args.vocab_size, (micro_batch, args.block_size), device=device)
    autocast = torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bf16")
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    with autocast:
        loss = model(x, targets=y)
    loss.backward()
    optimizer.step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if device.startswith("cuda"):
        peak, what = torch.cuda.max_memory_allocated() - base, "cuda_peak_allocated_above_model"
    else:
        peak, what = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak_rss"  # Linux: KiB
    return {"impl": impl, "micro_batch": micro_batch, "peak_bytes": peak, "measure": what,
            "step_s": elapsed, "loss": float(loss)}


def _child(args: argparse.Namespace, impl: str, micro_batch: int) -> dict[str, Any]:
    keys = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "chunk_size", "device", "precision")
    return {"impl": impl, "micro_batch": micro_batch,
            **measure_in_fresh_process("benchmarks.step_memory", [impl, micro_batch], args, keys)}


def _table(rows: list[dict[str, Any]], micro_batches: list[int]) -> str:
    lo, hi = min(micro_batches), max(micro_batches)
    lines = [f"| loss_impl | {' | '.join(f'mb {m} (GB)' for m in micro_batches)} | growth {lo} -> {hi} (GB) |",
             "|---|" + "---:|" * (len(micro_batches) + 1)]
    for impl in dict.fromkeys(r["impl"] for r in rows):
        by_mb = {r["micro_batch"]: r for r in rows if r["impl"] == impl}
        cells = [f"{by_mb[m]['peak_bytes'] / 1e9:.2f}" if "peak_bytes" in by_mb[m] else "failed" for m in micro_batches]
        ok = all("peak_bytes" in by_mb[m] for m in (lo, hi))
        growth = f"{(by_mb[hi]['peak_bytes'] - by_mb[lo]['peak_bytes']) / 1e9:.2f}" if ok else "-"
        lines.append(f"| {impl} | {' | '.join(cells)} | {growth} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_memory", description=__doc__.split("\n")[0])
    p.add_argument("--impls", default="plain,chunked", help="loss implementations to compare")
    p.add_argument("--micro-batches", default="1,8")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="32", choices=["32", "bf16"])
    p.add_argument("--out", default=None, help="write the JSON here")
    p.add_argument("--child", nargs=2, metavar=("IMPL", "MICRO_BATCH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure_step(args.child[0], int(args.child[1]), args.device, args.precision, args)))
        return 0
    micro_batches = [int(m) for m in args.micro_batches.split(",")]
    rows = [_child(args, impl, mb) for impl in args.impls.split(",") for mb in micro_batches]
    table = _table(rows, micro_batches)
    print(f"GPT {args.n_layer} x {args.n_embd}, vocab {args.vocab_size}, T {args.block_size}, {args.device}, "
          f"precision {args.precision}; peak = {rows[0].get('measure', '?')}\n{table}")
    return write_rows(args.out, args, rows, table)


if __name__ == "__main__":
    sys.exit(main())
