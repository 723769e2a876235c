"""The loss-curve cost of a bf16 residual stream: the same model, seed and data order trained twice under bf16
autocast, once with the residual stream in float32 and once in bfloat16 (``GPTModule(residual_dtype=...)``).

Both runs go through ``benchmarks._runners.run_lightning`` (the throughput benchmark's runner): on a GPU the
``gpuopt-bf16-compile`` configuration (``BF16Precision``, per-block compile), on a CPU Lightning's
``bf16-mixed`` (as the CPU tests train bf16), uncompiled. A callback records the mean loss of every optimizer
step. The result: both curves, the mean of each over the last 10% of steps (the final window) and their
difference (bf16 minus float32: positive means the bf16 residual stream trains worse), and each run's tokens/s
over its steps after the warm-up. One run of each is a single sample: a difference within the noise of the
curves says nothing either way.

Example::

    python -m benchmarks.residual_curve --out results/ --data 'shared/data/wikitext-2/*.txt'  # 124m, 300 steps
    python -m benchmarks.residual_curve --out /tmp/curve --tiny                              # a smoke run: tiny
"""

from __future__ import annotations

import argparse
import math
import platform
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from benchmarks._configs import BenchSettings
from benchmarks._report import check_out_folder, write_json, write_text
from benchmarks._runners import cleanup, run_lightning

__all__ = ["LossCurve", "RESIDUALS", "final_window", "main", "markdown_lines", "parse_args", "run"]

RESIDUALS = ("float32", "bfloat16")
WINDOW = 0.1  # the final window: the last 10% of the steps (at least one)
_GPT2_VOCAB = 50257
# The GPU's scale: 124m at T 1024, micro-batch 64 (as the compile-residual part), the global batch of 64 sequences.
_GPU = dict(preset="124m", block_size=1024, vocab_size=_GPT2_VOCAB, tokenizer_vocab_size=4096, micro_batch_size=64,
            global_batch_size=64, steps=300, warmup_steps=10, num_workers=2)
# The smoke run's: the tiny preset at the headline's tiny scale.
_TINY = dict(preset="tiny", block_size=32, vocab_size=384, tokenizer_vocab_size=384, micro_batch_size=8,
             global_batch_size=16, steps=6, warmup_steps=1, num_workers=0)


class LossCurve(Callback):
    """The mean training loss of every optimizer step (its micro-batches averaged)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self._sum, self._count = 0.0, 0
        self._last_step: Optional[int] = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Lightning hands the loss divided by the accumulation: undone, so a step's value is its batches' mean.
        self._sum += float(outputs["loss"]) * trainer.accumulate_grad_batches
        self._count += 1
        if trainer.global_step != self._last_step:  # this batch ended an optimizer step
            self._last_step = trainer.global_step
            self.losses.append(self._sum / self._count)
            self._sum, self._count = 0.0, 0


def final_window(losses: list[float]) -> float:
    """The mean of the last ``WINDOW`` share of ``losses`` (at least the last one)."""
    n = max(1, math.ceil(len(losses) * WINDOW))
    return sum(losses[-n:]) / n


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line (``--help`` lists every option)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.residual_curve", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder: residual-curve.json and residual-curve.md")
    p.add_argument("--tiny", action="store_true",
                   help="the tiny preset, a few steps, on the CPU: checks the path, measures nothing")
    p.add_argument("--data", default=None,
                   help="text: a file, folder, glob or 'stdlib' (default: 'auto' = a local WikiText-2 copy where one "
                   "is found, else stdlib; --tiny: stdlib)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps of each run, warm-up included "
                   f"(default: {_GPU['steps']}; --tiny: {_TINY['steps']})")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help=f"sequences per micro-batch (default: {_GPU['micro_batch_size']}; --tiny: "
                   f"{_TINY['micro_batch_size']}); they accumulate to the global batch")
    p.add_argument("--cache-dir", default=None,
                   help="token cache (default: $GPUOPT_CACHE_DIR or ~/.cache/lightning_gpuopt)")
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args(argv)


def _settings(args: argparse.Namespace) -> BenchSettings:
    from benchmarks.throughput import _resolve_data

    scale = dict(_TINY if args.tiny else _GPU)
    total = scale["steps"] if args.steps is None else args.steps
    warmup = scale.pop("warmup_steps")
    if isinstance(total, bool) or not isinstance(total, int) or total <= warmup:
        raise ValueError(f"--steps must be an integer above the {warmup} warm-up steps, got {total!r}.")
    scale["steps"] = total - warmup
    if args.micro_batch_size is not None:
        scale["micro_batch_size"] = args.micro_batch_size
    data = _resolve_data(args.data or ("stdlib" if args.tiny else "auto"))
    return BenchSettings(**scale, warmup_steps=warmup, data=data, cache_dir=args.cache_dir, seed=args.seed)


def run(settings: BenchSettings, device: torch.device) -> dict[str, Any]:
    """Train both residual dtypes from the same seed and data order; their curves, final windows and tokens/s."""
    config = "gpuopt-bf16-compile" if device.type == "cuda" else "lightning-bf16"
    accumulate = settings.global_batch_size // settings.micro_batch_size
    runs: dict[str, Any] = {}
    for residual in RESIDUALS:
        curve = LossCurve()
        result = run_lightning(config, settings, device, accumulate=accumulate, callbacks=(curve,),
                               residual_dtype=residual)
        cleanup(device)
        runs[residual] = {"losses": curve.losses, "final_loss": final_window(curve.losses),
                          "tokens_per_s": result["tokens_per_s"], "warmup_s": result["warmup_s"],
                          "first_batch_token_sum": result["first_batch_token_sum"], "first_loss": result["first_loss"],
                          "peak_memory_gb": result["peak_memory_gb"]}
    f32, b16 = runs["float32"], runs["bfloat16"]
    return {
        "configuration": config,
        "steps": settings.warmup_steps + settings.steps,
        "window_steps": max(1, math.ceil(len(f32["losses"]) * WINDOW)),
        "runs": runs,
        "final_loss_difference": b16["final_loss"] - f32["final_loss"],
        "tokens_per_s_ratio": b16["tokens_per_s"] / f32["tokens_per_s"],
        "same_first_batch": f32["first_batch_token_sum"] == b16["first_batch_token_sum"],
    }


def markdown_lines(report: dict[str, Any]) -> list[str]:
    """The report's table: final-window loss and tokens/s of each residual dtype, and the difference."""
    r = report["result"]
    lines = [f"### bf16 residual stream: loss curve ({report['settings']['preset']}, {r['steps']} steps, "
             f"{report['environment']['device']}, {r['configuration']})", "",
             f"| residual stream | loss, last {r['window_steps']} steps | tokens/s |", "|---|---:|---:|"]
    for residual in RESIDUALS:
        run_ = r["runs"][residual]
        lines.append(f"| {residual} | {run_['final_loss']:.4f} | {run_['tokens_per_s']:,.0f} |")
    lines += ["", f"bf16 - float32: loss {r['final_loss_difference']:+.4f}, tokens/s x{r['tokens_per_s_ratio']:.3f} "
              "(one run each: a single sample)"]
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    """Run both trainings and write ``residual-curve.json`` and ``residual-curve.md`` under ``--out``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    out = Path(args.out)
    check_out_folder(out)
    settings = _settings(args)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    report = {
        "environment": {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        "torch": torch.__version__, "python": platform.python_version(),
                        "command": shlex.join(["python", "-m", "benchmarks.residual_curve", *argv])},
        "settings": {k: getattr(settings, k) for k in ("preset", "block_size", "vocab_size", "data",
                                                        "micro_batch_size", "global_batch_size", "warmup_steps",
                                                        "learning_rate", "seed")},
        "result": run(settings, device),
    }
    write_json(out / "residual-curve.json", report)
    text = "\n".join(markdown_lines(report)) + "\n"
    write_text(out / "residual-curve.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
