"""Data preparation speed and memory: BPE training and encoding, MB/s and peak RSS, on 1..N cores.

Each measurement runs in a fresh process pinned to the first N cores (``sched_setaffinity``) with
``RAYON_NUM_THREADS=N`` (the ``tokenizers`` thread pool), and reports, for

- ``train``: ``train_bpe_tokenizer`` over the corpus's streamed pieces (what ``TextDataModule`` runs);
- ``encode``: the token-file writer of :mod:`lightning_gpuopt.data.prepare` with that tokenizer;

the wall time, MB/s (MB = 10^6 bytes of text), MB/s per core, the CPU seconds of the calling
(Python) thread and of the other threads (the ``tokenizers`` Rayon workers), and the peak resident
memory of the process during that phase (``VmHWM``, reset between phases) and before it (after the
imports). The CPU split gives a load-independent estimate for ``C`` cores (Amdahl): the calling
thread's work is serial, the workers' work divides by ``C``. The workers' work (word counting,
encoding) grows with the text; the calling thread's (mostly BPE's merge loop) depends on the
vocabulary and the number of distinct words, and measured the same on 3.5 and 14 MB here, so
``t(C) = cpu_main + cpu_workers / C * size / measured size``. It is given for WikiText-103 (540 MB)
and 10 GB on 16 cores, from the run with the most cores; a corpus with many more distinct words
than the measured one has a longer merge loop. On a machine shared with other work, wall-clock
scaling from 1 to N cores understates the speed-up; the CPU split does not.

    PYTHONPATH=. python -m benchmarks.data_prep --size-mb 50 --vocab-size 32768 --cores 1,2
    PYTHONPATH=. python -m benchmarks.data_prep --corpus data/wikitext-103-raw/wiki.train.raw --cores 1,16

Without ``--corpus`` a single-file corpus of ``--size-mb`` MB is generated (WikiText-like lines of
Zipf-distributed made-up words, seeded) in a temporary folder. Results go to
``--out`` (default ``benchmark-results/data_prep.json`` in the current folder) and a Markdown table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_MB = 1e6  # decimal megabytes for throughput, as in "MB/s"
_GIB = 2**30


def make_corpus(path: Path, size_mb: float, seed: int = 0) -> Path:
    """Write a single-file, WikiText-like corpus of about ``size_mb`` MB (one document, many lines).

    Lines of 120 words drawn from 50,000 made-up words with Zipf frequencies, a `` , `` or `` . ``
    between clauses, and a `` = Heading = `` every 20 lines.
    """
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    words = np.array(["".join(rng.choice(letters, size=int(n))) for n in rng.integers(2, 11, size=50_000)])
    p = 1.0 / np.arange(1, len(words) + 1)
    p /= p.sum()
    target, written, line_no = int(size_mb * _MB), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            block = words[rng.choice(len(words), size=(1000, 120), p=p)].astype(object)
            block[:, 11::12] = block[:, 11::12] + rng.choice([" ,", " ."], size=(1000, 10)).astype(object)
            lines = []
            for row in block:
                line_no += 1
                if line_no % 20 == 0:
                    lines.append(f" \n = {row[0].title()} = \n \n")
                lines.append(" " + " ".join(row) + " \n")
            text = "".join(lines)
            f.write(text)
            written += len(text.encode())
    return path


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _thread_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of each thread of this process."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _phase(result: dict, name: str, start_cpu: dict[int, float], start: float) -> None:
    end_cpu = _thread_cpu()
    main = os.getpid()
    result[name] = {
        "s": time.perf_counter() - start,
        "cpu_main_s": end_cpu.get(main, 0.0) - start_cpu.get(main, 0.0),
        "cpu_workers_s": sum(v - start_cpu.get(t, 0.0) for t, v in end_cpu.items() if t != main),
        "peak_rss_gib": _rss("VmHWM") / _GIB,
    }


def _reset_peak() -> None:
    try:  # Linux >= 4.0: writing 5 resets VmHWM to the current RSS
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _child(corpus: Path, vocab_size: int, out: Path) -> dict:
    """One measurement, in this (pinned) process."""
    from lightning_gpuopt.data.prepare import encode_documents
    from lightning_gpuopt.data.sources import resolve_source
    from lightning_gpuopt.data.tokenizer import EOT_TOKEN, train_bpe_tokenizer
    from lightning_gpuopt.data.tokens import token_dtype, write_tokens

    source = resolve_source(str(corpus))
    mb = corpus.stat().st_size / _MB
    result = {"rss_after_imports_gib": _rss("VmRSS") / _GIB}
    _reset_peak()
    cpu, t = _thread_cpu(), time.perf_counter()
    pieces = (piece for doc in source.splits["train"]() for piece in doc)
    tokenizer = train_bpe_tokenizer(pieces, vocab_size)
    _phase(result, "train", cpu, t)
    _reset_peak()
    cpu, t = _thread_cpu(), time.perf_counter()
    eot = tokenizer.token_to_id(EOT_TOKEN)
    dtype = token_dtype(tokenizer.get_vocab_size())
    tokens = write_tokens(out / "train.bin", encode_documents(tokenizer, source.splits["train"](), eot), dtype)
    _phase(result, "encode", cpu, t)
    result["encode"]["tokens"] = tokens
    for phase in ("train", "encode"):
        result[phase]["mb_per_s"] = mb / result[phase]["s"]
    return result


def _run(corpus: Path, vocab_size: int, cores: int) -> dict:
    available = sorted(os.sched_getaffinity(0))
    if cores > len(available):
        raise SystemExit(f"--cores asks for {cores} cores but this process may use {len(available)}.")
    env = {**os.environ, "RAYON_NUM_THREADS": str(cores), "TOKENIZERS_PARALLELISM": "true"}
    with tempfile.TemporaryDirectory() as tmp:
        code = (
            "import json, os, sys; from pathlib import Path; from benchmarks.data_prep import _child; "
            f"os.sched_setaffinity(0, {available[:cores]!r}); "
            f"print('RESULT', json.dumps(_child(Path({str(corpus)!r}), {vocab_size}, Path({tmp!r}))))"
        )
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"measurement on {cores} cores failed:\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return {"cores": cores, **json.loads(line[len("RESULT "):])}


def _estimate(run: dict, phase: str, measured_mb: float, size_mb: float, cores: int = 16) -> float:
    """Seconds for ``size_mb`` on ``cores`` cores: the calling thread's CPU + the workers' CPU / cores, scaled by size."""
    m = run[phase]
    return m["cpu_main_s"] + m["cpu_workers_s"] / cores * size_mb / measured_mb


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", type=Path, help="a text file (default: generate one of --size-mb MB)")
    p.add_argument("--size-mb", type=float, default=50.0)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--cores", default="1,2", help="comma-separated core counts")
    p.add_argument("--out", type=Path, default=Path("benchmark-results/data_prep.json"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = args.corpus or make_corpus(Path(tmp) / "corpus.txt", args.size_mb)
        size_mb = corpus.stat().st_size / _MB
        runs = [_run(corpus, args.vocab_size, int(c)) for c in args.cores.split(",")]
    report = {"corpus": str(args.corpus or "generated, single file"), "corpus_mb": size_mb,
              "vocab_size": args.vocab_size, "load_average_1min": os.getloadavg()[0], "runs": runs}
    lines = [f"corpus: {report['corpus']}, {size_mb:.1f} MB, vocab {args.vocab_size}", "",
             "| cores | phase | wall s | MB/s | MB/s per core | CPU s: calling thread + workers | peak RSS GiB (after imports) |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        for phase in ("train", "encode"):
            m = r[phase]
            lines.append(f"| {r['cores']} | {phase} | {m['s']:.1f} | {m['mb_per_s']:.2f} | {m['mb_per_s'] / r['cores']:.2f} "
                         f"| {m['cpu_main_s']:.1f} + {m['cpu_workers_s']:.1f} | {m['peak_rss_gib']:.2f} ({r['rss_after_imports_gib']:.2f}) |")
    top = max(runs, key=lambda r: r["cores"])
    report["estimates_16_cores_s"] = {
        name: {phase: _estimate(top, phase, size_mb, mb) for phase in ("train", "encode")}
        for name, mb in (("wikitext-103", 540.0), ("10GB", 10_000.0))
    }
    lines.append("")
    for name, est in report["estimates_16_cores_s"].items():
        lines.append(f"estimate on 16 cores (from the {top['cores']}-core run's CPU split), {name}: "
                     f"train {est['train'] / 60:.1f} min + encode {est['encode'] / 60:.1f} min")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print("\n".join(lines))
    return report


if __name__ == "__main__":
    main()
