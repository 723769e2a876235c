"""``python -m benchmarks.headline``: its plan for a GPU, its parts' limits, the whole command at the tiny preset."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest
import torch

from benchmarks import headline
from benchmarks._headline_plan import ESTIMATES, GPU_TEST_FILES, GRACE_S, PARTS, estimate_family, part_estimate, plan
from benchmarks._headline_report import headline_rows
from lightning_gpuopt.perf.device import REFERENCE_DEVICES, DeviceFacts
from tests._paths import REPO

FILES = {"headline.json", "headline.md", "headline.png", "gpu-tests.xml", "headline.log"}
FIRST = "doctor,throughput-124m,loss-bench,generation,gpu-tests,throughput-774m,auto-batch-124m,fp8-rowwise-124m"  # the end-to-end --tiny run


def _expected_end(stdout: str) -> float:
    return float(re.search(r"expected end: (\d+) s of the (\d+) s budget", stdout).group(1))


@pytest.mark.parametrize("device", ["h100", "h200"])
def test_the_plan_for_an_h100_or_h200_fits_seven_minutes_and_further_commands_run_the_rest(device, capsys, tmp_path):
    assert headline.main(["--plan", "--device", device, "--out", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    basis = "'run': measured on an H100" if device == "h100" else "estimates, not yet measured on this GPU"
    assert basis in text and _expected_end(text) <= 420
    assert not (tmp_path / "out").exists()  # --plan only prints
    facts = REFERENCE_DEVICES["H100 SXM" if device == "h100" else "H200"]
    estimates = ESTIMATES[estimate_family(facts, tiny=False)[0]]
    rows, end = plan(list(PARTS), estimates, tiny=False, budget_s=420)
    ran = {r.part: r for r in rows if r.limit_s is not None}
    # The parts of most value run first, the gpu tests among them.
    assert list(ran)[:5] == ["device", "doctor", "throughput-124m", "loss-bench", "gpu-tests"]
    assert end <= 420 and all(r.start_s + r.limit_s <= 420 - GRACE_S for r in ran.values())
    late = [r.part for r in rows if r.limit_s is None]
    commands = headline.later_commands(late, estimates, False, 420)
    assert f"further commands of the same budget run them: {'; '.join('--parts ' + ','.join(c) for c in commands)}" \
        in text
    assert sorted(p for c in commands for p in c) == sorted(late)  # every part runs in one of them
    for command in commands:  # each fits the same budget whole
        rows, end = plan(list(PARTS), estimates, tiny=False, budget_s=420, wanted=set(command))
        assert [r.part for r in rows if r.limit_s is not None] == ["device", *command] and end <= 420


def test_estimates_name_every_part_and_an_unknown_gpu_borrows_the_h100s():
    for family, estimates in ESTIMATES.items():
        assert all(part_estimate(p, estimates, family == "tiny") > 0 for p in PARTS)
    a100 = REFERENCE_DEVICES["A100"]
    no_row = "no time estimates for NVIDIA A100-SXM4-80GB: the H100's are used"
    assert estimate_family(a100, tiny=False) == ("H100", no_row)
    assert estimate_family(DeviceFacts("cuda", "NVIDIA H100 PCIe", (9, 0)), tiny=False) == ("H100", None)
    assert estimate_family(a100, tiny=True) == ("tiny", None)


def test_the_gpu_test_list_names_every_file_with_a_gpu_test():
    gpu = re.compile(r"^(@pytest\.mark\.gpu\b|pytestmark = .*\bpytest\.mark\.gpu\b)", re.M)
    marked = {p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py") if gpu.search(p.read_text())}
    assert set(GPU_TEST_FILES) == marked, "add the new file to GPU_TEST_FILES in benchmarks/_headline_plan.py"


def test_bad_options_are_refused_before_any_work(tmp_path):
    cases = [(["--device", "h100"], "add --plan"), (["--parts", "doctor,speed"], r"unknown names \['speed'\]"),
             (["--time-budget", "0"], "--time-budget must be a positive"), (["--plan"], "No CUDA GPU here"),
             (["--tiny", "--micro-batch-size", "0"], "--micro-batch-size must be >= 1"),
             (["--plan", "--device", "h100", "--time-budget", "inf"], "positive, finite number"),
             (["--parts", " , "], "--parts names no part"),
             (["--parts", "throughput124m"], "for 'throughput124m' did you mean 'throughput-124m'")]
    for argv, message in cases:
        with pytest.raises(ValueError, match=message):
            headline.main([*argv, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_an_out_folder_that_cannot_be_written_is_refused_before_the_plan(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(headline.OptionError, match=r"--out='.*a-file/out' cannot be written \(Not a directory"):
        headline.main(["--tiny", "--out", str(tmp_path / "a-file" / "out")])
    assert "Plan for" not in capsys.readouterr().out  # refused before anything, the plan included


def test_a_part_past_its_limit_is_interrupted_then_killed_with_its_whole_group(tmp_path):
    # Like pytest: on SIGINT it writes its results and exits; its own child (a loader, a compile worker) goes too.
    code = ("import signal, subprocess, sys, time, pathlib\n"
            "def done(*_):\n"
            f"    pathlib.Path({str(tmp_path / 'xml')!r}).write_text('written'); sys.exit(2)\n"
            "signal.signal(signal.SIGINT, done if sys.argv[1] == 'polite' else signal.SIG_IGN)\n"
            "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"pathlib.Path({str(tmp_path / 'kid')!r}).write_text(str(kid.pid))\n"
            "print('started', flush=True); time.sleep(60)\n")
    env = dict(os.environ)
    began = time.monotonic()
    polite = headline.run_child([sys.executable, "-c", code, "polite"], limit_s=2, env=env, grace_s=5)
    assert polite.stopped and polite.returncode is None and "started" in polite.output
    assert (tmp_path / "xml").read_text() == "written"
    deaf = headline.run_child([sys.executable, "-c", code, "deaf"], limit_s=1, env=env, grace_s=0.5)
    assert deaf.stopped and time.monotonic() - began < 20  # killed after its grace, not after 60 s
    kid = int((tmp_path / "kid").read_text())
    for _ in range(50):  # the grandchild was killed with its group (and reaped by init)
        try:
            os.kill(kid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"grandchild {kid} still runs")
    ok = headline.run_child([sys.executable, "-c", "print(6 * 7)"], limit_s=30, env=env)
    assert (ok.returncode, ok.stopped, ok.output) == (0, False, "42\n")


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_kill_9_of_the_command_takes_its_running_part_with_it(tmp_path):
    """A part runs in a session of its own (so a stop reaches its whole group); a SIGKILL of the command, which runs
    no finally, used to leave it running on, reparented to init."""
    pid_file = tmp_path / "part.pid"
    part = f"import os, pathlib, time; pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid())); time.sleep(60)"
    command = (f"import os, sys; sys.path.insert(0, {str(REPO)!r}); from benchmarks import headline; "
               f"headline.run_child([sys.executable, '-c', {part!r}], limit_s=60, env=dict(os.environ))")
    parent = subprocess.Popen([sys.executable, "-c", command])
    for _ in range(300):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    parent.kill()
    parent.wait()
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the part {pid} still ran after a kill -9 of the command")


def test_headline_rows_compare_with_the_baseline_and_float8_with_its_bf16_twin():
    def part(preset, recipe, **rates):
        summary = {n.replace("_", "-"): {"status": "ok", "tokens_per_s": v, "micro_batch_size": 8,
                                         "accumulate_grad_batches": 1, "tflops": 1.0, "mfu": 0.4, "mfu_measured": 0.5,
                                         "peak_memory_gb": 9.0, "warmup_s": [30.0], "search_s": None}
                   for n, v in rates.items()}
        settings = {"preset": preset, "fp8_recipe": recipe}
        return {"kind": "throughput", "result": {"settings": settings, "summary": summary}}

    parts = {"b": part("124m", "tensorwise", baseline=100, gpuopt_bf16_compile=400, gpuopt_fp8_compile=480),
             "d": part("774m", "tensorwise", gpuopt_bf16_compile=90, gpuopt_fp8_compile=117),
             "e": part("124m", "rowwise", gpuopt_fp8_compile=440), "doctor": {"kind": "doctor", "result": {}}}
    rows = {(r["part"], r["config"]): r for r in headline_rows(parts)}
    assert rows[("b", "gpuopt-bf16-compile")]["vs_baseline"] == pytest.approx(4.0)
    assert rows[("b", "gpuopt-fp8-compile (tensorwise)")]["fp8_vs_bf16"] == pytest.approx(1.2)
    assert rows[("d", "gpuopt-fp8-compile (tensorwise)")]["fp8_vs_bf16"] == pytest.approx(1.3)  # its own preset's bf16
    assert rows[("d", "gpuopt-bf16-compile")]["vs_baseline"] is None  # no 774m baseline
    assert rows[("e", "gpuopt-fp8-compile (rowwise)")]["fp8_vs_bf16"] == pytest.approx(1.1)  # 124m bf16 of part b


def test_a_budget_too_small_runs_only_the_device_facts_and_says_why(tmp_path, capsys):
    out = tmp_path / "out"
    assert headline.main(["--tiny", "--time-budget", "5", "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"headline.json", "headline.md", "headline.log"}  # nothing to chart
    report = json.loads((out / "headline.json").read_text())
    assert report["complete"] is True and report["parts"]["device"]["status"] == "ok"
    assert report["device"]["type"] == "cpu" and report["device"]["versions"]["torch"] == torch.__version__
    for name in [p.name for p in PARTS[1:]]:
        entry = report["parts"][name]
        assert entry["status"] == "skipped" and re.fullmatch(r"needs ~\d+ s \(estimate\), \d s of the budget left",
                                                             entry["reason"]), entry
    assert report["headline"] == []
    assert "| doctor | 10 | - | - | - | skipped: needs ~10 s" in (out / "headline.md").read_text()
    assert capsys.readouterr().out.startswith("Plan for cpu (--tiny")


@pytest.mark.slow
def test_the_command_at_the_tiny_preset_runs_every_part_and_writes_its_files(text_dir, cache_dir, tmp_path):
    # The real command line in a fresh process; a wandb that records its import (the GPU machine has none).
    fake = tmp_path / "fake" / "wandb"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import os\nopen(os.environ['WANDB_IMPORTED'], 'a').write('imported')\n"
                                      "raise ImportError('the headline command must not import wandb')\n")
    out, mark = tmp_path / "out", tmp_path / "wandb-imported"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), str(REPO)]), "WANDB_IMPORTED": str(mark)}
    # The parts of the step's options run in tests/benchmarks/test_headline_parts.py, in its own process.
    cmd = [sys.executable, "-m", "benchmarks.headline", "--tiny", "--time-budget", "280", "--out", str(out),
           "--data", str(text_dir), "--cache-dir", str(cache_dir), "--parts", FIRST]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=290)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not mark.exists()
    assert done.stdout.startswith("Plan for cpu (--tiny") and "# Headline figures: cpu" in done.stdout

    assert {p.name for p in out.iterdir()} == FILES and all(p.stat().st_size < 16 * 2**20 for p in out.iterdir())
    report = json.loads((out / "headline.json").read_text())
    assert report["complete"] is True and report["tiny"] is True and report["estimates"]["family"] == "tiny"
    assert list(report["parts"]) == [p.name for p in PARTS]
    asked = ["device", *FIRST.split(",")]
    assert {n: p["status"] for n, p in report["parts"].items()} == {
        p.name: "ok" if p.name in asked else "skipped" for p in PARTS}, report["parts"]
    doctor = {c["name"]: c for c in report["parts"]["doctor"]["result"]["checks"]}
    assert doctor["torch_compile"]["status"] == "info"  # --tiny: TORCH_COMPILE_DISABLE=1, said, not probed

    rows = [(r["part"], r["config"], r["status"]) for r in report["headline"]]
    assert rows == [
        ("throughput-124m", "baseline", "ok"), ("throughput-124m", "lightning-bf16", "ok"),
        ("throughput-124m", "gpuopt-bf16-compile", "ok"), ("throughput-124m", "gpuopt-fp8-compile (tensorwise)", "ok"),
        ("throughput-774m", "gpuopt-bf16-compile", "ok"), ("throughput-774m", "gpuopt-fp8-compile (tensorwise)", "ok"),
        ("auto-batch-124m", "gpuopt-bf16-compile-auto", "ok"), ("auto-batch-124m", "torch-loop", "ok"),
        ("fp8-rowwise-124m", "gpuopt-fp8-compile (rowwise)", "ok"),
    ]
    auto = report["headline"][6]
    assert auto["auto_batch"]["micro_batch_size"] == 8 and auto["accumulate_grad_batches"] == 2 and auto["search_s"] > 0
    assert report["headline"][0]["vs_baseline"] == pytest.approx(1.0)
    loss = report["parts"]["loss-bench"]["result"]["rows"]
    assert loss["chunked"]["status"] == "ok" and loss["liger"]["status"] == "skipped"

    generation = report["parts"]["generation"]["result"]
    assert [r["config"] for r in generation["results"]] == ["sequential", "continuous", "transformers"]
    assert all(r["answer_tokens_per_sec"] > 0 for r in generation["results"])
    assert generation["results"][2]["vs_transformers"] == pytest.approx(1.0)

    tests = report["parts"]["gpu-tests"]["result"]
    xml = ET.parse(out / "gpu-tests.xml").getroot()
    assert tests["tests"] == len(list(xml.iter("testcase"))) >= 10 and tests["failed"] == []
    assert len(tests["skipped"]) == tests["tests"]  # no GPU here: each gpu test skips, with its reason
    assert all("CUDA" in s["message"] or "compute capability" in s["message"] for s in tests["skipped"])

    md = (out / "headline.md").read_text()
    assert "Smoke run (`--tiny`)" in md and "| tiny | `baseline` | 8 x 2 |" in md  # accumulating to 16
    assert "| gpu-tests |" in md and "AutoBatchSize (tiny): chose micro-batch 8 x 2" in md
    assert "## Generation: 16 rows" in md and "| `transformers` | 4 |" in md
    assert "## Loss microbenchmark" in md
    assert (out / "headline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out / "headline.log").read_text()
    assert all(f"== {p}: python -m " in text for p in FIRST.split(","))
