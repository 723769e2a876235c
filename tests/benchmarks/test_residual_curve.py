"""benchmarks.residual_curve: the loss curve of a bf16 residual stream against float32, run at a tiny size."""

from __future__ import annotations

import json

import pytest

from benchmarks import residual_curve
from benchmarks._headline_plan import ESTIMATES, PARTS, plan


def test_both_runs_train_the_same_model_on_the_same_data_and_write_their_curves(text_dir, cache_dir, tmp_path):
    out = tmp_path / "out"
    argv = ["--out", str(out), "--tiny", "--data", str(text_dir), "--cache-dir", str(cache_dir), "--steps", "3"]
    assert residual_curve.main(argv) == 0
    report = json.loads((out / "residual-curve.json").read_text())
    result = report["result"]
    f32, b16 = result["runs"]["float32"], result["runs"]["bfloat16"]
    assert result["steps"] == 3 and len(f32["losses"]) == len(b16["losses"]) == 3
    # The same seed and data order: the same first batch, and first losses that differ only by the residual's rounding.
    assert result["same_first_batch"] and f32["first_batch_token_sum"] == b16["first_batch_token_sum"]
    assert f32["first_loss"] == pytest.approx(b16["first_loss"], abs=0.05)
    assert f32["losses"][0] == pytest.approx(b16["losses"][0], abs=0.05)
    assert f32["losses"] != b16["losses"]  # the residual dtype does change the numbers
    assert result["window_steps"] == 1 and f32["final_loss"] == f32["losses"][-1]
    assert result["final_loss_difference"] == pytest.approx(b16["final_loss"] - f32["final_loss"])
    assert f32["tokens_per_s"] > 0 and b16["tokens_per_s"] > 0
    text = (out / "residual-curve.md").read_text()
    assert "| float32 |" in text and "| bfloat16 |" in text and "bf16 - float32: loss" in text


def test_final_window_is_the_mean_of_the_last_tenth_and_too_few_steps_are_refused(tmp_path):
    assert residual_curve.final_window([4.0] * 18 + [2.0, 1.0]) == pytest.approx(1.5)
    assert residual_curve.final_window([3.0, 2.0]) == 2.0
    with pytest.raises(ValueError, match="--steps must be an integer above"):
        residual_curve.main(["--out", str(tmp_path), "--tiny", "--steps", "1"])


def test_the_headline_plan_runs_the_curve_after_the_compile_residual_part_within_one_command():
    names = [p.name for p in PARTS]
    assert names.index("residual-curve-124m") == names.index("compile-residual-124m") + 1
    part = PARTS[names.index("residual-curve-124m")]
    rows, end = plan(list(PARTS), ESTIMATES["H100"], tiny=False, budget_s=420, wanted={part.name})
    assert {r.part: r.limit_s for r in rows}[part.name] is not None and end <= 420
