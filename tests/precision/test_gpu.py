"""GPU-only checks of the precision plugins (skipped without CUDA).

Not runnable on CPU: real FP8 tensor-core matmuls (``torch._scaled_mm`` on SM 8.9+) and the speed of a
compiled float8 step. The fp16 fallback is tested on CPU with a simulated capability check
(tests/precision/test_bf16.py); here it is checked on a real GPU that lacks bf16, when there is one.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from lightning_gpuopt.perf.device import read_device
from lightning_gpuopt.precision import BF16Precision, Float8Precision
from lightning_gpuopt.precision.float8_layers import convert_linears_to_float8, float8_config

CUDA = torch.cuda.is_available()


def sm89() -> bool:
    # Called when a test runs, not at import: collecting the whole suite must not initialise CUDA.
    return CUDA and torch.cuda.get_device_capability() >= (8, 9)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]


@pytest.mark.skipif("not sm89()", reason="float8 matmuls need compute capability >= 8.9")
def test_real_float8_matmul_close_to_bf16():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(64, 1024, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = model(x)
    report = convert_linears_to_float8(model, float8_config("tensorwise"), [], "tensorwise")
    assert all(reason is None for _, _, reason in report)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16
    rel = (out.float() - expected.float()).norm() / expected.float().norm()
    assert 0 < rel < 0.1  # FP8 rounding: not identical, but close
    assert list(model.state_dict()) == list(reference)


def _step_time(model: nn.Module, x: torch.Tensor, steps: int = 20) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    for i in range(steps + 5):
        if i == 5:
            torch.cuda.synchronize()
            start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


@pytest.mark.skipif("not sm89()", reason="float8 matmuls need compute capability >= 8.9")
def test_compiled_float8_step_not_slower_than_bf16_at_d4096():
    d = 4096
    torch.manual_seed(0)

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)).cuda()

    x = torch.randn(8192, d, device="cuda")
    bf16 = mlp()
    bf16.compile()
    fp8 = mlp()
    convert_linears_to_float8(fp8, float8_config("tensorwise"), "auto", "tensorwise")
    fp8.compile()
    t_bf16, t_fp8 = _step_time(bf16, x), _step_time(fp8, x)
    print(f"d={d}: bf16 {t_bf16 * 1e3:.2f} ms/step, float8 {t_fp8 * 1e3:.2f} ms/step")
    assert t_fp8 <= 1.05 * t_bf16


def test_bf16_precision_on_this_gpu():
    plugin = BF16Precision()
    plugin.bind(torch.device("cuda", 0), read_device("cuda:0"))
    expected = torch.bfloat16 if read_device("cuda:0").bf16 else torch.float16
    assert plugin.compute_dtype == expected and plugin.device == "cuda"
    assert (plugin.scaler is None) == (expected == torch.bfloat16)


@pytest.mark.skipif("sm89()", reason="checks the error raised on GPUs older than SM 8.9")
def test_float8_on_old_gpu_raises_naming_alternatives():
    with pytest.raises(RuntimeError, match="emulate=True.*BF16Precision"):
        Float8Precision().bind(torch.device("cuda", 0), read_device("cuda:0"))


@pytest.mark.skipif("not sm89()", reason="float8 matmuls need compute capability >= 8.9")
def test_the_timed_decision_costs_under_5_s_and_a_cached_one_nothing(tmp_path):
    from lightning_gpuopt.model import GPT, GPTConfig
    from lightning_gpuopt.precision.float8_layers import candidate_shapes
    from lightning_gpuopt.precision.float8_measure import measure_on_device

    with torch.device("meta"):
        model = GPT(GPTConfig.from_name("llama-1b"))
    tokens = 8 * 1024  # micro-batch 8
    counts = candidate_shapes(model, tokens)
    args = (counts, "tensorwise", "gemm", float8_config("tensorwise"), model.flops_per_token(1024) * tokens,
            torch.device("cuda"), read_device("cuda:0"))
    start = time.perf_counter()
    first = measure_on_device(*args, cache_root=tmp_path)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    again = measure_on_device(*args, cache_root=tmp_path)
    assert first_s < 5 and time.perf_counter() - start < 0.5 and again == first
    assert all(r.bf16_ms > 0 and r.float8_ms > 0 for r in first.shapes)
