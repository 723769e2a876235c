"""Plot a run's loss and tokens/s from its ``metrics.csv`` files (Lightning's ``CSVLogger``).

Example::

    python -m benchmarks.plot_run runs/quickstart                       # every version_N under it, in order
    python -m benchmarks.plot_run runs/quickstart/lightning_logs/version_0 --out quickstart.png

A run continued with ``--ckpt_path last`` logs each part into a new ``version_N``: the plot joins them in
order, each later part replacing the steps it trained again (those after the checkpoint it resumed),
and marks where each part began. Left: ``train/loss`` and ``val/loss`` against the optimizer step.
Right: ``perf/tokens_per_sec`` (from ``MFUMonitor``) against the step, with ``perf/mfu`` when it was
logged. Needs matplotlib (the ``bench`` or ``dev`` extra).
"""

from __future__ import annotations

import argparse
import csv
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Union

__all__ = ["find_metrics", "main", "plot_run", "read_metrics", "resumed_at"]

Series = dict[str, list[tuple[int, float]]]


def _version_order(path: Path) -> tuple[int, float]:
    match = re.fullmatch(r"version_(\d+)", path.parent.name)
    return (int(match.group(1)) if match else -1, path.stat().st_mtime)


def find_metrics(run: Path) -> list[Path]:
    """``run/metrics.csv``, or those of every ``version_N`` folder under ``run``, oldest first (by N, then time).

    Example::

        find_metrics(Path("runs/quickstart"))  # [.../version_0/metrics.csv, .../version_1/metrics.csv]

    Raises:
        FileNotFoundError: No ``metrics.csv`` under ``run``.
    """
    if (run / "metrics.csv").is_file():
        return [run / "metrics.csv"]
    found = sorted(run.rglob("metrics.csv"), key=_version_order)
    if not found:
        raise FileNotFoundError(f"No metrics.csv under {run}: give a run folder written by Lightning's CSVLogger.")
    return found


def _read_one(path: Path) -> Series:
    series: Series = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = row.get("step")
            if not step:
                continue
            for key, value in row.items():
                if key in ("step", "epoch") or value in (None, ""):
                    continue
                number = float(value)
                if math.isfinite(number):
                    series.setdefault(key, []).append((int(float(step)), number))
    return series


def read_metrics(paths: Union[Path, Sequence[Path]]) -> Series:
    """Every column of the ``metrics.csv`` files as ``(step, value)`` pairs, empty cells left out, the files joined
    in order: each later file (a resumed part) replaces the earlier ones from its first step on.

    Example::

        read_metrics(find_metrics(Path("runs/quickstart")))["train/loss"][:2]   # [(9, 6.91), (19, 6.02)]
    """
    joined: Series = {}
    for path in [paths] if isinstance(paths, Path) else paths:
        part = _read_one(path)
        starts = [step for values in part.values() for step, _ in values]
        if not starts:
            continue
        start = min(starts)
        joined = {key: [(s, v) for s, v in values if s < start] for key, values in joined.items()}
        for key, values in part.items():
            joined.setdefault(key, []).extend(values)
    return {key: values for key, values in joined.items() if values}


def resumed_at(paths: Sequence[Path]) -> list[int]:
    """The first step of every part after the first: where the run was continued.

    Example::

        resumed_at(find_metrics(Path("runs/quickstart")))  # [100]
    """
    starts = []
    for path in paths[1:]:
        steps = [step for values in _read_one(path).values() for step, _ in values]
        if steps:
            starts.append(min(steps))
    return starts


def plot_run(metrics: Series, out: Path, title: str = "", resumed: Sequence[int] = ()) -> Path:
    """Draw loss and throughput side by side into ``out`` (PNG), a dotted line where the run was resumed; return it.

    Example::

        paths = find_metrics(Path("runs/quickstart"))
        plot_run(read_metrics(paths), Path("run.png"), resumed=resumed_at(paths))
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for key, style in (("train/loss", "-"), ("val/loss", "o-")):
        if key in metrics:
            steps, values = zip(*metrics[key])
            left.plot(steps, values, style, label=key, markersize=4)
    left.set_xlabel("optimizer step")
    left.set_ylabel("loss (nats/token)")
    left.legend()
    left.grid(alpha=0.3)
    if "perf/tokens_per_sec" in metrics:
        steps, values = zip(*metrics["perf/tokens_per_sec"])
        right.plot(steps, values, "o-", color="tab:green", markersize=4, label="tokens/s")
        right.set_ylabel("tokens/s")
        if "perf/mfu" in metrics:
            twin = right.twinx()
            steps, values = zip(*metrics["perf/mfu"])
            twin.plot(steps, [100 * v for v in values], "s--", color="tab:purple", markersize=3, label="MFU %")
            twin.set_ylabel("MFU (%)")
    else:
        right.text(0.5, 0.5, "no perf/tokens_per_sec logged\n(add MFUMonitor)", ha="center", va="center",
                   transform=right.transAxes)
    right.set_xlabel("optimizer step")
    right.grid(alpha=0.3)
    for i, step in enumerate(resumed):
        for axis in (left, right):
            axis.axvline(step, color="grey", linestyle=":", label="resumed" if i == 0 and axis is left else None)
    if resumed:
        left.legend()
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Optional[list[str]] = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="a run folder (trainer.default_root_dir or a version_N folder)")
    p.add_argument("--out", default=None, help="PNG to write (default: run.png next to metrics.csv)")
    args = p.parse_args(argv)
    paths = find_metrics(Path(args.run))
    folder = Path(args.run).resolve()
    title = str(folder.relative_to(Path.cwd())) if folder.is_relative_to(Path.cwd()) else str(folder)
    if len(paths) > 1:
        title += f" ({len(paths)} parts: {', '.join(p.parent.name for p in paths)})"
    out = Path(args.out) if args.out else paths[-1].with_name("run.png")
    out = plot_run(read_metrics(paths), out, title=title, resumed=resumed_at(paths))
    print(out)
    return out


if __name__ == "__main__":
    main()
