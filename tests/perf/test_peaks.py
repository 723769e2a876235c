"""Peak FLOP/s lookup from the names the NVIDIA driver really reports."""

import pytest
import torch

from lightning_gpuopt.perf.peaks import GPU_PEAKS, find_gpu, peak_flops

# (driver name, table entry, dense bf16-or-fp16 TFLOP/s, dense fp8 TFLOP/s)
REAL_NAMES = [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4, 1978.9),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.0, 1513.0),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5, 1670.5),
    ("NVIDIA H200", "H200 SXM", 989.4, 1978.9),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5, 1670.5),
    ("NVIDIA A100-SXM4-80GB", "A100", 312.0, None),
    ("NVIDIA A100-SXM4-40GB", "A100", 312.0, None),
    ("NVIDIA A100-PCIE-40GB", "A100", 312.0, None),
    ("NVIDIA A100 80GB PCIe", "A100", 312.0, None),
    ("NVIDIA L40S", "L40S", 362.05, 733.0),
    ("NVIDIA L4", "L4", 121.0, 242.5),
    ("Tesla T4", "T4", 65.0, None),
    ("Tesla V100-SXM2-16GB", "V100 SXM2", 125.0, None),
    ("Tesla V100-PCIE-32GB", "V100 PCIe", 112.0, None),
    ("NVIDIA A10G", "A10G", 70.0, None),
    ("NVIDIA A10", "A10", 125.0, None),
    ("NVIDIA GeForce RTX 4090", "RTX 4090", 165.2, 330.3),
    ("NVIDIA GeForce RTX 3090", "RTX 3090", 71.0, None),
    ("NVIDIA B200", "B200", 2250.0, 4500.0),
]


@pytest.mark.parametrize(("driver_name", "entry", "half", "fp8"), REAL_NAMES)
def test_real_driver_names(driver_name, entry, half, fp8):
    gpu = find_gpu(driver_name)
    assert gpu is not None and gpu.name == entry
    assert peak_flops(driver_name, torch.bfloat16) == pytest.approx(half * 1e12)
    if fp8 is None:
        assert peak_flops(driver_name, "fp8") is None
    else:
        assert peak_flops(driver_name, torch.float8_e4m3fn) == pytest.approx(fp8 * 1e12)


def test_tf32_and_fp32_peaks():
    assert peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == pytest.approx(156e12)
    assert peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == pytest.approx(19.5e12)
    assert peak_flops("NVIDIA H100 80GB HBM3", "tf32") == pytest.approx(494.7e12)
    # No TF32 on Volta/Turing; fp64 is never tabulated.
    assert peak_flops("Tesla T4", "tf32") is None
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.float64) is None


def test_not_confused_with_neighbours():
    assert find_gpu("NVIDIA L40").name == "L40"  # not L4 (Lightning maps L40S to L4)
    assert find_gpu("NVIDIA GeForce RTX 3090 Ti") is None  # a different card, not the 3090
    assert find_gpu("NVIDIA GH200 480GB").name == "H200 SXM"
    assert find_gpu("AMD Instinct MI300X") is None
    assert peak_flops("Some Future GPU", torch.bfloat16) is None


def test_table_is_dense_and_ordered():
    for gpu in GPU_PEAKS.values():
        assert gpu.source
        values = [v for v in (gpu.fp32, gpu.tf32, gpu.fp16, gpu.fp8) if v is not None]
        assert values == sorted(values), gpu.name  # lower precision never slower
        if gpu.bf16 is not None:
            assert gpu.bf16 == gpu.fp16


def test_unknown_dtype_raises():
    with pytest.raises(ValueError, match="fp32"):
        peak_flops("NVIDIA H100 PCIe", "int4")
