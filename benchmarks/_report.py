"""Results of the throughput benchmark: per-configuration summary, MFU, targets, JSON, Markdown and a bar chart.

``summarise`` folds the runs of every repeat into one entry per configuration; ``write_json``,
``markdown`` and ``plot`` write what a reader needs to judge the numbers: the device and software
versions, the command line, and for each configuration tokens/s, MFU, step-time median and
spread, peak memory and the speed-up over the baseline.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from pathlib import Path
from typing import Any, Optional

from benchmarks._configs import AUTO_BF16, BASELINE, BF16_CONFIGS, CONFIGS, FP8_AUTO, FP8_CONFIGS, FP8_FIXED, TORCH_LOOP
from benchmarks._timing import step_stats
from lightning_gpuopt.perf.mfu import fp8_weighted_peak

__all__ = ["MFU_TARGETS", "best_bf16", "check_out_folder", "check_targets", "device_slug", "markdown", "plot",
           "summarise", "write_json", "write_text"]

BF16_FIXED = "gpuopt-bf16-compile"


def device_slug(device_name: str) -> str:
    """A folder name for a device: ``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``.

    Args:
        device_name: What ``torch.cuda.get_device_name()`` reports, or ``"cpu"``.
    """
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "unknown"


def _spread_pct(values: list[float]) -> Optional[float]:
    return 100 * (max(values) - min(values)) / statistics.fmean(values) if len(values) > 1 else None


def summarise(
    runs: dict[str, list[dict[str, Any]]],
    flops_per_token: float,
    peaks: dict[str, Optional[float]],
    mfu_note: Optional[str],
) -> dict[str, dict[str, Any]]:
    """One entry per configuration from its runs (one per repeat), with MFU and the speed-up over ``baseline``.

    Example::

        summary = summarise({"baseline": [run0, run1]}, 0.855e9, {"bf16": 989.4e12, "fp8": None, "measured": None}, None)
        summary["baseline"]["tokens_per_s"]

    Args:
        runs: Configuration name to the result dicts of its repeats (``status`` ``ok``, ``skipped`` or ``failed``).
        flops_per_token: Training FLOPs per token of the model (PaLM formula).
        peaks: Peak FLOP/s per device: ``bf16`` (datasheet, dense), ``fp8`` (datasheet) and
            ``measured`` (timed bf16 matmul); ``None`` where unknown.
        mfu_note: Why MFU is missing, when ``peaks["bf16"]`` is ``None`` (e.g. on CPU).
    """
    summary: dict[str, dict[str, Any]] = {}
    for name, results in runs.items():
        entry: dict[str, Any] = {"description": CONFIGS[name], "repeats": len(results)}
        bad = [r for r in results if r["status"] != "ok"]
        if bad:
            entry.update(status=bad[0]["status"], reason=bad[0]["reason"])
            summary[name] = entry
            continue
        rates = [r["tokens_per_s"] for r in results]
        tokens_per_s = statistics.fmean(rates)
        tflops = tokens_per_s * flops_per_token / 1e12
        entry.update(
            status="ok",
            micro_batch_size=results[0]["micro_batch_size"],
            accumulate_grad_batches=results[0]["accumulate_grad_batches"],
            tokens_per_step=results[0]["tokens_per_step"],
            tokens_per_s=tokens_per_s,
            tokens_per_s_repeats=rates,
            repeat_spread_pct=_spread_pct(rates),
            tflops=tflops,
            mfu=tflops * 1e12 / peaks["bf16"] if peaks.get("bf16") else None,
            mfu_measured=tflops * 1e12 / peaks["measured"] if peaks.get("measured") else None,
            step_time=step_stats([s for r in results for s in r["step_times_s"]]),
            peak_memory_gb=max((r["peak_memory_gb"] for r in results if r["peak_memory_gb"] is not None), default=None),
            startup_s=[r["startup_s"] for r in results],
            search_s=[r["search_s"] for r in results] if results[0]["search_s"] is not None else None,
            warmup_s=[r["warmup_s"] for r in results],
            first_batch_token_sum=results[0]["first_batch_token_sum"],
            first_loss=results[0]["first_loss"],
        )
        if name in FP8_CONFIGS:  # against the fp8 peak weighted by the FLOPs that ran in float8 (none: no fp8 MFU)
            float8 = results[0].get("float8") or {}
            share = float8.get("flop_share", 1.0)
            peak = fp8_weighted_peak(peaks.get("bf16"), peaks.get("fp8"), share) if share else None
            entry["mfu_fp8"] = tflops * 1e12 / peak if peak else None
            if float8:
                entry["float8"] = float8
        if entry["mfu"] is None:
            entry["mfu_note"] = mfu_note
        if "auto_batch" in results[0]:
            entry["auto_batch"] = results[0]["auto_batch"]
        if "profile" in results[0]:
            entry["profile"] = results[0]["profile"]  # of the first repeat
        if name == TORCH_LOOP:
            entry["compare_with"] = results[0].get("compare_with")
        summary[name] = entry
    base = summary.get(BASELINE, {}).get("tokens_per_s")
    for entry in summary.values():
        if entry["status"] == "ok":
            entry["speedup_vs_baseline"] = entry["tokens_per_s"] / base if base else None
    return summary


def _ratio(summary: dict[str, dict[str, Any]], a: str, b: str) -> Optional[float]:
    x, y = summary.get(a, {}).get("tokens_per_s"), summary.get(b, {}).get("tokens_per_s")
    return x / y if x and y else None


def best_bf16(summary: dict[str, dict[str, Any]]) -> Optional[str]:
    """The gpuopt bf16 configuration with the most tokens/s in ``summary`` (``None`` if none ran)."""
    ran = [n for n in BF16_CONFIGS if summary.get(n, {}).get("tokens_per_s")]
    return max(ran, key=lambda n: summary[n]["tokens_per_s"], default=None)


# MFU targets per preset (H100, T 1024, dense bf16 datasheet peak), for the best gpuopt bf16 configuration.
MFU_TARGETS = {"124m": 0.45, "774m": 0.50}


def check_targets(summary: dict[str, dict[str, Any]], preset: str) -> list[dict[str, Any]]:
    """The issue's targets (set for an H100 at sequence length 1024) against these results.

    Each entry: ``target`` (text), ``value`` (``None`` where the configurations needed did not run)
    and ``met`` (``None`` likewise).

    Args:
        summary: Output of :func:`summarise`.
        preset: The model preset (the MFU and FP8 targets depend on it).
    """
    targets = []

    def add(text: str, value: Optional[float], ok: Any) -> None:
        targets.append({"target": text, "value": value, "met": None if value is None else bool(ok(value))})

    add(f"{AUTO_BF16} >= 4x baseline tokens/s", _ratio(summary, AUTO_BF16, BASELINE), lambda v: v >= 4)
    best = best_bf16(summary)
    if preset in MFU_TARGETS:
        goal = MFU_TARGETS[preset]
        add(f"best gpuopt bf16 configuration ({best or 'none ran'}) MFU >= {goal:.0%} at {preset}",
            summary[best].get("mfu") if best else None, lambda v: v >= goal)
    if preset == "774m":
        add(f"{FP8_AUTO} >= 1.15x {AUTO_BF16} tokens/s at 774m", _ratio(summary, FP8_AUTO, AUTO_BF16), lambda v: v >= 1.15)
        add(f"{FP8_FIXED} >= 1.15x {BF16_FIXED} tokens/s at 774m (same micro-batch)",
            _ratio(summary, FP8_FIXED, BF16_FIXED), lambda v: v >= 1.15)
    add(f"{TORCH_LOOP} at most 3% faster than the best gpuopt bf16 configuration ({best or 'none ran'})",
        _ratio(summary, TORCH_LOOP, best) if best else None, lambda v: v <= 1.03)
    return targets


def check_out_folder(path: Path) -> None:
    """Raise ``ValueError``, naming ``--out``, unless the folder ``path`` can be written (or made): before any
    measurement, so a read-only or mistyped ``--out`` loses no work."""
    from lightning_gpuopt.cli.config_checks import check_writable

    check_writable("--out", path, fix="give --out a folder you can write")


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a stop mid-write keeps the previous version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Write the whole report (environment, settings, per-run and per-configuration results) as JSON."""
    write_text(path, json.dumps(report, indent=2, default=str) + "\n")


def _fmt(value: Optional[float], spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if value is None else format(value * scale, spec) + suffix


def _vocabulary_line(vocab: Optional[dict[str, Any]]) -> list[str]:
    if not vocab:
        return []
    return [f"- vocabulary {vocab['model']:,} (asked {vocab['asked']:,}, padded to a multiple of 64; tokenizer "
            f"{vocab['tokenizer']:,}); the output head is {vocab['head_flops_share']:.1%} of the training FLOPs"]


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown page: environment, one table row per configuration, reasons, targets.

    Args:
        report: The dict written by :func:`write_json`.
    """
    env, s = report["environment"], report["settings"]
    lines = [
        f"# Throughput: {s['preset']}, sequence length {s['block_size']}, {env['device']}",
        "",
        f"- device: {env['device']} ({env['device_detail']})",
        f"- torch {env['torch']}, lightning {env['lightning']}, torchao {env['torchao'] or 'not installed'}, "
        f"python {env['python']}, CUDA {env['cuda'] or '-'}",
        f"- commit {env['git_commit'] or 'unknown'}, {env['date']}",
        f"- command: `{env['command']}`",
        *([] if report.get("complete", True) else [
            "- **partial results**: written while the run was still going (or after it was stopped); the "
            "configurations missing from the table had not finished",
        ]),
        f"- {s['steps']} measured optimizer steps after {s['warmup_steps']} warm-up steps, {s['repeats']} repeat(s) "
        f"(order alternates between repeats); data: {s['data']}; global batch {s['global_batch_size']} sequences: "
        f"fixed micro-batch {s['micro_batch_size']} with accumulation, or AutoBatchSize's choice",
        *_vocabulary_line(report.get("vocabulary")),
        f"- training GFLOPs/token {report['flops_per_token'] / 1e9:.3f}; peak: "
        + ", ".join(f"{k} {_fmt(v, '.1f', 1e-12, ' TFLOP/s')}" for k, v in report["peaks"].items())
        + (f" (MFU not reported: {report['mfu_note']})" if report["mfu_note"] else ""),
        "",
        "| configuration | micro-batch x accum | tokens/s | vs baseline | TFLOP/s | MFU | MFU (measured) "
        "| step median ms | step IQR % | repeat spread % | peak mem GiB | start-up s | warm-up s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for name, e in report["summary"].items():
        if e["status"] != "ok":
            lines.append(f"| `{name}` | {e['status']} | | | | | | | | | | | |")
            notes.append(f"- `{name}` {e['status']}: {e['reason']}")
            continue
        st = e["step_time"]
        lines.append(
            f"| `{name}` | {e['micro_batch_size']} x {e['accumulate_grad_batches']} | {e['tokens_per_s']:,.0f} "
            f"| {_fmt(e['speedup_vs_baseline'], '.2f', suffix='x')} | {e['tflops']:.3g} | {_fmt(e['mfu'], '.1%')} "
            f"| {_fmt(e['mfu_measured'], '.1%')} | {st['median_ms']:.1f} | {_fmt(st['spread_pct'], '.1f')} "
            f"| {_fmt(e['repeat_spread_pct'], '.1f')} | {_fmt(e['peak_memory_gb'], '.1f')} "
            f"| {max(e['startup_s']):.1f} | {max(e['warmup_s']):.1f} |"
        )
        if e.get("mfu_fp8") is not None:
            notes.append(f"- `{name}`: MFU against the fp8 peak {100 * e['mfu_fp8']:.1f}%")
        if e.get("search_s"):
            notes.append(f"- `{name}`: AutoBatchSize search (and data-loader start) {max(e['search_s']):.1f} s, in start-up")
        if e.get("compare_with"):
            notes.append(f"- `{name}`: {e['compare_with']}")
    lines += ["", "Start-up: building the model and data loaders (and the AutoBatchSize search); warm-up: the "
              "unmeasured first steps (compilation). Neither is in tokens/s.", ""]
    if notes:
        lines += ["## Notes", "", *dict.fromkeys(notes), ""]
    profiled = {name: e["profile"] for name, e in report["summary"].items() if e.get("profile")}
    if profiled:
        lines += ["## Profiles", "",
                  "Device time per optimizer step by kernel category (CPU: operator self time), over "
                  f"{s.get('profile_steps')} steps run after the measured ones; idle: the device waiting between kernels.", ""]
        for name, prof in profiled.items():
            if "error" in prof:
                lines.append(f"- `{name}`: the profile could not be summarised: {prof['error']}")
                continue
            parts = [f"{c} {v['pct']:.0f}%" for c, v in prof["categories"].items()]
            idle = "" if prof["idle_pct"] is None else f"; idle {prof['idle_pct']:.1f}% of the span"
            lines.append(f"- `{name}` ({prof['source']}): busy {prof['busy_ms_per_step']:.1f} ms/step{idle}: "
                         + ", ".join(parts))
            for kernel, ms, pct, calls in prof["top"][:5]:
                lines.append(f"  - {ms:.2f} ms ({pct:.0f}%, {calls:g} calls/step) `{kernel[:100]}`")
        lines.append("")
    lines += ["## Targets (H100, sequence length 1024)", "", "| target | value | met |", "|---|---:|---|"]
    for t in report["targets"]:
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "**no**")
        value = "-" if t["value"] is None else (f"{100 * t['value']:.1f}%" if "MFU" in t["target"] else f"{t['value']:.2f}x")
        lines.append(f"| {t['target']} | {value} | {met} |")
    lines += ["", "## Configurations", ""] + [f"- `{k}`: {v}" for k, v in CONFIGS.items()]
    return "\n".join(lines) + "\n"


def plot(path: Path, report: dict[str, Any]) -> None:
    """A PNG with two bar charts: tokens/s and MFU per configuration (configurations that did not run are left out).

    Raises:
        ImportError: matplotlib is not installed (``pip install "lightning-gpuopt[bench]"``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(
            f"The bar chart needs matplotlib ({err}): pip install \"lightning-gpuopt[bench]\", or pass --no-plot."
        ) from err
    ok = {k: e for k, e in report["summary"].items() if e["status"] == "ok"}
    names = list(ok)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.5 * len(names) + 2), sharey=True)
    ax1.barh(names, [ok[n]["tokens_per_s"] for n in names], color="tab:blue")
    ax1.set_xlabel("tokens/s")
    ax1.set_xlim(0, 1.3 * max((ok[n]["tokens_per_s"] for n in names), default=1))  # room for the labels
    for i, n in enumerate(names):
        speedup = ok[n]["speedup_vs_baseline"]
        ax1.text(ok[n]["tokens_per_s"], i, f" {ok[n]['tokens_per_s']:,.0f}" + (f" ({speedup:.2f}x)" if speedup else ""),
                 va="center", fontsize=8)
    mfu = [ok[n]["mfu"] for n in names]
    if any(m is not None for m in mfu):
        ax2.barh(names, [100 * (m or 0) for m in mfu], color="tab:orange")
        ax2.set_xlabel("MFU % (dense bf16 peak)")
    else:
        ax2.text(0.5, 0.5, "MFU not available:\n" + str(report["mfu_note"]), ha="center", va="center",
                 transform=ax2.transAxes, wrap=True)
        ax2.set_xticks([])
    ax1.invert_yaxis()
    s, env = report["settings"], report["environment"]
    fig.suptitle(f"{s['preset']}, T={s['block_size']}, {env['device']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
