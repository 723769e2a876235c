"""SDPA backends as plain functions: the kernel for a shape, the auto order off CUDA, the settings-table row."""

from __future__ import annotations

import types

import torch

from lightning_gpuopt.perf.sdpa import SDPA_BACKENDS, apply_auto_sdpa_order, attention_kernel, attention_row


def test_cpu_kernel_is_one_of_ours():
    assert attention_kernel(torch.device("cpu"), head_dim=64, seq_len=128, dtype=torch.float32) in SDPA_BACKENDS


def test_auto_order_leaves_cpu_alone():
    before = list(torch._C._get_sdp_priority_order())
    row = apply_auto_sdpa_order(torch.device("cpu"))
    assert row == ("sdpa_backends", "auto", "left as PyTorch orders them: no CUDA device")
    assert list(torch._C._get_sdp_priority_order()) == before


def test_attention_row_reads_the_model_shape_and_the_plugin_dtype():
    module = types.SimpleNamespace(config=types.SimpleNamespace(head_size=32, block_size=64, n_head=4, dropout=0.0))
    name, kernel, text = attention_row(module, "bf16", torch.device("cpu"))
    assert name == "attention_kernel" and kernel in SDPA_BACKENDS
    assert text == "what SDPA runs for the model's head dim 32, T 64, bfloat16, causal"
    _, _, assumed = attention_row(object(), "bf16", torch.device("cpu"))
    assert assumed == "what SDPA runs for an assumed head dim 64, T 1024, bfloat16, causal"
