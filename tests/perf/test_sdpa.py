"""SDPA backends as plain functions: the auto order and the Flash skip from device facts, the kernel for a shape, the table row."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from lightning_gpuopt.perf.device import REFERENCE_DEVICES, DeviceFacts
from lightning_gpuopt.perf.sdpa import (
    CUDNN_FIRST_ORDER,
    SDPA_BACKENDS,
    attention_kernel,
    attention_row,
    auto_sdpa_order,
    flash_skipped,
    set_sdpa_priority,
)

_LEFT = "left as PyTorch orders them"
AUTO_ORDER = {  # reference device -> what sdpa_backends="auto" does there
    "H100 SXM": (CUDNN_FIRST_ORDER, "priority cudnn,flash,efficient,math (compute capability 9.0)"),
    "H200": (CUDNN_FIRST_ORDER, "priority cudnn,flash,efficient,math (compute capability 9.0)"),
    "A100": (None, f"{_LEFT} (compute capability 8.0)"),
    "L4": (None, f"{_LEFT} (compute capability 8.9)"),
    "V100": (None, f"{_LEFT} (compute capability 7.0)"),
    "T4": (None, f"{_LEFT} (compute capability 7.5)"),
    "cpu": (None, f"{_LEFT}: no CUDA device"),
}
FLASH_SKIPPED = {"H100 SXM": False, "H200": False, "A100": False, "L4": False, "V100": True, "T4": True, "cpu": False}


@pytest.mark.parametrize("name", sorted(REFERENCE_DEVICES))
def test_auto_order_on_reference_devices(name):
    assert auto_sdpa_order(REFERENCE_DEVICES[name]) == AUTO_ORDER[name]


def test_auto_order_needs_a_recent_cudnn_and_covers_blackwell():
    old_cudnn = dataclasses.replace(REFERENCE_DEVICES["H100 SXM"], cudnn_version=90100)
    assert auto_sdpa_order(old_cudnn) == (None, f"{_LEFT} (cuDNN 90100 < 91500)")
    b200 = DeviceFacts("cuda", "NVIDIA B200", (10, 0), None, 91500, 0)
    assert auto_sdpa_order(b200)[0] == CUDNN_FIRST_ORDER


@pytest.mark.parametrize("name", sorted(REFERENCE_DEVICES))
def test_flash_skipped_below_compute_capability_8(name):
    facts = REFERENCE_DEVICES[name]
    assert flash_skipped(facts, ["flash", "math"]) is FLASH_SKIPPED[name]
    assert flash_skipped(facts, ["efficient", "math"]) is False  # not asked for, nothing skipped


def test_set_priority_puts_the_order_first_and_keeps_the_rest():
    before = list(torch._C._get_sdp_priority_order())
    enabled = torch.backends.cuda.flash_sdp_enabled()
    try:
        set_sdpa_priority(("math", "efficient"))
        now = list(torch._C._get_sdp_priority_order())
        assert now[:2] == [0, 2]  # SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION
        assert sorted(now) == sorted(before) and torch.backends.cuda.flash_sdp_enabled() == enabled
    finally:
        torch._C._set_sdp_priority_order(before)


def test_cpu_kernel_is_one_of_ours():
    assert attention_kernel(torch.device("cpu"), head_dim=64, seq_len=128, dtype=torch.float32) in SDPA_BACKENDS


def test_attention_row_reads_the_model_shape_and_the_plugin_dtype():
    module = types.SimpleNamespace(config=types.SimpleNamespace(head_size=32, block_size=64, n_head=4, dropout=0.0))
    name, kernel, text = attention_row(module, "bf16", torch.device("cpu"))
    assert name == "attention_kernel" and kernel in SDPA_BACKENDS
    assert text == "what SDPA runs for the model's head dim 32, T 64, bfloat16, causal"
    _, _, assumed = attention_row(object(), "bf16", torch.device("cpu"))
    assert assumed == "what SDPA runs for an assumed head dim 64, T 1024, bfloat16, causal"
