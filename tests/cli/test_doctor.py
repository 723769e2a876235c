"""`gpuopt doctor`: every check present, the JSON the same as the table, exit status 1 on a failed check."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lightning_gpuopt.cli.main import main
from lightning_gpuopt.cli.doctor import (
    Check,
    apply_cuda_settings,
    compile_check,
    device_checks,
    exit_code,
    float8_checks,
    format_table,
    gpu_differences,
    run_checks,
    settings_checks,
    start_compile_probe,
    train_step_checks,
)
from lightning_gpuopt.model.config import GPTConfig
from lightning_gpuopt.perf.device import REFERENCE_DEVICES
from tests._paths import REPO

CPU_CHECKS = [
    "device", "peak_flops", "versions", "extra.flash_attn", "extra.liger_kernel", "extra.triton", "cuda_settings",
    "attention_kernel", "float8_layers", "float8_device", "torch_compile", "train_steps.micro_batch_2",
    "train_steps.micro_batch_8", "on_gpu", "on_gpu.precision", "on_gpu.optimizer", "on_gpu.attention",
    "on_gpu.float8", "on_gpu.cuda_settings", "on_gpu.mfu",
]
H100, V100, CPU = REFERENCE_DEVICES["H100 SXM"], REFERENCE_DEVICES["V100"], REFERENCE_DEVICES["cpu"]


def _printed(stdout: str) -> dict[str, str]:
    """``{check name: status}`` from the printed table (fix lines and the header/footer left out)."""
    rows = {}
    for line in stdout.splitlines()[1:-1]:
        name, _, rest = line.partition("  ")
        if name.strip():
            rows[name.strip()] = rest.split()[0]
    return rows


def _assert_report(checks: list[dict], stdout: str) -> None:
    assert [c["name"] for c in checks] == CPU_CHECKS
    assert all(set(c) == {"name", "status", "detail", "fix"} and c["detail"] for c in checks)
    assert _printed(stdout) == {c["name"]: c["status"] for c in checks}
    assert all(c["fix"] for c in checks if c["status"] == "fail")


@pytest.mark.slow
def test_a_compiler_that_is_missing_fails_the_compile_check_and_the_exit_status(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CXX", "/nonexistent/g++")  # what a machine without its C++ compiler looks like to inductor
    out = tmp_path / "out.json"
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    with pytest.raises(SystemExit) as exit_info:
        main(["doctor", "--json", str(out), "--steps", "1"])
    assert exit_info.value.code == 1
    report = json.loads(out.read_text())
    _assert_report(report["checks"], capsys.readouterr().out)
    assert report["exit_code"] == 1
    by_name = {c["name"]: c for c in report["checks"]}
    assert [c["name"] for c in report["checks"] if c["status"] == "fail"] == ["torch_compile"]
    assert "/nonexistent/g++" in by_name["torch_compile"]["detail"] and "apt install g++" in by_name["torch_compile"]["fix"]
    assert "tokens/s" in by_name["train_steps.micro_batch_8"]["detail"]
    assert torch.backends.cuda.matmul.allow_tf32 == tf32_before  # CUDASettings' flags put back


@pytest.mark.slow
def test_gpuopt_doctor_as_a_command(tmp_path):
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "lightning_gpuopt", "doctor", "--json", str(out), "--steps", "1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    _assert_report(report["checks"], done.stdout)
    assert report["exit_code"] == 0 and {c["status"] for c in report["checks"]} <= {"pass", "info"}
    assert {c["name"]: c["status"] for c in report["checks"]}["torch_compile"] == "pass"


def test_exit_status_is_one_exactly_when_a_check_failed():
    info, passed, failed = Check("a", "info", "x"), Check("b", "pass", "y"), Check("c", "fail", "z", "do w")
    assert exit_code([info, passed]) == 0 and exit_code([info, failed, passed]) == 1
    table = format_table([passed, failed])
    assert "fix: do w" in table and table.endswith("1 passed, 1 failed, 0 for information")
    with pytest.raises(ValueError, match="Check.status"):
        Check("d", "ok", "nope")  # type: ignore[arg-type]


def test_a_compile_past_its_time_limit_fails_and_is_stopped():
    probe = start_compile_probe(CPU)
    check = compile_check(probe, CPU, timeout_s=0)
    assert check.status == "fail" and "did not finish in 0 s" in check.detail and "--model.compile false" in check.fix
    assert probe.process.returncode is not None  # killed, not left running


def test_under_torch_compile_disable_the_compile_check_says_so_and_probes_nothing(monkeypatch):
    # A probe would run eagerly and pass: "compiled (inductor)" would be untrue.
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    started = []
    monkeypatch.setattr("lightning_gpuopt.cli.doctor.start_compile_probe", lambda facts: started.append(facts))
    checks = {c.name: c for c in run_checks(steps=1)}
    check = checks["torch_compile"]
    assert (check.status, started) == ("info", [])
    assert "TORCH_COMPILE_DISABLE=1" in check.detail and "unset TORCH_COMPILE_DISABLE" in check.fix
    assert list(checks) == CPU_CHECKS and checks["train_steps.micro_batch_8"].status == "pass"


def test_device_checks_read_the_datasheet_peaks_of_a_known_gpu():
    checks = {c.name: c for c in device_checks(H100)}
    assert checks["peak_flops"].status == "pass" and "bf16 989.4" in checks["peak_flops"].detail
    assert "fp8 1978.9" in checks["peak_flops"].detail
    assert "bf16 yes, float8 yes, flash attention yes" in checks["device"].detail
    assert "bf16 no, float8 no" in {c.name: c for c in device_checks(V100)}["device"].detail
    assert {c.name: c for c in device_checks(CPU)}["peak_flops"].status == "info"


def test_an_unknown_gpus_peak_is_named_as_the_user_sets_it():
    """gpuopt doctor is a command: the fix is MFUMonitor's init_args in trainer.callbacks; from Python, the argument."""
    from lightning_gpuopt.option_checks import command_line_options
    from lightning_gpuopt.perf.device import DeviceFacts

    future = DeviceFacts("cuda", "NVIDIA Future GPU", (12, 0), None, None, 0)
    with command_line_options():
        fix = {c.name: c for c in device_checks(future)}["peak_flops"].fix
    assert fix == "set init_args.peak_flops of MFUMonitor in trainer.callbacks to its dense bf16 FLOP/s"
    assert {c.name: c for c in device_checks(future)}["peak_flops"].fix == "set MFUMonitor(peak_flops=...) to its dense bf16 FLOP/s"


def test_float8_layers_of_the_124m_model_on_an_h100_and_on_a_v100():
    config = GPTConfig.from_name("124m")
    layers, device = float8_checks(H100, config)
    # tensorwise 'auto' keeps out<=1024 layers (attn.c_proj, mlp.c_proj) and the tied head in bf16.
    assert "converts 24 of 49 projection layers" in layers.detail
    assert "transformer.h.*.attn.c_attn (768x2304)" in layers.detail and "c_proj" not in layers.detail
    assert device.status == "pass"
    assert float8_checks(V100, config)[1].status == "info" and "emulate=True" in float8_checks(V100, config)[1].detail


def test_float8_timing_table_of_the_124m_model_from_injected_timings(tmp_path):
    from lightning_gpuopt.precision.float8_decision import ShapeTiming

    class Timer:  # float8 pays on the MLP's c_fc (768 x 3072) only
        def shape(self, shape):
            return ShapeTiming(1.0, 0.5 if shape[2] == 3072 else 1.1)

        def ceiling(self):
            return 400e12

    layers, _, timing = float8_checks(H100, GPTConfig.from_name("124m"), timer=Timer(), cache_root=tmp_path)
    assert "converts 12 of 49" in layers.detail and "mlp.c_fc (768x3072)" in layers.detail
    assert timing.name == "float8_timing" and "8192 tokens per micro-batch of 8" in timing.detail
    assert "768x3072: bf16 1.000 ms, float8 0.500 ms, converted" in timing.detail
    assert "768x2304: bf16 1.000 ms, float8 1.100 ms, not converted" in timing.detail
    # the head inside GPTModule's chunked loss, timed too (this timer has no loss_head: its shape timing)
    assert "768x50304 (loss head): bf16 1.000 ms, float8 1.100 ms, not converted" in timing.detail


def test_float8_layers_count_the_loss_head_where_its_timing_converts_it(tmp_path):
    from lightning_gpuopt.precision.float8_decision import ShapeTiming

    class Timer:  # float8 pays on the head inside the chunked loss only
        def shape(self, shape):
            return ShapeTiming(1.0, 1.1)

        def loss_head(self, shape, chunks):
            return ShapeTiming(4.0, 1.0)

        def ceiling(self):
            return 400e12

    layers, _, timing = float8_checks(H100, GPTConfig.from_name("124m"), timer=Timer(), cache_root=tmp_path)
    assert "768x50304 (loss head): bf16 4.000 ms, float8 1.000 ms, converted" in timing.detail
    assert "converts 1 of 49" in layers.detail and "lm_head (768x50304)" in layers.detail  # as the plugin's table
    assert not layers.fix  # no "converted none ... trains in bf16" advice


def test_settings_checks_fail_only_a_setting_that_was_not_applied():
    rows = [("tf32", "True", "applied"), ("expandable_segments", "True", "not applied: CUDA was already initialised")]
    checks = settings_checks(H100, rows)
    assert [(c.name, c.status) for c in checks] == [("cuda_settings.tf32", "pass"), ("cuda_settings.expandable_segments", "fail")]
    assert "before anything allocates CUDA memory" in checks[1].fix
    assert [c.status for c in settings_checks(CPU, rows)] == ["info"]


def test_the_settings_rows_come_from_the_device_facts_so_a_gpu_shows_tf32():
    """The callback fills its report only at a fit's setup; the doctor reads its rows from the device's facts."""
    settings, restore = apply_cuda_settings()
    try:
        checks = {c.name: c for c in settings_checks(H100, settings.rows_for(H100))}
    finally:
        restore()
    assert list(checks) == ["cuda_settings.expandable_segments", "cuda_settings.tf32", "cuda_settings.matmul_precision",
                            "cuda_settings.cudnn_benchmark", "cuda_settings.sdpa_backends"]
    assert checks["cuda_settings.tf32"].status == "pass" and checks["cuda_settings.tf32"].detail.startswith("True: ")
    assert "priority cudnn,flash" in checks["cuda_settings.sdpa_backends"].detail


def test_what_a_gpu_would_change_follows_its_facts():
    h100 = {c.name: c.detail for c in gpu_differences(CPU, H100)}
    assert "bf16 autocast" in h100["on_gpu.precision"] and "989.4" in h100["on_gpu.precision"]
    assert "fused AdamW" in h100["on_gpu.optimizer"] and "priority cudnn,flash" in h100["on_gpu.attention"]
    assert "tf32=True" in h100["on_gpu.cuda_settings"] and "1978.9" in h100["on_gpu.float8"]
    v100 = {c.name: c.detail for c in gpu_differences(CPU, V100)}
    assert "fp16 autocast instead of bf16" in v100["on_gpu.precision"] and "GradScaler" in v100["on_gpu.precision"]
    assert "memory-efficient" in v100["on_gpu.attention"] and "only emulates" in v100["on_gpu.float8"]


def test_train_steps_measure_tokens_per_second():
    config = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    before = torch.random.get_rng_state()
    (check,) = train_step_checks(CPU, config, [4], steps=2)
    assert check.status == "pass" and "2 steps of 4 x 16 tokens, float32" in check.detail  # the stack on a CPU
    assert float(check.detail.split(" tokens/s")[0].replace(",", "")) > 0
    assert torch.equal(torch.random.get_rng_state(), before)  # the doctor's seed does not leak


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_doctor_on_a_gpu_applies_the_settings_and_measures_mfu_and_memory():
    from lightning_gpuopt.cli.doctor import run_checks

    checks = {c.name: c for c in run_checks(steps=2)}
    assert checks["cuda_settings.tf32"].status == "pass" and checks["torch_compile"].status == "pass"
    assert "on_gpu" not in checks and checks["attention_kernel"].status == "pass"
    for batch in (8, 16):
        detail = checks[f"train_steps.micro_batch_{batch}"].detail
        assert "peak memory" in detail and ("TFLOP/s, MFU" in detail or "no datasheet peak" in detail), detail


@pytest.mark.parametrize("where", ["folder", "unwritable"])
def test_a_json_path_that_cannot_be_written_is_refused_before_the_checks(where, tmp_path, monkeypatch, capsys):
    """The checks take minutes on a CPU; the file is written at the end, so it is checked first."""
    import lightning_gpuopt.cli.doctor as doctor

    monkeypatch.setattr(doctor, "run_checks", lambda **kw: pytest.fail("the checks ran before the refusal"))
    path = tmp_path if where == "folder" else "/proc/self/doctor.json"  # root writes any folder it may, not these
    with pytest.raises(SystemExit) as info:
        main(["doctor", "--json", str(path)])
    assert info.value.code == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith(f"gpuopt doctor: error: --json='{path}' ")
    assert said.endswith("the checks are written there at the end. Give a file in a folder you can write, --json PATH.")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file locks")
def test_a_json_file_another_doctor_writes_is_refused_naming_its_pid(tmp_path, capsys):
    """One writer per output: the lock a running doctor holds on its --json file (taken here, as a second open of it
    is refused in one process too) stops a second one before its checks."""
    from lightning_gpuopt.run import hold_output

    path = tmp_path / "doctor.json"
    with hold_output(path, "gpuopt doctor", "--json"):
        with pytest.raises(SystemExit) as info:
            main(["doctor", "--json", str(path)])
    assert info.value.code == 2
    said = capsys.readouterr().err
    assert f"{path} is being written by another gpuopt doctor (pid {os.getpid()} on " in said
    assert "or give this run another --json" in said and len(said.strip().splitlines()) <= 3
    assert "lines" not in said and "overwriting" not in said  # a JSON file written whole; doctor has no overwrite
    assert not path.exists() and not list(tmp_path.iterdir())  # nothing written, the lock file gone with its holder
