"""``python -m benchmarks.loss_bench``: the loss microbenchmark, at its tiny size as the headline command runs it."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import loss_bench


def test_the_tiny_run_measures_every_implementation_this_machine_has_and_says_why_not_the_others(tmp_path):
    """As the headline's ``loss-bench`` part runs it under ``--tiny``, compilation off (there by
    ``TORCH_COMPILE_DISABLE=1``; tests/benchmarks/test_headline.py runs that command whole)."""
    out = tmp_path / "out"
    with torch._dynamo.config.patch(disable=True):
        assert loss_bench.main(["--tiny", "--device", "cpu", "--out", str(out)]) == 0
    result = json.loads((out / "loss-bench.json").read_text())
    rows = result["rows"]
    assert list(rows) == list(loss_bench.IMPLS) and (result["tokens"], result["vocab"]) == (96, 512)
    ran = [name for name, r in rows.items() if r["status"] == "ok"]
    native = hasattr(torch.nn.functional, "linear_cross_entropy")  # torch 2.13 has it, 2.11 does not
    assert ran == ["before", "chunked", "chunked-eager", "chunked-float8", "full-compiled",
                   *(["torch-native"] if native else [])], rows
    if not native:
        assert rows["torch-native"]["status"] != "ok" and rows["torch-native"]["reason"]
    assert rows["liger"]["reason"] == "Liger-Kernel runs on CUDA only"
    assert "CUDA only" in rows["cut-cross-entropy"]["reason"]
    losses = [rows[name]["loss"] for name in ran if name != "chunked-float8"]
    assert max(losses) - min(losses) < 1e-4 and 6.0 < losses[0] < 6.5  # one loss, about ln(512) = 6.24
    assert abs(rows["chunked-float8"]["loss"] - losses[0]) < 2e-2  # the same loss from float8 logits
    assert all(rows[name]["ms"] > 0 for name in ran)
    assert rows["before"]["chunk_tokens"] == 2**29 // (512 * 4) // 16 * 16  # the fixed 512 MiB budget
    assert result["fastest_keeping_all"] in ("before", "chunked", "chunked-eager")  # the others keep fewer promises
    md = (out / "loss-bench.md").read_text()
    assert f"- command: `python -m benchmarks.loss_bench --tiny --device cpu --out {out}`" in md
    assert loss_bench.markdown_lines(result) == md.splitlines()
    assert "| `liger` | - | - | - | - | - | none | skipped: Liger-Kernel runs on CUDA only |" in md


@pytest.mark.parametrize(("argv", "match"), [(["--impls", "fused"], "unknown names"), (["--tokens", "0"], ">= 1")])
def test_bad_options_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        loss_bench.parse_args(argv)
    assert match in capsys.readouterr().err
