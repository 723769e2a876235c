"""AutoBatchSize on a real GPU (skipped without CUDA): the chosen micro-batch trains and fills the memory."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_gpuopt.callbacks import AutoBatchSize
from lightning_gpuopt.plugins import BF16Precision
from tests._auto_batch_helpers import TokenData
from lightning_gpuopt.model import GPTModule

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_chosen_micro_batch_trains_and_uses_most_of_the_memory():
    torch.cuda.empty_cache()
    # 5040 has many divisors, so the largest that fits is close to the memory limit.
    search = AutoBatchSize(global_batch_size=5040, memory_margin=0.1)
    module = GPTModule(preset="124m", vocab_size=256, block_size=1024, warmup_steps=1)
    data = TokenData(batch_size=1, n=6000, block=1024)
    trainer = pl.Trainer(
        accelerator="cuda", devices=1, max_steps=1, plugins=[BF16Precision()], callbacks=[search],
        logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, datamodule=data)
    total = torch.cuda.get_device_properties(0).total_memory
    peak = torch.cuda.max_memory_reserved()
    assert trainer.global_step == 1
    assert search.micro_batch_size * search.accumulate_grad_batches == 5040
    assert 0.8 <= peak / total <= 0.95, (search.micro_batch_size, peak / total)
