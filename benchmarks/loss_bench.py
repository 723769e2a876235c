"""The loss microbenchmark: forward and backward of the language-model loss from hidden states, by implementation.

One process, one set of inputs: hidden states ``(tokens, width)`` in float32 (what the last norm gives under
autocast), the head weight ``(vocab, width)`` in float32, random targets; the matmuls in ``--dtype`` (bf16
autocast by default on a GPU, float32 on a CPU). Each implementation is warmed up (its compilation there),
then timed in ``--rounds`` rounds of ``--repeats`` steps, the implementations in a rotated order each round
so that a drift of the machine does not favour one; the table gives the median step and the spread of the
rounds' medians. The implementations:

- ``before``: the chunked loss as it was: the one-hot added by ``scatter_add_`` and a per-chunk kernel compiled
  with dynamic shapes, at the fixed 512 MiB budget (its chunk a multiple of 16 tokens); today's chunk loop
  around it (the tail chunk padded, as the new one pads it);
- ``chunked``: ``model.loss.linear_cross_entropy`` compiled (``compile_chunk=True``), at the run's chunk
  from the device's free memory (``run_chunk_tokens``), as a compiled ``GPTModule`` runs it;
- ``chunked-eager``: the same without compiling, as an uncompiled ``GPTModule`` runs it;
- ``chunked-float8``: ``chunked`` with the head's three GEMMs in float8 (``head_float8=True``), as a
  ``GPTModule`` runs it where ``Float8Precision`` timed the head to pay (the row runs on a GPU with float8
  matmuls, or on a CPU);
- ``full-compiled``: the full logits in one compiled graph, ``F.cross_entropy(F.linear(h, w).float(), t)``;
- ``torch-native``: torch's ``F.linear_cross_entropy`` (torch >= 2.13) with automatic options, given the
  inputs in the compute dtype (its matmuls ignore autocast);
- ``liger``: Liger-Kernel's fused linear cross-entropy (``loss_impl="liger"``; CUDA, ``liger-kernel``);
- ``cut-cross-entropy``: Apple's ``cut_cross_entropy.linear_cross_entropy`` (CUDA, ``cut-cross-entropy``).

An implementation that cannot run here is skipped with its reason. ``keeps`` says which of the loss's
promises an implementation keeps (``docs/model.md``, "The loss"): a float32 loss exact against
``F.cross_entropy``, fp16 gradients without underflow, the vocabulary-parallel form under tensor
parallelism. The default (``model.loss.resolve_loss_impl``) is the fastest that keeps all three.

Example::

    python -m benchmarks.loss_bench --out results/           # a GPU: 65,536 tokens, width 768, vocabulary 50,304
    nice python -m benchmarks.loss_bench --device cpu --tokens 4096 --width 128 --dtype float32
    python -m benchmarks.loss_bench --tiny                   # every implementation at a tiny size: measures nothing
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

__all__ = ["IMPLS", "KEEPS", "main", "markdown_lines", "run"]

IMPLS = ("before", "chunked", "chunked-eager", "chunked-float8", "full-compiled", "torch-native", "liger",
         "cut-cross-entropy")
_ALL_PROMISES = ("exact float32 loss", "fp16 gradients", "tensor parallel")
# The promises each keeps (docs/model.md, "The loss"; torch's own: tests/model/test_loss.py checks the reasons).
KEEPS: dict[str, tuple[str, ...]] = {
    "before": _ALL_PROMISES, "chunked": _ALL_PROMISES, "chunked-eager": _ALL_PROMISES,
    "chunked-float8": (),  # float8 logits and gradients (tolerance: tests/model/test_loss_float8.py), one rank
    "full-compiled": ("exact float32 loss",),  # its logits' gradient is formed in the compute dtype
    "torch-native": (),  # a loss in the inputs' dtype; fp16 gradients formed in fp16
    "liger": (),  # a loss and gradients in the inputs' dtype (tolerance 3e-2 in bf16: tests/model/test_loss.py)
    "cut-cross-entropy": (),
}
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
           "float32": "float32", "32": "float32"}
_GPU_SIZE = dict(tokens=65536, width=768, vocab=50304)
_TINY = dict(tokens=96, width=32, vocab=512, rounds=1, repeats=1, warmup=1)


class Skip(Exception):
    """An implementation that cannot run here; the message says why."""


def _before_chunk_loss_and_grad(h_c, w, targets, ignore_index, grad_dtype, lift):
    """The per-chunk kernel as it was: the softmax's one-hot subtracted by a scatter (a mutation)."""
    import torch

    from lightning_gpuopt.model import loss

    exp, total, loss_sum, valid, safe = loss._exp_and_loss(h_c @ w.t(), targets, ignore_index)
    grad = exp.div_(total)
    grad.scatter_add_(1, safe, torch.full_like(total, -1.0))
    grad.mul_((valid.to(grad.dtype) * lift).unsqueeze(1))
    return loss_sum, grad.to(grad_dtype)


@functools.cache
def _before_compiled(fn: Callable) -> Callable:
    import torch

    return torch.compile(fn, dynamic=True)


@contextlib.contextmanager
def _as_before() -> Iterator[None]:
    """The chunk loop with the kernel it had, compiled as it was (dynamic shapes, the default split reductions)."""
    from unittest import mock

    from lightning_gpuopt.model import loss

    with mock.patch.object(loss, "_chunk_loss_and_grad", _before_chunk_loss_and_grad), \
            mock.patch.object(loss, "_compiled", _before_compiled):
        yield


def _before_chunk_tokens(vocab: int, dtype: Any) -> int:
    """The chunk at the fixed 512 MiB budget, a multiple of 16 tokens (1,776 in bf16 at a vocabulary of 50,304)."""
    import torch

    per_logit = 6 if dtype in (torch.bfloat16, torch.float16) else 4
    tokens = max(1, 2**29 // (vocab * per_logit))
    return tokens - tokens % 16 if tokens > 16 else tokens


def _make(impl: str, device: Any, dtype: Any, vocab: int) -> tuple[Callable, dict[str, Any]]:
    """A step ``(h, w, t) -> loss`` for ``impl``, and what it runs at; ``Skip`` where it cannot run here."""
    import torch
    import torch.nn.functional as F

    from lightning_gpuopt.model.loss import _liger, device_free_bytes, linear_cross_entropy, run_chunk_tokens

    cuda = device.type == "cuda"
    if impl == "before":
        chunk = _before_chunk_tokens(vocab, dtype)

        def step(h, w, t):
            with _as_before():
                return linear_cross_entropy(h, w, t, chunk_size=chunk, impl="chunked", compile_chunk=True)

        return step, {"chunk_tokens": chunk}
    if impl in ("chunked", "chunked-eager"):
        chunk, compiled = run_chunk_tokens(vocab, dtype, device_free_bytes(device)), impl == "chunked"
        return (lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=chunk, impl="chunked",
                                                     compile_chunk=compiled)), \
            {"chunk_tokens": chunk}
    if impl == "chunked-float8":
        if cuda and torch.cuda.get_device_capability(device) < (8, 9):
            raise Skip("float8 matmuls need compute capability >= 8.9")
        chunk = run_chunk_tokens(vocab, dtype, device_free_bytes(device))
        return (lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=chunk, impl="chunked", compile_chunk=True,
                                                     head_float8=True)), {"chunk_tokens": chunk}
    if impl == "full-compiled":
        return torch.compile(lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-1)), {}
    if impl == "torch-native":
        if not hasattr(F, "linear_cross_entropy") or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
            raise Skip(f"torch {torch.__version__} has no F.linear_cross_entropy (torch >= 2.13)")
        options = torch.nn.LinearCrossEntropyOptions()
        return (lambda h, w, t: F.linear_cross_entropy(h.to(dtype), w.to(dtype), t, ignore_index=-1,
                                                       options=options)), {}
    if impl == "liger":
        if not cuda:
            raise Skip("Liger-Kernel runs on CUDA only")
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            raise Skip("liger-kernel is not installed (pip install liger-kernel)") from None
        return (lambda h, w, t: _liger(h, w, t, -1, dtype)), {}
    if impl == "cut-cross-entropy":
        if not cuda:
            raise Skip("cut-cross-entropy runs on CUDA only (Triton kernels)")
        try:
            from cut_cross_entropy import linear_cross_entropy as cce
        except ImportError:
            raise Skip("cut-cross-entropy is not installed (pip install cut-cross-entropy)") from None
        return (lambda h, w, t: cce(h.to(dtype), w.to(dtype), t, ignore_index=-1)), {}
    raise ValueError(f"unknown loss implementation {impl!r}: choose from {', '.join(IMPLS)}")


def _timed(step: Callable, inputs: tuple, device: Any, dtype: Any, repeats: int) -> tuple[list[float], float]:
    """``repeats`` forward+backward steps: their seconds each, and the last loss."""
    import torch

    h, w, t = inputs
    times, loss = [], float("nan")
    for _ in range(repeats):
        h.grad = w.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            out = step(h, w, t)
        out.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        loss = out.detach()
    return times, float(loss)


def run(args: argparse.Namespace, write: Callable[[dict[str, Any]], None] = lambda result: None) -> dict[str, Any]:
    """Measure every implementation asked for; ``write`` gets the results after each stage (a stop keeps them)."""
    import torch

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(args.tokens, args.width, generator=g)).to(device).requires_grad_()
    w = (0.02 * torch.randn(args.vocab, args.width, generator=g)).to(device).requires_grad_()
    t = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    result: dict[str, Any] = {
        "command": "python -m benchmarks.loss_bench " + " ".join(args.argv), "device": _describe(device),
        "torch": torch.__version__, "tokens": args.tokens, "width": args.width, "vocab": args.vocab,
        "dtype": args.dtype, "rounds": args.rounds, "repeats": args.repeats, "rows": {}}
    steps = {}
    for impl in args.impls:
        row = result["rows"][impl] = {"impl": impl, "keeps": list(KEEPS[impl])}
        try:
            steps[impl], facts = _make(impl, device, dtype, args.vocab)
            row.update(facts)
            began = time.perf_counter()
            _timed(steps[impl], (h, w, t), device, dtype, args.warmup)
            row.update(status="ok", warmup_s=time.perf_counter() - began)
        except Skip as why:
            row.update(status="skipped", reason=str(why))
            steps.pop(impl, None)
        except Exception as err:  # one implementation's failure is a row of the table, not the end of the others
            row.update(status="failed", reason=f"{type(err).__name__}: {str(err)[:500]}")
            steps.pop(impl, None)
        write(result)
    times: dict[str, list[float]] = {impl: [] for impl in steps}
    rounds: dict[str, list[float]] = {impl: [] for impl in steps}
    order = list(steps)
    for r in range(args.rounds):
        for impl in order[r % len(order):] + order[:r % len(order)] if order else []:
            if device.type == "cuda":
                h.grad = w.grad = None  # the last loss's gradients: not counted as this one's
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            took, loss = _timed(steps[impl], (h, w, t), device, dtype, args.repeats)
            times[impl] += took
            rounds[impl].append(statistics.median(took))
            row = result["rows"][impl]
            row.update(ms=1e3 * statistics.median(times[impl]), loss=loss,
                       spread_ms=1e3 * (max(rounds[impl]) - min(rounds[impl])))
            if device.type == "cuda":
                row["peak_gb_above_inputs"] = (torch.cuda.max_memory_allocated(device) - base) / 1e9
        write(result)
    result["fastest_keeping_all"] = _fastest(result["rows"])
    write(result)
    return result


def _fastest(rows: dict[str, dict[str, Any]]) -> Optional[str]:
    kept = [r for r in rows.values() if "ms" in r and tuple(r["keeps"]) == _ALL_PROMISES]
    return min(kept, key=lambda r: r["ms"])["impl"] if kept else None


def _describe(device: Any) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def markdown_lines(result: dict[str, Any]) -> list[str]:
    """The results as a Markdown table, the command and the size above it."""
    lines = [f"## Loss microbenchmark: {result['device']}, torch {result['torch']}", "",
             f"- command: `{result['command']}`",
             f"- forward + backward of {result['tokens']:,} tokens, width {result['width']}, vocabulary "
             f"{result['vocab']:,}, {result['dtype']}; median of {result['rounds']} rounds x {result['repeats']} steps",
             f"- fastest that keeps every promise: `{result.get('fastest_keeping_all')}`", "",
             "| loss | ms | spread of rounds (ms) | chunk | peak GB | loss value | keeps | status |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for r in result["rows"].values():
        status = r.get("status", "?") + (f": {r['reason']}" if r.get("reason") else "")
        keeps = ", ".join(r["keeps"]) or "none"
        ms = f"{r['ms']:.1f}" if "ms" in r else "-"
        spread = f"{r['spread_ms']:.1f}" if "spread_ms" in r else "-"
        peak = f"{r['peak_gb_above_inputs']:.2f}" if "peak_gb_above_inputs" in r else "-"
        loss = f"{r['loss']:.5f}" if "loss" in r else "-"
        lines.append(f"| `{r['impl']}` | {ms} | {spread} | {r.get('chunk_tokens', '-')} | {peak} | {loss} | {keeps} "
                     f"| {status} |")
    return lines


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line; ``--tiny`` sets a tiny size and one step of each (a smoke run: measures nothing)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.loss_bench", description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if there is one)")
    p.add_argument("--tokens", type=int, default=None, help=f"default {_GPU_SIZE['tokens']} (--tiny: {_TINY['tokens']})")
    p.add_argument("--width", type=int, default=None, help=f"default {_GPU_SIZE['width']}")
    p.add_argument("--vocab", type=int, default=None, help=f"default {_GPU_SIZE['vocab']}")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES),
                   help="the matmuls' dtype (autocast): default bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, from {','.join(IMPLS)}")
    p.add_argument("--rounds", type=int, default=None, help="rounds of timed steps, in a rotated order (default 3)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps of each per round (default 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first, compilation included (default 2)")
    p.add_argument("--tiny", action="store_true", help="a tiny size, one step each: checks the command, measures nothing")
    p.add_argument("--out", default=None, help="folder for loss-bench.json and loss-bench.md")
    args = p.parse_args(argv)
    args.argv = argv
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    scale = _TINY if args.tiny else {**_GPU_SIZE, "rounds": 3, "repeats": 5, "warmup": 2}
    for key, value in scale.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("tokens", "width", "vocab", "rounds", "repeats", "warmup"):
        if getattr(args, key) < 1:
            p.error(f"--{key} must be >= 1, got {getattr(args, key)}")
    args.dtype = _DTYPES[args.dtype or ("bfloat16" if torch.device(args.device).type == "cuda" else "float32")]
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    unknown = [i for i in args.impls if i not in IMPLS]
    if unknown or not args.impls:
        p.error(f"--impls has unknown names {unknown}: choose from {','.join(IMPLS)}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)

    def write(result: dict[str, Any]) -> None:
        if out is not None:
            (out / "loss-bench.json").write_text(json.dumps(result, indent=1) + "\n")
            (out / "loss-bench.md").write_text("\n".join(markdown_lines(result)) + "\n")

    result = run(args, write)
    print("\n".join(markdown_lines(result)))
    return 1 if any(r["status"] == "failed" for r in result["rows"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
