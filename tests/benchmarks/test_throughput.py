"""The throughput benchmark (``python -m benchmarks.throughput``): real CPU runs at the tiny preset, and its arithmetic."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import throughput
from benchmarks._configs import BenchSettings, skip_reason
from benchmarks._report import check_targets, device_slug, summarise
from benchmarks._runners import run_config
from benchmarks._timing import step_stats

FIXED = ["baseline", "lightning-bf16", "gpuopt-bf16"]


def _argv(text_dir, cache_dir, out, configs, *extra):
    # A 384-token BPE: the tiny corpus fills ~351 of them (a larger one leaves rows no token uses, and warns).
    return [
        "--preset", "tiny", "--block-size", "32", "--micro-batch-size", "8", "--global-batch-size", "16",
        "--steps", "3", "--warmup-steps", "1", "--tokenizer-vocab-size", "384", "--num-workers", "0",
        "--data", str(text_dir), "--cache-dir", str(cache_dir), "--out", str(out), "--configs", ",".join(configs),
        *extra,
    ]


def _load(out):
    return json.loads((out / "throughput-tiny-T32.json").read_text())


def test_cpu_run_writes_results_for_every_configuration(text_dir, cache_dir, tmp_path):
    out = tmp_path / "results"
    configs = [*FIXED, "gpuopt-fp8-compile-auto"]
    status = throughput.main(_argv(text_dir, cache_dir, out, configs, "--repeats", "2"))
    assert status == 0
    report = _load(out)
    summary = report["summary"]
    assert list(summary) == configs  # nothing dropped, in the order asked for
    # FP8 needs SM >= 8.9: on CPU without --fp8-emulate it is reported as skipped, with the reason.
    fp8 = summary["gpuopt-fp8-compile-auto"]
    assert fp8["status"] == "skipped" and "compute capability >= 8.9" in fp8["reason"]

    for name in FIXED:
        entry = summary[name]
        assert entry["status"] == "ok", entry
        # A fixed micro-batch accumulates to the global batch (16 sequences), as AutoBatchSize's choice does.
        assert (entry["micro_batch_size"], entry["accumulate_grad_batches"]) == (8, 2)
        assert entry["tokens_per_step"] == 16 * 32
        assert entry["mfu"] is None and report["mfu_note"] == "no datasheet peak FLOP/s for a CPU"
        assert len(entry["tokens_per_s_repeats"]) == 2 and entry["repeat_spread_pct"] is not None
        runs = report["runs"][name]
        assert [r["repeat"] for r in runs] == [0, 1]
        for run in runs:
            assert len(run["step_times_s"]) == 3 and all(t > 0 for t in run["step_times_s"])
            # tokens/s counts every token of the measured steps over their total time.
            assert run["tokens_per_s"] == pytest.approx(3 * 16 * 32 / sum(run["step_times_s"]))
        assert entry["tokens_per_s"] == pytest.approx(sum(r["tokens_per_s"] for r in runs) / 2)
        assert entry["tflops"] == pytest.approx(entry["tokens_per_s"] * report["flops_per_token"] / 1e12)
        stats = entry["step_time"]
        assert stats["min_ms"] <= stats["median_ms"] <= stats["max_ms"]
        assert entry["speedup_vs_baseline"] == pytest.approx(entry["tokens_per_s"] / summary["baseline"]["tokens_per_s"])
    assert summary["baseline"]["speedup_vs_baseline"] == pytest.approx(1.0)

    # Every configuration built the same model from the same seed and read the same first batch.
    sums = {summary[n]["first_batch_token_sum"] for n in FIXED}
    assert len(sums) == 1
    losses = [summary[n]["first_loss"] for n in FIXED]
    assert max(losses) - min(losses) < 0.05  # fp32 vs bf16 autocast of the same forward
    assert losses[0] == pytest.approx(math.log(384), rel=0.05)  # an untrained model: about uniform

    # Second repeat runs in reverse order, so drift of the machine shows between repeats.
    assert throughput._run_order(configs, 1) == configs[::-1]

    # The vocabulary and the head's share of the FLOPs: 384 padded to 384; 6 x 384 x 64 of the FLOPs per token.
    vocab = report["vocabulary"]
    assert (vocab["model"], vocab["asked"], vocab["tokenizer"]) == (384, 384, 384)
    assert vocab["head_flops_share"] == pytest.approx(6 * 384 * 64 / report["flops_per_token"])
    env = report["environment"]
    assert env["device"] == "cpu" and env["torch"] == torch.__version__ and env["lightning"]
    assert env["command"].startswith("python -m benchmarks.throughput --preset tiny")
    md = (out / "throughput-tiny-T32.md").read_text()
    assert all(f"`{n}`" in md for n in configs) and "`gpuopt-fp8-compile-auto` skipped: float8 matmuls need" in md
    assert f"- vocabulary 384 (asked 384, padded to a multiple of 64; tokenizer 384); the output head is " \
           f"{vocab['head_flops_share']:.1%} of the training FLOPs" in md
    assert "| `gpuopt-fp8-compile-auto` | skipped |" in md
    assert (out / "throughput-tiny-T32.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_results_are_written_after_each_configuration(text_dir, cache_dir, tmp_path, monkeypatch):
    # A machine that stops a command after a fixed time: the configurations that finished are on disk.
    out = tmp_path / "results"
    real_run = throughput.run_config

    def stopped_in_second(name, *args):
        if name == "gpuopt-bf16":
            raise KeyboardInterrupt  # what the stop looks like from inside the process
        return real_run(name, *args)

    monkeypatch.setattr(throughput, "run_config", stopped_in_second)
    with pytest.raises(KeyboardInterrupt):
        throughput.main(_argv(text_dir, cache_dir, out, ["baseline", "gpuopt-bf16"], "--no-plot"))
    report = _load(out)
    assert report["complete"] is False
    assert list(report["summary"]) == ["baseline"] and report["summary"]["baseline"]["status"] == "ok"
    assert len(report["runs"]["baseline"][0]["step_times_s"]) == 3
    assert "partial results" in (out / "throughput-tiny-T32.md").read_text()


def test_time_budget_skips_configurations_that_would_start_late(text_dir, cache_dir, tmp_path):
    out = tmp_path / "results"
    # Tokenising alone takes longer than a microsecond: nothing may start, and each says why.
    assert throughput.main(_argv(text_dir, cache_dir, out, ["baseline", "gpuopt-bf16"], "--time-budget", "1e-6")) == 0
    report = _load(out)
    assert report["complete"] is True
    for name in ("baseline", "gpuopt-bf16"):
        entry = report["summary"][name]
        assert entry["status"] == "skipped" and "--time-budget=1e-06 s was spent" in entry["reason"]
    assert "partial results" not in (out / "throughput-tiny-T32.md").read_text()
    with pytest.raises(ValueError, match="--time-budget must be a positive"):
        throughput.main(_argv(text_dir, cache_dir, out, ["baseline"], "--time-budget", "0"))


@pytest.mark.extended  # compiles three models: 35 s warm, ~110 s on a fresh machine
def test_compiled_configurations_and_torch_loop_match_on_cpu(text_dir, cache_dir, tmp_path):
    out = tmp_path / "results"
    configs = ["baseline", "gpuopt-bf16-compile", "torch-loop"]
    assert throughput.main(_argv(text_dir, cache_dir, out, configs, "--no-plot")) == 0
    report = _load(out)
    summary = report["summary"]
    assert [summary[n]["status"] for n in configs] == ["ok"] * 3
    loop = summary["torch-loop"]
    # Without gpuopt-bf16-compile-auto in the run, the loop starts from the fixed micro-batch, accumulating to the
    # global batch, and says what to compare with.
    assert (loop["micro_batch_size"], loop["accumulate_grad_batches"], loop["tokens_per_step"]) == (8, 2, 512)
    assert "compare with gpuopt-bf16-compile" in loop["compare_with"]
    assert loop["first_batch_token_sum"] == summary["baseline"]["first_batch_token_sum"]
    assert loop["first_loss"] == pytest.approx(summary["gpuopt-bf16-compile"]["first_loss"], abs=0.02)
    assert not (out / "throughput-tiny-T32.png").exists()


@pytest.mark.extended  # compiles for every AutoBatchSize trial shape and for training: ~2-3 min on 2 cores
def test_auto_batch_configurations_and_the_torch_loop_that_follows_them_on_cpu(text_dir, cache_dir, tmp_path):
    out = tmp_path / "results"
    configs = ["baseline", "gpuopt-bf16-compile-auto", "gpuopt-fp8-compile-auto", "torch-loop"]
    argv = _argv(text_dir, cache_dir, out, configs, "--max-micro-batch-size", "8", "--fp8-emulate", "--no-plot",
                 "--profile-steps", "1")
    assert throughput.main(argv) == 0
    summary = _load(out)["summary"]
    assert [summary[n]["status"] for n in configs] == ["ok"] * 4
    for name in ("gpuopt-bf16-compile-auto", "gpuopt-fp8-compile-auto"):
        entry = summary[name]
        # No memory limit on CPU: the largest candidate <= 8 that divides the global batch of 16.
        assert (entry["micro_batch_size"], entry["accumulate_grad_batches"], entry["tokens_per_step"]) == (8, 2, 512)
        assert entry["auto_batch"]["trials"] == 4  # 1, 2, 4, 8
        assert entry["auto_batch"]["chosen_trial_reserved_gb"] is None  # no CUDA statistics
        assert entry["search_s"] and entry["search_s"][0] > 0
    loop = summary["torch-loop"]
    assert (loop["micro_batch_size"], loop["accumulate_grad_batches"], loop["tokens_per_step"]) == (8, 2, 512)
    assert "compare with it" in loop["compare_with"]
    assert all(summary[n]["profile"]["categories"]["matmul"]["ms_per_step"] > 0 for n in configs)
    sums = {summary[n]["first_batch_token_sum"] for n in configs}
    assert len(sums) == 1  # every configuration read the same first micro-batch


def test_failed_configuration_is_recorded_not_raised(text_dir, cache_dir):
    settings = BenchSettings(preset="tiny", block_size=32, vocab_size=384, tokenizer_vocab_size=384, data=str(text_dir),
                             cache_dir=str(cache_dir), steps=2, warmup_steps=1, num_workers=0)
    # A real error inside the run (TextDataModule rejects a micro-batch of 0): recorded with its message.
    result = run_config("torch-loop", settings, torch.device("cpu"), (0, 1))
    assert result["status"] == "failed" and "batch_size must be an integer >= 1" in result["reason"]
    assert "Traceback" in result["traceback"]
    summary = summarise({"torch-loop": [result]}, 1e6, {"bf16": None, "fp8": None, "measured": None}, "cpu")
    assert summary["torch-loop"]["status"] == "failed"


def test_skip_reasons_on_cpu():
    cpu = torch.device("cpu")
    settings = BenchSettings(preset="tiny", block_size=32, vocab_size=512, tokenizer_vocab_size=512)
    assert skip_reason("baseline", settings, cpu) is None
    assert "compute capability >= 8.9" in skip_reason("gpuopt-fp8-compile-auto", settings, cpu)
    auto = skip_reason("gpuopt-bf16-compile-auto", settings, cpu)
    assert auto is not None and ("--max-micro-batch-size" in auto or "AutoBatchSize" in auto)
    with pytest.raises(ValueError, match="Unknown configuration"):
        skip_reason("fast", settings, cpu)


def test_bad_settings_raise_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="multiple of --micro-batch-size"):
        BenchSettings(micro_batch_size=8, global_batch_size=12)
    with pytest.raises(ValueError, match="--steps"):
        BenchSettings(steps=0)
    with pytest.raises(ValueError, match="unknown names"):
        throughput.main(["--configs", "baseline,turbo", "--out", str(tmp_path)])
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match=r"--out='.*a-file/out' cannot be written \(Not a directory"):
        throughput.main(["--preset", "tiny", "--no-plot", "--out", str(tmp_path / "a-file" / "out")])  # before the data


def test_step_stats_and_device_slug():
    stats = step_stats([0.1, 0.2, 0.1, 0.1, 0.1])
    assert stats["median_ms"] == pytest.approx(100.0)
    assert stats["mean_ms"] == pytest.approx(120.0)
    assert (stats["min_ms"], stats["max_ms"]) == (pytest.approx(100.0), pytest.approx(200.0))
    assert step_stats([])["median_ms"] is None
    assert device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert device_slug("cpu") == "cpu"


def _run(tokens_per_s, micro=8, accum=1):
    return {
        "status": "ok", "micro_batch_size": micro, "accumulate_grad_batches": accum, "tokens_per_step": 8192,
        "tokens_per_s": tokens_per_s, "step_times_s": [8192 / tokens_per_s] * 4, "peak_memory_gb": 10.0,
        "startup_s": 1.0, "search_s": None, "warmup_s": 2.0, "first_batch_token_sum": 1, "first_loss": 10.8,
    }


def test_summary_mfu_speedup_and_targets():
    runs = {
        "baseline": [_run(20e3), _run(22e3)],
        "gpuopt-bf16-compile-auto": [_run(100e3, 32, 2)],
        "gpuopt-fp8-compile-auto": [_run(120e3, 32, 2)],
        "torch-loop": [_run(104e3, 32, 2)],
        "lightning-bf16": [{"status": "skipped", "reason": "not asked"}],
    }
    flops = 5.203e9
    peaks = {"bf16": 989.4e12, "fp8": 1978.9e12, "measured": 750e12}
    summary = summarise(runs, flops, peaks, None)
    base = summary["baseline"]
    assert base["tokens_per_s"] == pytest.approx(21e3)
    assert base["repeat_spread_pct"] == pytest.approx(100 * 2e3 / 21e3)
    auto = summary["gpuopt-bf16-compile-auto"]
    assert auto["mfu"] == pytest.approx(100e3 * flops / 989.4e12)  # 52.6%
    assert auto["mfu_measured"] == pytest.approx(100e3 * flops / 750e12)
    assert auto["speedup_vs_baseline"] == pytest.approx(100 / 21)
    assert summary["gpuopt-fp8-compile-auto"]["mfu_fp8"] == pytest.approx(120e3 * flops / 1978.9e12)
    assert summary["lightning-bf16"] == {"description": summary["lightning-bf16"]["description"], "repeats": 1,
                                         "status": "skipped", "reason": "not asked"}
    targets = {t["target"]: t for t in check_targets(summary, "774m")}
    assert targets["gpuopt-bf16-compile-auto >= 4x baseline tokens/s"]["met"] is True
    mfu = targets["best gpuopt bf16 configuration (gpuopt-bf16-compile-auto) MFU >= 50% at 774m"]
    assert mfu["value"] == pytest.approx(auto["mfu"]) and mfu["met"] is True  # 52.6% >= 50%
    assert targets["gpuopt-fp8-compile-auto >= 1.15x gpuopt-bf16-compile-auto tokens/s at 774m"]["met"] is True
    loop = targets["torch-loop at most 3% faster than the best gpuopt bf16 configuration (gpuopt-bf16-compile-auto)"]
    assert loop["met"] is False and loop["value"] == pytest.approx(1.04)  # 4% faster
    # The best of the gpuopt bf16 configurations counts: a faster whole-model compile raises MFU and the bar.
    runs["gpuopt-bf16-compile-model"] = [_run(103e3, 64, 1)]
    targets = {t["target"]: t for t in check_targets(summarise(runs, flops, peaks, None), "124m")}
    best = "best gpuopt bf16 configuration (gpuopt-bf16-compile-model)"
    assert targets[f"{best} MFU >= 45% at 124m"]["value"] == pytest.approx(103e3 * flops / 989.4e12)
    assert targets[f"torch-loop at most 3% faster than the {best}"]["met"] is True  # 104 / 103: 1% faster


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_run_reports_memory_and_mfu(text_dir, cache_dir, tmp_path):
    out = tmp_path / "results"
    assert throughput.main(_argv(text_dir, cache_dir, out, ["baseline", "gpuopt-bf16"], "--no-plot")) == 0
    report = _load(out)
    assert report["environment"]["device"] == torch.cuda.get_device_name()
    assert report["peaks"]["measured"] > 1e12
    for name in ("baseline", "gpuopt-bf16"):
        entry = report["summary"][name]
        assert entry["status"] == "ok" and entry["peak_memory_gb"] > 0
        assert entry["mfu_measured"] == pytest.approx(entry["tflops"] * 1e12 / report["peaks"]["measured"])
        if report["peaks"]["bf16"] is not None:
            assert 0 < entry["mfu"] < 1


def test_help_speaks_of_the_users_machine_and_out(capsys):
    with pytest.raises(SystemExit):
        throughput.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "../shared" not in text and "shared/data" not in text and "benchmark-results/<device-slug>" in "".join(text.split())
