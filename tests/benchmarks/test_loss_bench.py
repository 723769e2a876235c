"""``python -m benchmarks.loss_bench``: the loss microbenchmark, at its tiny size as the headline command runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import headline, loss_bench
from tests._paths import REPO


def test_the_tiny_run_measures_every_implementation_this_machine_has_and_says_why_not_the_others(tmp_path):
    """As the headline's ``loss-bench`` part runs it under ``--tiny`` (its environment: compile disabled)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "benchmarks.loss_bench", "--tiny", "--device", "cpu", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, env=headline._child_env(tiny=True), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((out / "loss-bench.json").read_text())
    rows = result["rows"]
    assert list(rows) == list(loss_bench.IMPLS) and (result["tokens"], result["vocab"]) == (96, 512)
    ran = [name for name, r in rows.items() if r["status"] == "ok"]
    assert ran == ["before", "chunked", "chunked-eager", "full-compiled", "torch-native"], rows
    assert rows["liger"]["reason"] == "Liger-Kernel runs on CUDA only"
    assert "CUDA only" in rows["cut-cross-entropy"]["reason"]
    losses = [rows[name]["loss"] for name in ran]
    assert max(losses) - min(losses) < 1e-4 and 6.0 < losses[0] < 6.5  # one loss, about ln(512) = 6.24
    assert all(rows[name]["ms"] > 0 for name in ran)
    assert rows["before"]["chunk_tokens"] == 2**29 // (512 * 4) // 16 * 16  # the fixed 512 MiB budget
    assert result["fastest_keeping_all"] in ("before", "chunked", "chunked-eager")  # the others keep fewer promises
    md = (out / "loss-bench.md").read_text()
    assert f"- command: `python -m benchmarks.loss_bench --tiny --device cpu --out {out}`" in md
    assert "| `liger` | - | - | - | - | - | none | skipped: Liger-Kernel runs on CUDA only |" in md


@pytest.mark.parametrize(("argv", "match"), [(["--impls", "fused"], "unknown names"), (["--tokens", "0"], ">= 1")])
def test_bad_options_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        loss_bench.parse_args(argv)
    assert match in capsys.readouterr().err
