"""Run one measurement of a benchmark script in a fresh Python process, and save a script's rows.

A fresh process inherits no allocator cache, compiled graph or peak-memory counter from an earlier
measurement. The script re-runs itself with ``--child ARG...`` plus the options that shape the
measurement, prints one JSON object as its last line, and the parent collects it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

__all__ = ["measure_in_fresh_process", "write_rows"]


def measure_in_fresh_process(
    module: str, child: list[Any], args: argparse.Namespace, keys: tuple[str, ...], env: Optional[dict] = None
) -> dict[str, Any]:
    """``python -m module --child *child --key value ...``; its last printed line, parsed as JSON.

    Example::

        row = measure_in_fresh_process("benchmarks.step_memory", ["chunked", 8], args, ("device",))

    Args:
        module: The benchmark's module name.
        child: The arguments after ``--child``.
        args: The parent's parsed options.
        keys: Which options to pass on (their ``--dashed-names``).
        env: The child's environment (default: the parent's).

    Returns:
        The child's JSON object, or ``{"error": [last stderr line]}`` if it failed.
    """
    cmd = [sys.executable, "-m", module, "--child", *map(str, child)]
    for key in keys:
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_rows(path: Optional[str], args: argparse.Namespace, rows: list[dict[str, Any]], table: str) -> int:
    """Write the options, rows and table as JSON to ``path`` (if given); exit status 1 if a row failed."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"args": vars(args), "rows": rows, "table": table}, indent=1))
    return 1 if any("error" in r for r in rows) else 0
