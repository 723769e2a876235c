"""AutoBatchSize on a real GPU (skipped without CUDA): the chosen micro-batch trains and fills the memory."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_gpuopt.callbacks import AutoBatchSize
from lightning_gpuopt.model import GPTModule
from lightning_gpuopt.precision import BF16Precision
from tests.callbacks.auto_batch._helpers import TokenData

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_chosen_micro_batch_trains_and_uses_most_of_the_memory():
    torch.cuda.empty_cache()
    # The micro-batch must divide the global batch. 720720 = lcm(1..16) has a divisor every few percent
    # around the ~200 sequences that fit (180, 182, 195, 198, 208, 210, ...), so the largest one that fits
    # is close to the limit; 5040's divisors jump 17% there (180 -> 210), too coarse for an 80% bound.
    search = AutoBatchSize(global_batch_size=720720, memory_margin=0.1)
    module = GPTModule(preset="124m", vocab_size=256, block_size=1024, warmup_steps=1)
    data = TokenData(batch_size=1, n=6000, block=1024)
    trainer = pl.Trainer(
        # Two micro-batches end the (limited) epoch, and Lightning steps the optimizer at the end of an epoch.
        accelerator="cuda", devices=1, max_steps=1, limit_train_batches=2, plugins=[BF16Precision()],
        callbacks=[search], logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, datamodule=data)
    total = torch.cuda.get_device_properties(0).total_memory
    peak = torch.cuda.max_memory_reserved()  # of training: the search resets the peak when it ends
    micro = search.micro_batch_size
    assert trainer.global_step == 1
    assert micro * search.accumulate_grad_batches == 720720
    larger = [t for t in search.trials if t.micro_batch_size > micro]
    assert larger and not any(t.fits for t in larger), search.trials  # the next size up was tried and did not fit
    assert 0.8 <= peak / total <= 0.95, (micro, peak / total, search.trials)
