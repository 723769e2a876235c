"""Byte units: one home, two named values, and the messages say which they divide by."""

from __future__ import annotations

import pytest
import torch

from lightning_gpuopt.model.config import GPTConfig
from lightning_gpuopt.model.gpt import GPT
from lightning_gpuopt.perf.units import GB, GiB, MiB
from lightning_gpuopt.checkpoint.safety import disk_full_error
from lightning_gpuopt.strategies.choose import choose_strategy


def test_units_are_the_binary_and_decimal_values():
    assert (GiB, MiB, GB) == (1024**3, 1024**2, 1_000_000_000)


def test_strategy_reason_prints_decimal_gigabytes():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=32))
    _, reason = choose_strategy(model, devices=1, device_memory=80 * GB, micro_batch=1, block_size=32)
    assert "budget: 68.0 GB per device (85% of GPU (80.0 GB))" in reason


def test_disk_full_message_prints_decimal_gigabytes(tmp_path):
    err = disk_full_error(tmp_path / "last.ckpt", needed_bytes=3 * GB)
    assert "needs ~3.00 GB" in str(err)


@pytest.mark.parametrize("value", [GiB, GB])
def test_units_are_ints(value):
    assert isinstance(value, int)
