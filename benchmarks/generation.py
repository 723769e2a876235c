"""Generation of a prompt set of mixed lengths whose answers end early: one prompt at a time, today's
equal-length batches, continuous batching, and transformers' batched ``generate`` on the same weights, side by side
in one process on one device.

The same GPT (random weights: speed does not depend on them) answers the same rows (``--prompts``
prompts of ``--min-len`` to ``--max-len`` tokens, ``--samples`` samples each, sampled at
``--temperature`` among the ``--top-k`` most likely tokens) three ways:

================  ===================================================================================
``sequential``    one row at a time with a KV cache, each stopping at its end-of-text (a plain loop)
``grouped``       rows of equal prompt length in batches of ``--batch-size``, each batch run to
                  ``--new-tokens`` (no end-of-text stop): what ``gpuopt predict`` did before
``continuous``    every row in batches of ``--batch-size`` whatever its length (left-padded), each
                  row stopping at its end-of-text and its place refilled with the next row:
                  ``generate_batched``, what ``gpuopt predict --generate.prompts_file`` runs
``transformers``  the same weights written by ``save_hf`` and loaded by ``transformers``: its batched
                  ``generate``, rows in batches of ``--batch-size`` in their order, left-padded, each
                  batch run until its every row has ended (``eos_token_id``) or ``--new-tokens``; the
                  end-of-text bias added by a logits processor. Needs ``transformers``; not in the default
                  ``--configs``
================  ===================================================================================

Answers end early: the end-of-text logit is raised by a fixed amount (``_EndsEarly``) so that a row
samples it with a probability of about ``1 / --answer-len`` at each step, as a trained model ends a
short answer; a row that has not ended after ``--new-tokens`` tokens stops there. ``grouped`` computes
every row to ``--new-tokens`` and keeps each answer up to its end-of-text.

Example::

    nice python -m benchmarks.generation --threads 1                     # CPU, small model
    python -m benchmarks.generation --device cuda --dtype bf16 --n-layer 12 --n-embd 768 --n-head 12 \\
        --vocab-size 50304 --block-size 1024 --prompts 256 --samples 16 --max-len 256 --new-tokens 256 \\
        --answer-len 64 --batch-size 256

Reports the seconds for the whole set (median of ``--repeats`` timed runs, in alternating order, after
one warm-up run each), the answer tokens per second, the mean answer length, the speed-up over
``sequential`` and, with ``transformers`` run, the answer tokens per second against its; writes
``generation.json`` and ``generation.md`` to ``--out`` (default ``benchmark-results/<device-slug>/`` in the
current folder).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import tempfile
import time
from itertools import groupby
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor, nn

from benchmarks._report import check_out_folder, device_slug, write_text
from lightning_gpuopt.generation import KVCache
from lightning_gpuopt.model import GPT, GPTConfig
from lightning_gpuopt.generation.batched import Request, generate_batched
from lightning_gpuopt.generation.sampling import generate, sample_next
from lightning_gpuopt.model.hf import write_hf_folder

__all__ = ["CONFIGS", "main", "run_config"]

CONFIGS = ("sequential", "grouped", "continuous", "transformers")
DEFAULT_CONFIGS = ("sequential", "grouped", "continuous")
BASELINE = "sequential"


class _EndsEarly(nn.Module):
    """The GPT with its end-of-text logit raised by ``bias``, so that sampled answers end after a few tokens."""

    def __init__(self, gpt: GPT, eot: int, bias: float) -> None:
        super().__init__()
        self.gpt, self.config, self.eot, self.bias = gpt, gpt.config, eot, bias

    def forward(self, idx: Tensor, caches: Optional[list[KVCache]] = None, targets: Optional[Tensor] = None,
                input_pos: Optional[Tensor] = None, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        logits = self.gpt(idx, caches, input_pos=input_pos, key_padding_mask=key_padding_mask)
        logits[..., self.eot] += self.bias
        return logits


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _answer(tokens: list[int], eot: int) -> list[int]:
    return tokens[: tokens.index(eot)] if eot in tokens else tokens


def _sequential(model: _EndsEarly, rows: list[list[int]], new_tokens: int, sample: Any, device: torch.device) -> list[list[int]]:
    answers = []
    for ids in rows:
        caches = [KVCache(model.config.block_size) for _ in range(model.config.n_layer)]
        logits = model(torch.tensor([ids], device=device), caches)[:, -1, : model.config.vocab_size]
        out: list[int] = []
        while len(out) < new_tokens:
            token = sample(logits)
            if int(token) == model.eot:
                break
            out.append(int(token))
            logits = model(token.view(1, 1), caches)[:, -1, : model.config.vocab_size]
        answers.append(out)
    return answers


def _grouped(model: _EndsEarly, rows: list[list[int]], new_tokens: int, batch_size: int, temperature: float, top_k: int,
             generator: torch.Generator, device: torch.device) -> list[list[int]]:
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # rows of one prompt length share batches
    answers: dict[int, list[int]] = {}
    for _, same in groupby(order, key=lambda i: len(rows[i])):
        same = list(same)
        for start in range(0, len(same), batch_size):
            part = same[start : start + batch_size]
            idx = torch.tensor([rows[i] for i in part], device=device)
            out = generate(model, idx, new_tokens, temperature, top_k, generator=generator)[:, idx.size(1):].tolist()
            answers.update({i: _answer(o, model.eot) for i, o in zip(part, out)})
    return [answers[i] for i in range(len(rows))]


def hf_peer(model: _EndsEarly) -> nn.Module:
    """The same weights in ``transformers`` (written by ``write_hf_folder``, read by ``from_pretrained``), in eval mode,
    on the GPT's device and in its dtype."""
    from transformers import AutoModelForCausalLM

    param = next(model.gpt.parameters())
    with tempfile.TemporaryDirectory(prefix="generation-hf-") as tmp:
        folder = write_hf_folder(model.gpt, Path(tmp) / "model")
        peer = AutoModelForCausalLM.from_pretrained(folder, dtype=param.dtype)
    return peer.to(param.device).eval()


def _transformers(peer: nn.Module, model: _EndsEarly, rows: list[list[int]], new_tokens: int, batch_size: int,
                  temperature: float, top_k: int, device: torch.device) -> list[list[int]]:
    from transformers import LogitsProcessor, LogitsProcessorList

    class EotBias(LogitsProcessor):  # the end-of-text bias of _EndsEarly
        def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
            scores[:, model.eot] += model.bias
            return scores

    sampling = dict(do_sample=True, temperature=temperature, top_k=top_k) if temperature > 0 else dict(do_sample=False)
    answers = []
    for start in range(0, len(rows), batch_size):
        part = rows[start : start + batch_size]
        width = max(len(r) for r in part)
        idx = torch.tensor([[model.eot] * (width - len(r)) + r for r in part], device=device)  # (B, width), left-padded
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in part], device=device)
        out = peer.generate(idx, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=model.eot,
                            pad_token_id=model.eot, logits_processor=LogitsProcessorList([EotBias()]), **sampling)
        answers += [_answer(o, model.eot) for o in out[:, width:].tolist()]
    return answers


def run_config(name: str, model: _EndsEarly, rows: list[list[int]], new_tokens: int, batch_size: int, temperature: float,
               top_k: int, dtype: Optional[torch.dtype], seed: int = 0, peer: Optional[nn.Module] = None
               ) -> tuple[float, list[list[int]]]:
    """Seconds to answer every row in configuration ``name``, and the answers (token ids up to their end-of-text);
    ``transformers`` runs ``peer`` (:func:`hf_peer`).

    Example::

        seconds, answers = run_config("continuous", model, rows, 64, 64, 0.7, 50, None)
    """
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()

    def sample(logits: Tensor) -> Tensor:
        return sample_next(logits, temperature, top_k, generator)

    _sync(device)
    start = time.perf_counter()
    with torch.no_grad(), autocast:
        if name == "sequential":
            answers = _sequential(model, rows, new_tokens, sample, device)
        elif name == "grouped":
            answers = _grouped(model, rows, new_tokens, batch_size, temperature, top_k, generator, device)
        elif name == "transformers":  # it samples from the global generator: seeded, and put back after
            with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
                torch.manual_seed(seed)
                answers = _transformers(peer, model, rows, new_tokens, batch_size, temperature, top_k, device)
        else:
            requests = [Request(ids, new_tokens, key=i) for i, ids in enumerate(rows)]
            done = {d.key: d.tokens for d in generate_batched(model, requests, batch_size, temperature, top_k, eot_id=model.eot,
                                                              generator=generator)}
            answers = [done[i] for i in range(len(rows))]
    _sync(device)
    return time.perf_counter() - start, answers


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


def _machine_line(m: dict[str, Any], end: Optional[float]) -> str:
    load = "" if m["load_average_1min"] is None else f", load average {m['load_average_1min']:.1f} at the start"
    load += "" if end is None else f" and {end:.1f} at the end"
    return f"Measured on {m['cpu']}, {m['cores']} cores{load}."


def _table(rows: list[dict[str, Any]]) -> str:
    peer = any(r.get("vs_transformers") for r in rows)
    lines = ["| configuration | batch | seconds | answer tokens/s | mean answer | speed-up vs `sequential` |"
             + (" vs `transformers` |" if peer else ""), "|---|---:|---:|---:|---:|---:|" + ("---:|" if peer else "")]
    for r in rows:
        lines.append(f"| `{r['config']}` | {r['batch']} | {r['seconds']:.2f} | {r['answer_tokens_per_sec']:,.0f} | "
                     f"{r['mean_answer_tokens']:.1f} | {r['speedup']:.2f}x |"
                     + (f" {r['vs_transformers']:.2f}x |" if peer else ""))
    return "\n".join(lines)


def _workload(args: argparse.Namespace, device: torch.device) -> tuple[_EndsEarly, list[list[int]], float]:
    torch.manual_seed(0)
    config = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab_size=args.vocab_size,
                       block_size=args.block_size)
    gpt = GPT(config).to(device).eval()
    if args.dtype == "bf16-weights":
        gpt = gpt.to(torch.bfloat16)
    # P(end-of-text) ~ 1/answer_len among top_k near-equal logits: exp(bias / T) = p (k - 1) / (1 - p)
    p = 1.0 / args.answer_len
    bias = args.temperature * math.log(p * (args.top_k - 1) / (1 - p))
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.prompts,), generator=g).tolist()
    prompts = [torch.randint(0, args.vocab_size - 1, (n,), generator=g).tolist() for n in lengths]
    rows = [p_ for p_ in prompts for _ in range(args.samples)]
    model = _EndsEarly(gpt, args.vocab_size - 1, bias)
    return model, rows, bias


def _arguments(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "bf16-weights"],
                   help="fp32; bf16 autocast; or bf16 weights (as --trainer.precision bf16-true)")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--prompts", type=int, default=64, help="number of prompts")
    p.add_argument("--samples", type=int, default=8, help="samples (rows) per prompt")
    p.add_argument("--min-len", type=int, default=4, help="tokens of the shortest prompt")
    p.add_argument("--max-len", type=int, default=48, help="tokens of the longest prompt")
    p.add_argument("--new-tokens", type=int, default=48, help="most tokens per answer")
    p.add_argument("--answer-len", type=float, default=12.0, help="mean answer length the end-of-text bias aims at")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=64, help="rows per batch in grouped and continuous")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (the median is reported)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's); 1 on a machine whose cores other jobs share, where threads "
                        "that wait for each other slow every step many times over")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help="comma-separated subset of " + ", ".join(CONFIGS))
    p.add_argument("--out", default=None, help="output folder (default: benchmark-results/<device-slug> in the current folder)")
    args = p.parse_args(argv)
    args.names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = sorted(set(args.names) - set(CONFIGS))
    if unknown:
        p.error(f"unknown --configs {unknown}: choose from {list(CONFIGS)}")
    if args.max_len + args.new_tokens > args.block_size:
        p.error(f"--max-len + --new-tokens ({args.max_len + args.new_tokens}) must fit in --block-size ({args.block_size}).")
    if not 1 <= args.min_len <= args.max_len:
        p.error(f"--min-len must be between 1 and --max-len, got {args.min_len} and {args.max_len}.")
    return args


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = _arguments(argv)
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        return _measure(args)
    finally:
        torch.set_num_threads(threads)


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    model, rows, bias = _workload(args, device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else None
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    out = Path(args.out) if args.out else Path("benchmark-results") / device_slug(device_name)
    check_out_folder(out)  # before the runs, not at the write after them

    peer = hf_peer(model) if "transformers" in args.names else None

    def run(name: str) -> tuple[float, list[list[int]]]:
        return run_config(name, model, rows, args.new_tokens, args.batch_size, args.temperature, args.top_k, dtype,
                          peer=peer)

    measured_on = machine()
    for name in args.names:
        run(name)  # warm-up: allocator, kernels, autocast caches
    times: dict[str, list[float]] = {name: [] for name in args.names}
    lengths: dict[str, list[float]] = {name: [] for name in args.names}
    for repeat in range(args.repeats):  # alternating order: a load change on the machine hits every configuration
        for name in args.names if repeat % 2 == 0 else args.names[::-1]:
            seconds, answers = run(name)
            times[name].append(seconds)
            lengths[name].append(sum(len(a) for a in answers) / len(answers))
            print(f"repeat {repeat + 1}: {name:11s} {seconds:8.2f} s, mean answer {lengths[name][-1]:.1f} tokens", flush=True)
    results = []
    for name in args.names:
        seconds, mean = statistics.median(times[name]), statistics.mean(lengths[name])
        results.append({"config": name, "batch": 1 if name == "sequential" else args.batch_size, "seconds": seconds,
                        "seconds_all": times[name], "mean_answer_tokens": mean,
                        "answer_tokens_per_sec": mean * len(rows) / seconds})
    base = next((r["seconds"] for r in results if r["config"] == BASELINE), None)
    # Against transformers in answer tokens/s: its rows sample their own lengths (its own random stream)
    peer = next((r["answer_tokens_per_sec"] for r in results if r["config"] == "transformers"), None)
    for r in results:
        r["speedup"] = base / r["seconds"] if base else float("nan")
        r["vs_transformers"] = r["answer_tokens_per_sec"] / peer if peer else None  # > 1: faster than its generate
    end_load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    report = {"device": device_name, "machine": {**measured_on, "load_average_1min_end": end_load}, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "dtype": args.dtype,
              "model": {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "vocab_size": args.vocab_size,
                        "block_size": args.block_size, "params": model.gpt.num_params()},
              "rows": len(rows), "prompts": args.prompts, "samples": args.samples, "prompt_len": [args.min_len, args.max_len],
              "new_tokens": args.new_tokens, "answer_len": args.answer_len, "eot_bias": bias, "temperature": args.temperature,
              "top_k": args.top_k, "repeats": args.repeats, "results": results}
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "generation.json", json.dumps(report, indent=2) + "\n")
    table = _table(results)
    write_text(out / "generation.md", f"# Generation on {device_name}\n\n{_machine_line(measured_on, end_load)}\n\n{table}\n")
    print(table)
    return report


if __name__ == "__main__":
    main()
