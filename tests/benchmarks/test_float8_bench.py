"""The headline command's float8 part at the tiny preset: per-shape timings in process, the children's commands."""

from __future__ import annotations

import json

from benchmarks import float8_bench


def test_shapes_step_times_every_tiny_projection_shape_for_both_recipes(tmp_path):
    assert float8_bench.main(["--tiny", "--steps", "shapes", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "float8.json").read_text())
    skipped = [r for r in result["steps"]["shapes"]["rows"] if "skipped" in r]
    rows = [r for r in result["steps"]["shapes"]["rows"] if "skipped" not in r and not r["loss_head"]]
    heads = [r for r in result["steps"]["shapes"]["rows"] if r.get("loss_head")]
    # tiny: 64 wide, c_attn 64x192, attn.c_proj 64x64, c_fc 64x256, mlp.c_proj 256x64; 2 layers of each
    assert sorted({(r["in"], r["out"]) for r in rows}) == [(64, 64), (64, 192), (64, 256), (256, 64)]
    # the head inside the chunked loss, timed once (tensorwise, its only recipe): 64 x the padded vocabulary
    assert [(h["recipe"], h["in"], h["out"], h["layers"]) for h in heads] == [("tensorwise", 64, 512, 1)]
    assert heads[0]["bf16_ms"] > 0 and heads[0]["float8_ms"] > 0
    # torch 2.11's CPU _scaled_mm has no rowwise scales: that recipe is skipped with the reason, never left out
    assert [r["recipe"] for r in skipped] in ([], ["rowwise"]) and all("float8 GEMMs" in r["skipped"] for r in skipped)
    assert {r["recipe"] for r in rows + skipped} == {"tensorwise", "rowwise"} and all(r["layers"] == 2 for r in rows)
    assert all(r["bf16_ms"] > 0 and r["float8_ms"] > 0 and r["converted"] is None for r in rows)  # CPU: no verdict
    assert result["device"] == "cpu" and "compare" not in result["steps"]


def test_children_compare_in_alternating_repeats_and_profile_the_124m_float8_step(tmp_path):
    gpu = float8_bench.child_commands(False, tmp_path, "auto")
    assert len(gpu["compare"]) == len(float8_bench.PRESETS)
    first = gpu["compare"][0]
    assert first[first.index("--configs") + 1] == "gpuopt-bf16-compile,gpuopt-fp8-compile"
    assert first[first.index("--repeats") + 1] == "3" and "--fp8-emulate" not in first
    assert [c[c.index("--micro-batch-size") + 1] for c in gpu["profile"]] == ["8", "64"]
    assert all(c[c.index("--preset") + 1] == "124m" and "--profile-steps" in c for c in gpu["profile"])
    tiny = float8_bench.child_commands(True, tmp_path, "auto", cache_dir="c")
    assert all("--fp8-emulate" in c and c[c.index("--preset") + 1] == "tiny" for c in tiny["compare"] + tiny["profile"])
    assert float8_bench.main(["--steps", "speed", "--out", str(tmp_path)]) == 2
