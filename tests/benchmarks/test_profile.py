"""The benchmark's profile of the steps after the measured ones: categories, idle time, and a real CPU profile."""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import throughput
from benchmarks._profile import StepProfiler, _union_us, categorise, summarise_profile
from lightning_gpuopt.model import GPT, GPTConfig


def test_kernel_and_operator_names_fall_into_categories():
    assert categorise("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "matmul"
    assert categorise("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT") == "matmul"
    assert categorise("aten::addmm") == "matmul" and categorise("aten::mm") == "matmul"
    assert categorise("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>") == "attention"
    assert categorise("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert categorise("void at::native::(anonymous namespace)::fused_adam_kernel<float>") == "optimizer"
    assert categorise("triton_per_fused_native_layer_norm_0") == "norm"
    assert categorise("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "communication"
    assert categorise("Memcpy HtoD (Pageable -> Device)") == "memcpy"
    assert categorise("triton_poi_fused_add_gelu_1") == "other"


def test_union_of_kernel_intervals_counts_overlaps_once():
    assert _union_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert _union_us([]) == 0


def test_summary_of_a_real_cpu_profile():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=512, block_size=32))
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randint(0, 512, (4, 32))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            model.loss(model(x), x).backward()
            optimizer.step()
            optimizer.zero_grad()
    summary = summarise_profile(prof, steps=2, device=torch.device("cpu"), top=100)  # every operator
    assert summary["source"] == "CPU operators" and summary["idle_pct"] is None
    categories = summary["categories"]
    assert {"matmul", "attention", "norm"} <= set(categories)
    assert sum(c["pct"] for c in categories.values()) == pytest.approx(100)
    assert sum(c["ms_per_step"] for c in categories.values()) == pytest.approx(summary["busy_ms_per_step"])
    top = summary["top"]
    assert len(top) > 5 and [t[1] for t in top] == sorted((t[1] for t in top), reverse=True)
    assert sum(t[1] for t in top) == pytest.approx(summary["busy_ms_per_step"])  # all of them
    mm = next(t for t in summary["top"] if t[0] == "aten::mm")
    # 9 linears (4 per block x 2 blocks, and the head): 2 matmuls each in backward, and the bias-free
    # head's forward (the others run addmm forward).
    assert mm[3] == 19
    # By default the 30 longest (a GPU step has ~20 kernels worth naming; the ten kept before hid the rest).
    assert summarise_profile(prof, steps=2, device=torch.device("cpu"))["top"] == top[:30] and len(top) > 30


def test_profiler_window_and_a_summary_that_fails(monkeypatch):
    def broken(*args, **kwargs):
        raise AttributeError("'FunctionEventAvg' object has no attribute 'self_device_time_total'")

    monkeypatch.setattr("benchmarks._profile.summarise_profile", broken)
    profiler = StepProfiler(torch.device("cpu"), first_step=2, steps=1)
    for done in range(1, 5):
        torch.ones(8) @ torch.ones(8)
        profiler.tick(done)
    assert profiler.summary == {"steps": 1, "error": "AttributeError: 'FunctionEventAvg' object has no attribute "
                                "'self_device_time_total'"}
    off = StepProfiler(torch.device("cpu"), first_step=0, steps=0)
    off.tick(0)
    assert off.summary is None and off._prof is None


def test_benchmark_profiles_after_the_measured_steps(text_dir, cache_dir, tmp_path):
    out = tmp_path / "results"
    argv = [
        "--preset", "tiny", "--block-size", "32", "--micro-batch-size", "8", "--global-batch-size", "16",
        "--steps", "3", "--warmup-steps", "1", "--tokenizer-vocab-size", "384", "--num-workers", "0",
        "--data", str(text_dir), "--cache-dir", str(cache_dir), "--out", str(out), "--configs", "baseline",
        "--profile-steps", "2", "--no-plot",
    ]
    assert throughput.main(argv) == 0
    report = json.loads((out / "throughput-tiny-T32.json").read_text())
    run = report["runs"]["baseline"][0]
    assert len(run["step_times_s"]) == 3  # the profiled steps are not measured
    prof = report["summary"]["baseline"]["profile"]
    assert prof["steps"] == 2 and prof["source"] == "CPU operators" and "matmul" in prof["categories"]
    assert report["settings"]["profile_steps"] == 2
    md = (out / "throughput-tiny-T32.md").read_text()
    assert "## Profiles" in md and "- `baseline` (CPU operators): busy" in md
    with pytest.raises(ValueError, match="--profile-steps"):
        throughput.main([*argv[:-3], "--profile-steps", "-1"])


class _Row:
    """What the profiler gives for one kernel or operator (FunctionEventAvg / FunctionEvent), for the CUDA path."""

    def __init__(self, key, device_type, us, count=1, start=0.0, annotation=False, self_cpu=0.0):
        self.key, self.device_type, self.count, self.is_user_annotation = key, device_type, count, annotation
        self.self_device_time_total, self.self_cpu_time_total = us, self_cpu
        self.time_range = type("Interval", (), {"start": start, "end": start + us})()


class _FakeCudaProfile:
    def __init__(self, rows):
        self.rows = rows

    def key_averages(self):
        return self.rows

    def events(self):
        return self.rows


def test_cuda_summary_counts_kernels_not_annotations_or_operators():
    from torch.autograd import DeviceType

    cuda, cpu = DeviceType.CUDA, DeviceType.CPU
    prof = _FakeCudaProfile([
        _Row("sm90_xmma_gemm_bf16bf16_bf16f32", cuda, 600.0, count=4, start=0.0),
        _Row("flash_fwd_kernel", cuda, 200.0, count=2, start=700.0),
        _Row("triton_poi_fused_add_0", cuda, 100.0, count=2, start=900.0),
        # An annotation spanning all of it and the CPU operator that launched the gemm: neither is kernel time.
        _Row("Optimizer.step#AdamW.step", cuda, 1000.0, start=0.0, annotation=True),
        _Row("aten::mm", cpu, 600.0, count=4, self_cpu=50.0),
    ])
    summary = summarise_profile(prof, steps=2, device=torch.device("cuda"))
    assert summary["source"] == "CUDA kernels"
    assert summary["busy_ms_per_step"] == pytest.approx(0.45)  # 900 us over 2 steps
    assert {c: v["pct"] for c, v in summary["categories"].items()} == pytest.approx(
        {"matmul": 600 / 9, "attention": 200 / 9, "other": 100 / 9}
    )
    assert summary["idle_pct"] == pytest.approx(10.0)  # 900 us of kernels in a 1000 us span: the gap 600-700
    assert [t[0] for t in summary["top"]] == ["sm90_xmma_gemm_bf16bf16_bf16f32", "flash_fwd_kernel", "triton_poi_fused_add_0"]
    assert summary["top"][0][3] == 2  # 4 calls over 2 steps
