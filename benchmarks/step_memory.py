"""Peak memory and time of one training step, by loss implementation, precision and micro-batch size.

Each measurement runs in a fresh process (so one cannot inherit another's allocator cache): build a
``GPT``, run one training step (forward with targets, backward, AdamW step), and report its time
and peak memory: ``torch.cuda.max_memory_allocated`` on a GPU, the process's
peak resident memory (``ru_maxrss``) on the CPU. ``bf16`` is the product's precision (bf16-mixed:
float32 weights, bf16 autocast); ``32`` is float32.

Loss implementations: ``plain`` (full float32 logits), ``chunked`` (ours, the default), and torch's
own ``F.linear_cross_entropy`` (torch >= 2.13): ``native`` with automatic options, called as the
model's loss is (under autocast), and ``native-tuned`` with our chunk's token count
(``model.loss.chunk_tokens``) and its inputs cast to the compute dtype (its matmuls ignore autocast:
under bf16 autocast they would run in float32). On a torch without it the default ``--impls`` leave
the two out and say so; asking for them there is an error. Every implementation runs at the first
micro-batch (time there, as a ratio to ``plain``); ``--growth-impls`` also run at the others.

Example::

    python -m benchmarks.step_memory          # bf16 and 32, vocab 50257, T 1024, 2 x 128, mb 4 and 16
    python -m benchmarks.step_memory --device cuda --micro-batches 4,16,32
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any, Optional

from benchmarks._fresh_process import measure_in_fresh_process, write_rows

__all__ = ["choose_impls", "default_impls", "has_native_loss", "measure_step", "main"]

NATIVE_IMPLS = ("native", "native-tuned")
ALL_IMPLS = ("plain", "chunked", *NATIVE_IMPLS)


def has_native_loss() -> bool:
    """Whether this torch has ``F.linear_cross_entropy`` and its options (torch >= 2.13; 2.11 has neither)."""
    import torch

    return hasattr(torch.nn.functional, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")


def default_impls() -> tuple[str, ...]:
    """Every loss implementation this torch can run: the native ones only where ``has_native_loss()``."""
    return ALL_IMPLS if has_native_loss() else tuple(i for i in ALL_IMPLS if i not in NATIVE_IMPLS)


def _native_missing(impls: Any) -> str:
    import torch

    return (f"{','.join(impls)} needs torch.nn.functional.linear_cross_entropy (torch >= 2.13); torch "
            f"{torch.__version__} has none: leave {','.join(impls)} out of --impls.")


def choose_impls(text: Optional[str]) -> list[str]:
    """The loss implementations to measure: ``--impls`` checked (unknown names, native ones this torch lacks:
    ``ValueError`` before any measurement), or ``default_impls()``, saying once what it leaves out."""
    import torch

    if text is None:
        if not has_native_loss():
            print(f"torch {torch.__version__} has no F.linear_cross_entropy (torch >= 2.13): the "
                  f"{' and '.join(NATIVE_IMPLS)} losses are left out.", file=sys.stderr)
        return list(default_impls())
    impls = [i.strip() for i in text.split(",") if i.strip()]
    unknown = [i for i in impls if i not in ALL_IMPLS]
    if unknown or not impls:
        raise ValueError(f"--impls has unknown names {unknown}: choose from {','.join(ALL_IMPLS)}.")
    native = [i for i in impls if i in NATIVE_IMPLS]
    if native and not has_native_loss():
        raise ValueError(f"--impls {_native_missing(native)}")
    return impls


def _native_loss(model, impl: str, device_type: str):
    """``GPT.loss_from_hidden`` through torch's ``F.linear_cross_entropy``."""
    import torch
    import torch.nn.functional as F

    from lightning_gpuopt.model.loss import chunk_tokens

    def loss(hidden, targets):
        weight, h, y = model.lm_head.weight, hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
        if impl == "native":
            options = torch.nn.LinearCrossEntropyOptions()
        else:
            dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else h.dtype
            h, weight = h.to(dtype), weight.to(dtype)
            options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_tokens(weight.size(0), dtype))
        return F.linear_cross_entropy(h, weight, y, ignore_index=-1, options=options)

    return loss


def measure_step(impl: str, micro_batch: int, device: str, precision: str, args: argparse.Namespace) -> dict[str, Any]:
    """One training step in this process; its peak memory (bytes) and time (s)."""
    import torch

    from lightning_gpuopt.model import GPT, GPTConfig

    if impl in NATIVE_IMPLS and not has_native_loss():
        raise RuntimeError(f"loss {_native_missing([impl])}")
    torch.manual_seed(0)
    config = GPTConfig(
        n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
        vocab_size=args.vocab_size, loss_impl="chunked" if impl in NATIVE_IMPLS else impl,
        loss_chunk_size=args.chunk_size,
    )
    device_type = torch.device(device).type
    model = GPT(config).to(device)
    if impl in NATIVE_IMPLS:
        model.loss_from_hidden = _native_loss(model, impl, device_type)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, args.vocab_size, (micro_batch, args.block_size), device=device)
    y = torch.randint(0, args.vocab_size, (micro_batch, args.block_size), device=device)
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = model(x, targets=y)
    loss.backward()
    optimizer.step()
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if cuda:
        peak, what = torch.cuda.max_memory_allocated() - base, "cuda_peak_allocated_above_model"
    else:
        peak, what = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak_rss"  # Linux: KiB
    return {"impl": impl, "micro_batch": micro_batch, "precision": precision, "peak_bytes": peak,
            "measure": what, "step_s": elapsed, "loss": loss.item()}


def _child(args: argparse.Namespace, impl: str, micro_batch: int, precision: str) -> dict[str, Any]:
    keys = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "device")
    chunk = [] if args.chunk_size is None else ["--chunk-size", args.chunk_size]
    row = measure_in_fresh_process("benchmarks.step_memory", [impl, micro_batch, precision, *chunk], args, keys)
    return {"impl": impl, "micro_batch": micro_batch, "precision": precision, **row}


def _gb(row: Optional[dict[str, Any]]) -> str:
    return f"{row['peak_bytes'] / 1e9:.2f}" if row and "peak_bytes" in row else "-"


def _table(rows: list[dict[str, Any]], micro_batches: list[int]) -> str:
    lo, hi = micro_batches[0], micro_batches[-1]
    lines = [f"| precision | loss | {' | '.join(f'mb {m} (GB)' for m in micro_batches)} | growth {lo} -> {hi} (GB) "
             f"| step at mb {lo} (s) | time / plain |",
             "|---|---|" + "---:|" * (len(micro_batches) + 3)]
    find = {(r["precision"], r["impl"], r["micro_batch"]): r for r in rows}
    for precision, impl in dict.fromkeys((r["precision"], r["impl"]) for r in rows):
        cells = [_gb(find.get((precision, impl, m))) for m in micro_batches]
        first, last = find.get((precision, impl, lo), {}), find.get((precision, impl, hi), {})
        growth = (f"{(last['peak_bytes'] - first['peak_bytes']) / 1e9:.2f}"
                  if "peak_bytes" in first and "peak_bytes" in last and lo != hi else "-")
        plain = find.get((precision, "plain", lo), {})
        step = f"{first['step_s']:.2f}" if "step_s" in first else "failed"
        ratio = f"{first['step_s'] / plain['step_s']:.2f}x" if "step_s" in first and "step_s" in plain else "-"
        lines.append(f"| {precision} | {impl} | {' | '.join(cells)} | {growth} | {step} | {ratio} |")
    bf16, fp32 = find.get(("bf16", "chunked", lo), {}), find.get(("32", "chunked", lo), {})
    if "peak_bytes" in bf16 and "peak_bytes" in fp32:
        lines.append(f"\nchunked at mb {lo}: bf16 peaks {(bf16['peak_bytes'] - fp32['peak_bytes']) / 1e9:+.2f} GB "
                     "against float32.")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_memory", description=__doc__.split("\n")[0])
    p.add_argument("--impls", default=None,
                   help=f"loss implementations, each at the first micro-batch (default: {','.join(ALL_IMPLS)}; "
                   "the native ones only on a torch with F.linear_cross_entropy)")
    p.add_argument("--growth-impls", default="chunked", help="those also run at the other micro-batches")
    p.add_argument("--micro-batches", default="4,16")
    p.add_argument("--precisions", default="bf16,32", help="bf16 (bf16-mixed, the product's) and/or 32")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default: from the byte budget)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="write the JSON here")
    p.add_argument("--child", nargs=3, metavar=("IMPL", "MICRO_BATCH", "PRECISION"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        impl, micro_batch, precision = args.child
        print(json.dumps(measure_step(impl, int(micro_batch), args.device, precision, args)))
        return 0
    impls = choose_impls(args.impls)
    micro_batches = [int(m) for m in args.micro_batches.split(",")]
    growth = args.growth_impls.split(",")
    rows = [_child(args, impl, mb, precision)
            for precision in args.precisions.split(",") for impl in impls
            for mb in (micro_batches if impl in growth else micro_batches[:1])]
    table = _table(rows, micro_batches)
    print(f"GPT {args.n_layer} x {args.n_embd}, vocab {args.vocab_size}, T {args.block_size}, {args.device}; "
          f"peak = {rows[0].get('measure', '?')}\n{table}")
    return write_rows(args.out, args, rows, table)


if __name__ == "__main__":
    sys.exit(main())
