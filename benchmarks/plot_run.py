"""Plot a run's loss and tokens/s from its ``metrics.csv`` (Lightning's ``CSVLogger``).

Example::

    python -m benchmarks.plot_run runs/quickstart                       # the newest version_N under it
    python -m benchmarks.plot_run runs/quickstart/lightning_logs/version_0 --out quickstart.png

Left: ``train/loss`` and ``val/loss`` against the optimizer step. Right: ``perf/tokens_per_sec``
(from ``MFUMonitor``) against the step, with ``perf/mfu`` when it was logged. Needs matplotlib
(the ``bench`` or ``dev`` extra).
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path
from typing import Optional

__all__ = ["find_metrics", "main", "plot_run", "read_metrics"]


def find_metrics(run: Path) -> Path:
    """``run/metrics.csv``, or that of the newest ``version_N`` folder under ``run``.

    Example::

        find_metrics(Path("runs/quickstart"))  # runs/quickstart/lightning_logs/version_3/metrics.csv

    Raises:
        FileNotFoundError: No ``metrics.csv`` under ``run``.
    """
    if (run / "metrics.csv").is_file():
        return run / "metrics.csv"
    found = sorted(run.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"No metrics.csv under {run}: give a run folder written by Lightning's CSVLogger.")
    return found[-1]


def read_metrics(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Every column of ``metrics.csv`` as ``(step, value)`` pairs, empty cells left out.

    Example::

        read_metrics(Path("metrics.csv"))["train/loss"][:2]   # [(9, 6.91), (19, 6.02)]
    """
    series: dict[str, list[tuple[int, float]]] = {}
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


def plot_run(metrics: dict[str, list[tuple[int, float]]], out: Path, title: str = "") -> Path:
    """Draw loss and throughput side by side into ``out`` (PNG), return it.

    Example::

        plot_run(read_metrics(find_metrics(Path("runs/quickstart"))), Path("run.png"))
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
    path = find_metrics(Path(args.run))
    folder = path.parent.resolve()
    title = str(folder.relative_to(Path.cwd())) if folder.is_relative_to(Path.cwd()) else str(folder)
    out = plot_run(read_metrics(path), Path(args.out) if args.out else path.with_name("run.png"), title=title)
    print(out)
    return out


if __name__ == "__main__":
    main()
