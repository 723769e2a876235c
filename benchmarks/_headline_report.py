"""The headline command's results: the JSON, the Markdown page, the bar chart, and what they read from the parts.

``headline_rows`` flattens the throughput parts into one table (preset, configuration, tokens/s,
speed-ups, MFU against the datasheet and the measured matmul ceiling, peak memory, compile time);
``junit_summary`` reads the gpu tests' XML; ``markdown`` and ``plot`` turn the report into a page
and a chart (the loss microbenchmark's table is its own: ``loss_bench.markdown_lines``). The JSON is the report itself (``_report.write_json``).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Optional

from benchmarks import loss_bench
from benchmarks._configs import BASELINE, FP8_CONFIGS

__all__ = ["headline_rows", "junit_summary", "markdown", "plot"]

_BF16_OF = {"gpuopt-fp8-compile": "gpuopt-bf16-compile", "gpuopt-fp8-compile-auto": "gpuopt-bf16-compile-auto"}


def junit_summary(path: Path) -> Optional[dict[str, Any]]:
    """Counts, failures and durations of a pytest JUnit XML file; ``None`` if it is missing or unreadable.

    Example::

        junit_summary(Path("gpu-tests.xml"))  # {"tests": 14, "passed": 12, "failed": [...], ...}
    """
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    cases, failed, skipped = [], [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome, message = tag, (child.get("message") or "").strip().splitlines()[:1]
                (skipped if tag == "skipped" else failed).append({"test": name, "outcome": tag,
                                                                  "message": message[0][:300] if message else ""})
                break
        cases.append({"test": name, "outcome": outcome, "seconds": float(case.get("time") or 0)})
    return {"tests": len(cases), "passed": sum(c["outcome"] == "passed" for c in cases), "failed": failed,
            "skipped": skipped, "cases": cases}


def headline_rows(parts: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration of every throughput part that ran, with its speed-ups.

    ``vs_baseline`` is against ``baseline`` of the same preset (from any part); ``fp8_vs_bf16`` is a
    float8 configuration against its bf16 twin at the same preset and micro-batch rule.
    """
    rows = []
    for name, part in parts.items():
        result = part.get("result") or {}
        if part.get("kind") != "throughput" or "summary" not in result:
            continue
        preset = result["settings"]["preset"]
        recipe = result["settings"]["fp8_recipe"]
        for config, e in result["summary"].items():
            row = {"part": name, "preset": preset, "config": config + (f" ({recipe})" if config in FP8_CONFIGS else ""),
                   "name": config, "status": e["status"], "reason": e.get("reason")}
            if e["status"] == "ok":
                row.update({k: e.get(k) for k in ("micro_batch_size", "accumulate_grad_batches", "tokens_per_s",
                                                  "tflops", "mfu", "mfu_measured", "mfu_fp8", "peak_memory_gb",
                                                  "repeats", "repeat_spread_pct")})
                row["warmup_s"] = max(e["warmup_s"])
                row["search_s"] = max(e["search_s"]) if e.get("search_s") else None
                row["auto_batch"] = e.get("auto_batch")
            rows.append(row)
    ok = [r for r in rows if r["status"] == "ok"]
    for r in ok:
        base = next((b for b in ok if b["preset"] == r["preset"] and b["name"] == BASELINE), None)
        twins = [t for t in ok if t["preset"] == r["preset"] and t["name"] == _BF16_OF.get(r["name"])]
        twin = next((t for t in twins if t["part"] == r["part"]), twins[0] if twins else None)  # its own part first
        r["vs_baseline"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        r["fp8_vs_bf16"] = r["tokens_per_s"] / twin["tokens_per_s"] if twin else None
    for r in rows:
        r.setdefault("vs_baseline", None)
        r.setdefault("fp8_vs_bf16", None)
    return rows


def _f(value: Optional[float], spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if value is None else format(value * scale, spec) + suffix


def _table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| preset | configuration | micro-batch x accum | tokens/s | vs baseline | float8 / bf16 "
             "| MFU (datasheet) | MFU (measured matmul) | peak memory GiB | warm-up (compile) s | repeats (spread %) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['preset']} | `{r['config']}` | {r['status']}: {r['reason']} | | | | | | | | |")
            continue
        lines.append(
            f"| {r['preset']} | `{r['config']}` | {r['micro_batch_size']} x {r['accumulate_grad_batches']} "
            f"| {r['tokens_per_s']:,.0f} | {_f(r['vs_baseline'], '.2f', suffix='x')} "
            f"| {_f(r['fp8_vs_bf16'], '.2f', suffix='x')} "
            f"| {_f(r['mfu'], '.1%')} | {_f(r['mfu_measured'], '.1%')} | {_f(r['peak_memory_gb'], '.1f')} "
            f"| {r['warmup_s']:.1f} | {r.get('repeats') or 1} ({_f(r.get('repeat_spread_pct'), '.1f')}) |")
    return lines


def _part_lines(parts: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| part | estimate s | limit s | took s | CPU s | status |", "|---|---:|---:|---:|---:|---|"]
    for name, p in parts.items():
        status = p["status"] + (f": {p['reason']}" if p.get("reason") else "")
        lines.append(f"| {name} | {_f(p.get('estimate_s'), '.0f')} | {_f(p.get('limit_s'), '.0f')} "
                     f"| {_f(p.get('seconds'), '.0f')} | {_f(p.get('cpu_s'), '.0f')} | {status} |")
    return lines


def _doctor_lines(result: dict[str, Any]) -> list[str]:
    checks = result.get("checks", [])
    counts = {s: sum(c["status"] == s for c in checks) for s in ("pass", "fail", "info")}
    lines = [f"## gpuopt doctor: {counts['pass']} passed, {counts['fail']} failed, {counts['info']} for information",
             ""]
    shown = ("device", "train_steps", "torch_compile")  # and every failed check
    lines += [f"- `{c['name']}` {c['status']}: {c['detail']}" + (f" (fix: {c['fix']})" if c["fix"] else "")
              for c in checks if c["status"] == "fail" or c["name"].startswith(shown)]
    return lines + [""]


def _tests_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"## gpu tests: {result['passed']} passed, {len(result['failed'])} failed, "
             f"{len(result['skipped'])} skipped of {result['tests']} run", ""]
    lines += [f"- **{f['outcome']}** `{f['test']}`: {f['message']}" for f in result["failed"]]
    return lines + [""]


def _generation_lines(result: dict[str, Any]) -> list[str]:
    m = result["model"]
    lines = [f"## Generation: {result['rows']} rows, prompts of {result['prompt_len'][0]} to {result['prompt_len'][1]} "
             f"tokens, n_layer {m['n_layer']}, width {m['n_embd']} ({result['dtype']})", "",
             "| configuration | batch | seconds | answer tokens/s | mean answer | vs one at a time | vs transformers |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["results"]:
        lines.append(f"| `{r['config']}` | {r['batch']} | {r['seconds']:.2f} | {r['answer_tokens_per_sec']:,.0f} "
                     f"| {r['mean_answer_tokens']:.1f} | {_f(r.get('speedup'), '.2f', suffix='x')} "
                     f"| {_f(r.get('vs_transformers'), '.2f', suffix='x')} |")
    return lines + [""]


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown page: device and versions, the headline table, the parts and what they found."""
    dev, parts = report["device"], report["parts"]
    v = dev.get("versions", {})
    lines = [f"# Headline figures: {dev.get('describe', '?')}", ""]
    if report["tiny"]:
        lines += ["**Smoke run (`--tiny`): tiny model, torch.compile disabled, float8 emulated: it checks the command "
                  "end to end and measures nothing.**", ""]
    if not report["complete"]:
        lines += ["**Partial results**: written while the command was still running (or after it was stopped).", ""]
    lines += [f"- command: `{report['command']}`",
              f"- " + ", ".join(f"{k} {v[k] or '-'}" for k in v),
              f"- commit {report.get('git_commit') or 'unknown'}, {report['date']}; budget {report['budget_s']:.0f} s, "
              f"{report['elapsed_s']:.0f} s spent",
              f"- time estimates: {report['estimates']['note']}", "",
              "## Throughput", "", *_table(report["headline"]), "",
              "MFU is against the dense bf16 peak of the datasheet for every configuration (fp32 and float8 "
              "included); \"measured matmul\" divides by a timed bf16 matmul instead. Warm-up: the unmeasured "
              "first steps, mostly compilation.", ""]
    for r in report["headline"]:
        if r.get("auto_batch"):
            a = r["auto_batch"]
            lines.append(f"- AutoBatchSize ({r['preset']}): chose micro-batch {a['micro_batch_size']} x "
                         f"{a['accumulate_grad_batches']} after {a['trials']} trials; "
                         f"search {_f(r['search_s'], '.1f')} s")
        if r.get("mfu_fp8") is not None:
            lines.append(f"- `{r['config']}` ({r['preset']}): MFU against the float8 peak {r['mfu_fp8']:.1%}")
    lines += ["", "## Parts", "", *_part_lines(parts), ""]
    if (parts.get("doctor") or {}).get("result"):
        lines += _doctor_lines(parts["doctor"]["result"])
    if (parts.get("loss-bench") or {}).get("result"):
        lines += [*loss_bench.markdown_lines(parts["loss-bench"]["result"]), ""]
    if (parts.get("residual-curve-124m") or {}).get("result"):
        from benchmarks import residual_curve  # its imports (Lightning, the runners) only where it ran

        lines += [*residual_curve.markdown_lines(parts["residual-curve-124m"]["result"]), ""]
    if (parts.get("generation") or {}).get("result"):
        lines += _generation_lines(parts["generation"]["result"])
    if (parts.get("gpu-tests") or {}).get("result"):
        lines += _tests_lines(parts["gpu-tests"]["result"])
    return "\n".join(lines) + "\n"


def plot(path: Path, report: dict[str, Any]) -> bool:
    """A PNG of tokens/s and MFU per configuration that ran; ``False`` (nothing written) when none did."""
    rows = [r for r in report["headline"] if r["status"] == "ok"]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{r['part']}: {r['config']}" for r in rows]  # unique, also under --tiny where every preset is tiny
    y = list(range(len(rows)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 0.45 * len(rows) + 2), sharey=True)
    ax1.barh(y, [r["tokens_per_s"] for r in rows], color="tab:blue")
    ax1.set_yticks(y, names)
    ax1.set_xlabel("tokens/s")
    ax1.set_xlim(0, 1.35 * max(r["tokens_per_s"] for r in rows))
    for i, r in enumerate(rows):
        ratio = r["vs_baseline"] or r["fp8_vs_bf16"]
        label = f" {r['tokens_per_s']:,.0f}" + (f" ({ratio:.2f}x)" if ratio else "")
        ax1.text(r["tokens_per_s"], i, label, va="center", fontsize=8)
    if any(r["mfu"] is not None for r in rows):
        ax2.barh(y, [100 * (r["mfu"] or 0) for r in rows], color="tab:orange")
        ax2.set_xlabel("MFU % (dense bf16 datasheet peak)")
    else:
        ax2.text(0.5, 0.5, "MFU: no datasheet peak for this device", ha="center", va="center", transform=ax2.transAxes)
        ax2.set_xticks([])
    ax1.invert_yaxis()
    fig.suptitle(f"{report['device'].get('describe', '?')}" + (" (--tiny: measures nothing)" if report["tiny"] else ""))
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return True
