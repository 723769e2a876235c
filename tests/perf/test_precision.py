"""The dtype matmuls run in under each precision plugin: Lightning's, ours, and a custom one."""

from __future__ import annotations

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

from lightning_gpuopt.perf.precision import compute_dtype_name


def test_compute_dtype_of_precision_plugins(monkeypatch):
    assert compute_dtype_name(MixedPrecision("bf16-mixed", "cuda")) == "bf16"
    assert compute_dtype_name(MixedPrecision("16-mixed", "cuda")) == "fp16"
    assert compute_dtype_name(HalfPrecision("bf16-true")) == "bf16"
    torch.set_float32_matmul_precision("highest")
    assert compute_dtype_name(Precision()) == "fp32"
    torch.set_float32_matmul_precision("high")
    assert compute_dtype_name(Precision()) == "tf32"

    class Ours(Precision):
        compute_dtype = torch.bfloat16

    class OurFloat8(Precision):
        compute_dtype = torch.bfloat16
        fp8 = True

    class Custom(Precision):
        pass

    assert compute_dtype_name(Ours()) == "bf16"
    assert compute_dtype_name(OurFloat8()) == "fp8"
    assert compute_dtype_name(Custom()) is None  # not silently fp32
