"""Training throughput of GPT configurations side by side: plain Lightning, Lightning bf16, ours, plain PyTorch.

Runs every configuration (see ``benchmarks/_configs.py``) in one process on one device, on the
same model, sequence length and tokens, ``--repeats`` times in alternating order so drift of the
machine shows as spread between repeats. Writes a JSON file, a Markdown table and a PNG bar chart
to ``--out`` (default ``benchmark-results/<device-slug>/`` in the current folder) and prints the table.

    python -m benchmarks.throughput --preset 124m --repeats 2
    python -m benchmarks.throughput --preset tiny --block-size 64 --steps 5 --warmup-steps 2 \
        --configs baseline,gpuopt-bf16 --no-plot          # a CPU smoke run

The exit status is 1 when a configuration failed (it is still reported), 0 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import logging
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, get_args

import torch

from benchmarks._configs import AUTO_BF16, CONFIGS, DEFAULT_CONFIGS, TORCH_LOOP, VARIANTS, BenchSettings, skip_reason
from benchmarks._report import check_out_folder, check_targets, device_slug, markdown, plot, summarise, write_json, write_text
from benchmarks._runners import make_data, run_config
from lightning_gpuopt.model import PRESETS, GPTModule
from lightning_gpuopt.model.module import CompileMode
from lightning_gpuopt.perf.peaks import measure_peak_flops, peak_flops

__all__ = ["main", "parse_args"]

log = logging.getLogger("benchmarks.throughput")

ROOT = Path(__file__).resolve().parents[1]
# WikiText-2 (validation and test splits) beside the project, or inside it on machines that carry shared/ along.
WIKITEXT2_PLACES = (ROOT.parent / "shared" / "data" / "wikitext-2", ROOT / "shared" / "data" / "wikitext-2")
GPT2_VOCAB = 50257


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _resolve_data(data: str) -> str:
    """``auto``: the WikiText-2 text files beside the project if present, else the offline default corpus."""
    if data != "auto":
        return data
    for folder in WIKITEXT2_PLACES:
        if folder.is_dir() and any(folder.glob("*.txt")):
            return str(folder / "*.txt")
    log.warning("--data auto: no WikiText-2 at %s, using the offline default corpus (stdlib)", WIKITEXT2_PLACES[0])
    return "stdlib"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line (``--help`` lists every option)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="124m", choices=sorted(PRESETS), help="model size")
    p.add_argument("--block-size", type=int, default=None, help="sequence length (default: 1024; tiny: 128)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"model vocabulary (default: GPT-2's {GPT2_VOCAB}; tiny: --tokenizer-vocab-size)")
    p.add_argument("--tokenizer-vocab-size", type=int, default=4096, help="BPE vocabulary trained on --data")
    p.add_argument("--data", default="auto",
                   help="text: a file, folder, glob or 'stdlib'; 'auto' = a local WikiText-2 copy where one is found "
                   "(benchmarks/README.md), else stdlib")
    p.add_argument("--cache-dir", default=None, help="token cache (default: $GPUOPT_CACHE_DIR or ~/.cache/lightning_gpuopt)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated, from: {','.join(CONFIGS)} (default: all but {','.join(VARIANTS)})")
    p.add_argument("--micro-batch-size", type=int, default=8,
                   help="micro-batch of the fixed-batch configurations (they accumulate to --global-batch-size)")
    p.add_argument("--global-batch-size", type=int, default=64,
                   help="sequences per optimizer step of every configuration (accumulation, or AutoBatchSize's)")
    p.add_argument("--max-micro-batch-size", type=int, default=None,
                   help="largest micro-batch AutoBatchSize tries (needed on CPU)")
    p.add_argument("--steps", type=int, default=20, help="measured optimizer steps per configuration and repeat")
    p.add_argument("--warmup-steps", type=int, default=5, help="unmeasured optimizer steps first (compilation)")
    p.add_argument("--repeats", type=int, default=1, help="run the whole list this often, alternating the order")
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader workers")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--fp8-recipe", default="tensorwise", choices=["tensorwise", "rowwise", "rowwise_with_gw_hp"])
    p.add_argument("--fp8-emulate", action="store_true", help="run the FP8 configuration emulated (CPU / GPUs below SM 8.9)")
    p.add_argument("--compile-mode", default=None, choices=list(get_args(CompileMode)),
                   help="torch.compile mode (default: torch's default)")
    p.add_argument("--no-measure-peak", action="store_true", help="skip the bf16 matmul ceiling (GPU)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG chart")
    p.add_argument("--out", default=None, help="output folder (default: benchmark-results/<device-slug> in the current folder)")
    p.add_argument("--tag", default=None, help="appended to the file names, for runs split over several commands")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after the measured steps, profile this many more with torch.profiler: device time per "
                   "kernel category, idle time and the longest kernels, in the results (0: off)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds: start no configuration after this much time has passed; the rest are reported "
                   "as skipped (for machines that stop a command after a fixed time)")
    return p.parse_args(argv)


def _settings(args: argparse.Namespace) -> BenchSettings:
    preset = PRESETS[args.preset]
    gpt2 = not args.preset.endswith("tiny")  # the tiny presets keep their own context; the others get GPT-2's
    return BenchSettings(
        preset=args.preset,
        block_size=args.block_size or (1024 if gpt2 else preset["block_size"]),
        vocab_size=args.vocab_size or (GPT2_VOCAB if gpt2 else args.tokenizer_vocab_size),
        data=_resolve_data(args.data),
        tokenizer_vocab_size=args.tokenizer_vocab_size,
        cache_dir=args.cache_dir,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        max_micro_batch_size=args.max_micro_batch_size,
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        num_workers=args.num_workers,
        seed=args.seed,
        fp8_recipe=args.fp8_recipe,
        fp8_emulate=args.fp8_emulate,
        compile_mode=args.compile_mode,
        profile_steps=args.profile_steps,
    )


def _environment(device: torch.device, argv: list[str]) -> dict[str, Any]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = torch.cuda.get_device_name(device)
        detail = f"SM {props.major}.{props.minor}, {props.total_memory / 1024**3:.0f} GiB"
    else:
        name, detail = "cpu", f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    return {
        "device": name,
        "device_detail": detail,
        "torch": torch.__version__,
        "lightning": _version("lightning"),
        "torchao": _version("torchao"),
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "git_commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "benchmarks.throughput", *argv]),
    }


def _peaks(device: torch.device, measure: bool) -> tuple[dict[str, Optional[float]], Optional[str]]:
    if device.type != "cuda":
        return {"bf16": None, "fp8": None, "measured": None}, "no datasheet peak FLOP/s for a CPU"
    name = torch.cuda.get_device_name(device)
    peaks = {"bf16": peak_flops(name, "bf16"), "fp8": peak_flops(name, "fp8"), "measured": None}
    if measure:
        log.info("timing a bf16 matmul for the measured ceiling ...")
        peaks["measured"] = measure_peak_flops(device, torch.bfloat16)
    note = None if peaks["bf16"] else f"{name} is not in lightning_gpuopt.perf.peaks.GPU_PEAKS"
    return peaks, note


def _vocabulary(config: Any, settings: BenchSettings, flops_per_token: float) -> dict[str, Any]:
    """The model's vocabulary (padded), the one asked for and the tokenizer's, and the output head's share of the
    training FLOPs (6 x V x C per token): what a reader needs to compare MFU with another benchmark's."""
    head = 6 * config.padded_vocab_size * config.n_embd
    return {"model": config.padded_vocab_size, "asked": settings.vocab_size, "tokenizer": settings.tokenizer_vocab_size,
            "head_flops_share": head / flops_per_token}


def _run_order(names: list[str], repeat: int) -> list[str]:
    return names if repeat % 2 == 0 else names[::-1]


def main(argv: Optional[list[str]] = None) -> int:
    """Run the benchmark; return the exit status (1 if a configuration failed).

    Args:
        argv: Command-line arguments (default ``sys.argv[1:]``).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise ValueError(f"--configs has unknown names {unknown}: choose from {','.join(CONFIGS)}.")
    if args.tag is not None and not args.tag.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"--tag must be letters, digits, '-' or '_' (it goes into file names), got {args.tag!r}.")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}.")
    if args.time_budget is not None and not args.time_budget > 0:
        raise ValueError(f"--time-budget must be a positive number of seconds, got {args.time_budget}.")
    began = time.perf_counter()
    settings = _settings(args)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    env = _environment(device, argv)
    out = Path(args.out) if args.out else Path("benchmark-results") / device_slug(env["device"])
    stem = f"throughput-{settings.preset}-T{settings.block_size}" + (f"-{args.tag}" if args.tag else "")
    check_out_folder(out)  # before the data and the runs, not at the first write after them
    if not args.no_plot:  # fail now, not after the runs, if the chart cannot be drawn
        try:
            import matplotlib  # noqa: F401
        except ImportError as err:
            raise ImportError(
                f"matplotlib is missing ({err}): pip install \"lightning-gpuopt[bench]\", or pass --no-plot."
            ) from err

    log.info("tokenising %s (once, cached) ...", settings.data)
    data = make_data(settings, settings.micro_batch_size)
    data.prepare_data()
    data.setup("fit")  # a corpus too short for the block size fails here, before any configuration runs
    del data
    peaks, mfu_note = _peaks(device, not args.no_measure_peak)
    model_facts = GPTModule(preset=settings.preset, vocab_size=settings.vocab_size, block_size=settings.block_size)
    flops_per_token = float(model_facts.flops_per_token(settings.block_size))
    vocabulary = _vocabulary(model_facts.config, settings, flops_per_token)

    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}

    def report(complete: bool) -> dict[str, Any]:
        done = {n: r for n, r in runs.items() if r}
        summary = summarise(done, flops_per_token, peaks, mfu_note)
        return {
            "environment": env,
            "settings": {**asdict(settings), "repeats": args.repeats, "configs": names},
            # False while the runs go on: the files are rewritten after every configuration, so a
            # command stopped from outside still leaves the results of the configurations that finished.
            "complete": complete,
            "flops_per_token": flops_per_token,
            "vocabulary": vocabulary,
            "peaks": peaks,
            "mfu_note": mfu_note,
            "summary": summary,
            "targets": check_targets(summary, settings.preset),
            "notes": [],  # findings of a profile where a target is missed, added by whoever ran it
            "runs": done,
        }

    auto_batch: Optional[tuple[int, int]] = None  # (micro-batch, accumulation) AutoBatchSize chose
    for repeat in range(args.repeats):
        for name in _run_order(names, repeat):
            reason = skip_reason(name, settings, device)
            spent = time.perf_counter() - began
            if reason is None and args.time_budget is not None and spent > args.time_budget:
                reason = f"--time-budget={args.time_budget:g} s was spent ({spent:.0f} s) before it could start"
            if reason is not None:
                log.warning("%s skipped: %s", name, reason)
                runs[name].append({"status": "skipped", "reason": reason, "repeat": repeat})
                continue
            fixed = (settings.micro_batch_size, settings.global_batch_size // settings.micro_batch_size)
            batch = (auto_batch or fixed) if name == TORCH_LOOP else fixed
            log.info("repeat %d: %s ...", repeat, name)
            result = run_config(name, settings, device, batch)
            result["repeat"] = repeat
            if name == TORCH_LOOP:
                start = f"{batch[0]} x {batch[1]}"
                result["compare_with"] = (
                    f"started from the micro-batch x accumulation {AUTO_BF16} chose ({start}): compare with it"
                    if auto_batch else f"{AUTO_BF16} did not run first, so it started from the fixed {start}: "
                    "compare with gpuopt-bf16-compile"
                )
                if result.get("micro_batch_tried"):
                    result["compare_with"] += (f"; micro-batch {', '.join(map(str, result['micro_batch_tried']))} "
                                               "ran out of memory (full logits)")
                if result.get("settings_by_hand"):
                    result["compare_with"] += f"; set by hand: {result['settings_by_hand']}"
            if name == AUTO_BF16 and result["status"] == "ok":
                auto_batch = (result["micro_batch_size"], result["accumulate_grad_batches"])
            if result["status"] == "failed":
                log.error("%s failed: %s\n%s", name, result["reason"], result["traceback"])
            else:
                log.info("%s: %.0f tokens/s", name, result["tokens_per_s"])
            runs[name].append(result)
            _write(out / stem, report(complete=False))

    final = report(complete=True)
    text = _write(out / stem, final)
    if args.no_plot:
        log.info("--no-plot: no PNG written")
    else:
        plot(out / f"{stem}.png", final)
    print(text)
    log.info("results in %s", out / stem)
    return 1 if any(e["status"] == "failed" for e in final["summary"].values()) else 0


def _write(stem: Path, report: dict[str, Any]) -> str:
    """Write ``<stem>.json`` and ``<stem>.md``; return the Markdown."""
    write_json(stem.with_name(stem.name + ".json"), report)
    text = markdown(report)
    write_text(stem.with_name(stem.name + ".md"), text)
    return text


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    sys.exit(main())
