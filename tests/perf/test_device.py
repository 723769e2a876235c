"""Device facts: the reference devices' capabilities, and reading this machine's device."""

import pytest
import torch

from lightning_gpuopt.perf.device import REFERENCE_DEVICES, DeviceFacts, read_device

# name -> (bf16, fp8, flash attention, fused AdamW, bf16 peak TFLOP/s)
EXPECTED = {
    "H100 SXM": (True, True, True, True, 989.4),
    "H200": (True, True, True, True, 989.4),
    "A100": (True, False, True, True, 312.0),
    "L4": (True, True, True, True, 121.0),
    "V100": (False, False, False, True, None),
    "T4": (False, False, False, True, None),
    "cpu": (True, False, False, False, None),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_reference_device_facts(name):
    facts = REFERENCE_DEVICES[name]
    got = (facts.bf16, facts.fp8, facts.flash_attention, facts.fused_adamw, facts.peak_tflops("bf16"))
    assert got == EXPECTED[name]


def test_every_reference_device_is_expected():
    assert set(REFERENCE_DEVICES) == set(EXPECTED)


def test_read_cpu_device():
    facts = read_device(torch.device("cpu"))
    assert facts == DeviceFacts("cpu", "cpu")
    assert facts.describe() == "cpu"


def test_read_default_device_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the default device is a GPU")
    assert read_device().type == "cpu"


def test_describe_names_capability_and_memory():
    assert REFERENCE_DEVICES["V100"].describe() == "cuda:0 Tesla V100-SXM2-16GB (compute capability 7.0, 16.0 GiB)"


def test_unknown_gpu_has_no_peaks_but_capabilities():
    facts = DeviceFacts("cuda", "NVIDIA Future GPU", (12, 0), None, None, 0)
    assert facts.peaks is None and facts.peak_tflops("bf16") is None
    assert facts.bf16 and facts.fp8 and facts.flash_attention
