"""The headline parts of the step's options and anchors, each run as the command runs it, at the tiny preset."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import headline, throughput
from benchmarks._configs import BenchSettings
from benchmarks._runners import run_config
from benchmarks._headline_plan import ESTIMATES, MEASURED, PARTS, measured_part, part_keys, plan
from tests.benchmarks.test_headline import _expected_end


def _part(name: str):
    return next(p for p in PARTS if p.name == name)


def test_every_part_has_an_estimate_on_every_device_and_fits_one_command_of_420_s():
    for family, estimates in ESTIMATES.items():
        for part in PARTS:
            assert set(part_keys(part, family == "tiny")) <= set(estimates), (family, part.name)
    for part in PARTS[1:]:
        rows, end = plan(list(PARTS), ESTIMATES["H100"], tiny=False, budget_s=420, wanted={part.name})
        assert {r.part: r.limit_s for r in rows}[part.name] is not None and end <= 420, part.name
    # The H100 times of the first run are marked as measured; the parts whose configurations changed since are not.
    assert measured_part(_part("doctor"), "H100", False) and measured_part(_part("gpu-tests"), "H100", False)
    assert not measured_part(_part("compile-residual-124m"), "H100", False) and not MEASURED["H200"]


def test_the_plan_for_an_h100_fits_and_names_the_commands_for_the_rest(capsys):
    assert headline.main(["--plan", "--device", "h100"]) == 0
    text = capsys.readouterr().out
    assert _expected_end(text) <= 420 and "'run': measured on an H100" in text
    assert "doctor                      45 s run" in text and "compile-residual-124m" in text
    commands = text.split("further commands of the same budget run them: ")[1].strip().split("; ")
    skipped = [name for c in commands for name in c.removeprefix("--parts ").split(",")]
    ran = {line.split()[0] for line in text.splitlines()[2:] if " s  " in line and "skipped" not in line}
    assert sorted(skipped + [p.name for p in PARTS if p.name in ran]) == sorted(p.name for p in PARTS)
    for command in commands:  # each of them fits the budget whole
        wanted = set(command.removeprefix("--parts ").split(","))
        rows, end = plan(list(PARTS), ESTIMATES["H100"], tiny=False, budget_s=420, wanted=wanted)
        assert end <= 420 and {r.part for r in rows if r.limit_s is not None} >= wanted


def test_the_parts_run_at_the_tiny_preset_as_the_command_runs_them(text_dir, cache_dir, tmp_path):
    """compile-residual-124m's own benchmarks.throughput command line, run in this process with compilation off
    (as --tiny does with TORCH_COMPILE_DISABLE in its children); then the hand-written loop on the same data.
    774m-accum and auto-batch-124m run the configurations the end-to-end --tiny test runs: their commands here."""
    args = headline.parse_args(["--tiny", "--data", str(text_dir), "--cache-dir", str(cache_dir)])
    accum = headline._throughput_cmd(_part("774m-accum"), args, 60, tmp_path, ESTIMATES["tiny"])
    assert accum[accum.index("--repeats") + 1] == "1" and accum[accum.index("--micro-batch-size") + 1] == "8"
    gpu = headline.parse_args([])
    accum = headline._throughput_cmd(_part("774m-accum"), gpu, 300, tmp_path, ESTIMATES["H100"])
    assert accum[accum.index("--repeats") + 1] == "3" and accum[accum.index("--micro-batch-size") + 1] == "16"
    assert accum[accum.index("--global-batch-size") + 1] == "64"  # micro-batch 16 x 4

    cmd = headline._throughput_cmd(_part("compile-residual-124m"), args, 60, tmp_path, ESTIMATES["tiny"])
    with torch.compiler.set_stance("force_eager"):
        assert throughput.main(cmd[3:]) == 0
        report = json.loads(next(tmp_path.glob("throughput-*.json")).read_text())
        settings = BenchSettings(**{k: v for k, v in report["settings"].items() if k not in ("repeats", "configs")})
        loop = run_config("torch-loop", settings, torch.device("cpu"), (8, 2))
    scoped = report["summary"]
    assert list(scoped) == ["gpuopt-bf16-compile", "gpuopt-bf16-compile-model", "gpuopt-bf16-compile-bf16res",
                            "gpuopt-bf16-compile-model-bf16res"]
    for entry in scoped.values():  # --tiny's micro-batch 8, accumulating to its global batch of 16
        assert entry["status"] == "ok" and (entry["micro_batch_size"], entry["accumulate_grad_batches"]) == (8, 2)
    losses = [e["first_loss"] for e in scoped.values()]
    assert max(losses) - min(losses) < 0.05  # the same model and batch, whatever the scope and residual dtype
    assert loop["status"] == "ok" and (loop["micro_batch_size"], loop["accumulate_grad_batches"]) == (8, 2)
    assert loop["first_batch_token_sum"] == scoped["gpuopt-bf16-compile"]["first_batch_token_sum"]
    assert loop["first_loss"] == pytest.approx(losses[0], abs=0.05)  # its own loss from the full logits
    assert loop["settings_by_hand"] == "no CUDA settings (CPU)" and loop["micro_batch_tried"] == []


def test_the_option_configurations_set_the_module_options_they_name():
    from benchmarks._configs import VARIANTS, lightning_parts

    settings = BenchSettings(preset="tiny", vocab_size=512, tokenizer_vocab_size=512, compile_mode="max-autotune")
    got = {n: (p.compile, p.compile_scope, p.residual_dtype, p.compile_mode)
           for n in ("gpuopt-bf16-compile", *VARIANTS) for p in [lightning_parts(n, settings)]}
    assert got == {
        "gpuopt-bf16-compile": (True, "block", "float32", None),  # None: --compile-mode's (settings.compile_mode)
        "gpuopt-bf16-compile-model": (True, "model", "float32", None),
        "gpuopt-bf16-compile-bf16res": (True, "block", "bfloat16", None),
        "gpuopt-bf16-compile-model-bf16res": (True, "model", "bfloat16", None),
        "gpuopt-bf16-compile-autotune": (True, "block", "float32", "max-autotune-no-cudagraphs"),
        "gpuopt-bf16-compile-cudagraphs": (True, "block", "float32", "reduce-overhead"),
    }
    assert not set(VARIANTS) & set(throughput.parse_args([]).configs.split(","))  # run by name only
