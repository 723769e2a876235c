"""The generation batch from the device's memory: the arithmetic for an H100 (run on any machine), a CPU's fixed
batch, and a model too large to generate with."""

import pytest

from lightning_gpuopt.model import GPTConfig
from lightning_gpuopt.generation.memory import CPU_ROWS, generation_batch_size
from lightning_gpuopt.perf.device import REFERENCE_DEVICES
from lightning_gpuopt.perf.units import GiB


def test_h100_batch_is_the_most_rows_that_fit_with_the_margin():
    config = GPTConfig.from_name("124m", vocab_size=50304, block_size=1024)
    h100 = REFERENCE_DEVICES["H100 SXM"]
    weights = 124_000_000 * 4
    mem = generation_batch_size(config, h100, weight_bytes=weights, dtype_bytes=2)
    kv = 2 * 12 * 1024 * 768 * 2  # keys and values, 12 layers, 1024 positions, width 768, bf16: 36 MiB a row
    assert mem.kv_per_row == kv
    usable = 0.9 * 80 * GiB - 1 * GiB  # 10% and the CUDA context kept free
    assert mem.fixed + mem.rows * mem.per_row <= usable < mem.fixed + (mem.rows + 1) * mem.per_row
    assert 1850 < mem.rows < 1950  # ~68 GiB (after weights, a 3 GiB prefill, the margin) of 37 MiB rows
    assert "36.0 MiB (1024 positions x 12 layers x 768 x 2 x 2 bytes) of 80.0 GiB on NVIDIA H100 80GB HBM3" in mem.reason
    fp32 = generation_batch_size(config, h100, weight_bytes=weights, dtype_bytes=4)
    assert fp32.rows < mem.rows / 1.9  # float32 caches: half the rows
    few = generation_batch_size(config, h100, weight_bytes=weights, dtype_bytes=2, most_rows=300)
    assert few.rows == 300 and f"300 rows, of {mem.rows} that fit" in few.reason


def test_a_grouped_query_cache_holds_the_key_value_heads_only():
    """Llama 3.1 8B's shape at 8,192 tokens: 8 key/value heads of 128, so 1 GiB of bf16 cache a row, not the 4 GiB
    n_embd=4096 would give; about 53 rows on an H100 (13 before)."""
    config = GPTConfig.from_name("llama-8b")
    mem = generation_batch_size(config, REFERENCE_DEVICES["H100 SXM"], weight_bytes=8_030_000_000 * 2, dtype_bytes=2)
    assert mem.kv_per_row == 2 * 32 * 8192 * (8 * 128) * 2 == GiB
    assert 50 <= mem.rows <= 54 and "(8192 positions x 32 layers x 1024 x 2 x 2 bytes)" in mem.reason


def test_a_cpu_gets_a_fixed_batch_and_says_so():
    config = GPTConfig.from_name("tiny", vocab_size=300, block_size=32)
    mem = generation_batch_size(config, REFERENCE_DEVICES["cpu"], weight_bytes=10**6, dtype_bytes=4)
    assert mem.rows == CPU_ROWS and "cpu: no device memory to size the batch from" in mem.reason
    assert generation_batch_size(config, REFERENCE_DEVICES["cpu"], 10**6, 4, most_rows=5).rows == 5


def test_a_model_that_leaves_no_room_is_refused():
    config = GPTConfig.from_name("1.5b", vocab_size=50304, block_size=1024)
    with pytest.raises(ValueError, match=r"Generation does not fit on cuda:0 Tesla T4 .*load the weights in bf16 \(--trainer.precision bf16-true\)"):
        generation_batch_size(config, REFERENCE_DEVICES["T4"], weight_bytes=1_560_000_000 * 4 * 2, dtype_bytes=4)
