"""AutoBatchSize under torch.compile: the search and training together compile the model at most twice."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch._dynamo.utils import counters

from lightning_gpuopt.callbacks import AutoBatchSize
from tests.callbacks.auto_batch._helpers import OOMAbove, TokenData


@pytest.fixture
def fresh_dynamo():
    torch.compiler.reset()
    counters.clear()
    yield
    torch.compiler.reset()
    counters.clear()


@pytest.mark.parametrize("scope", ["block", pytest.param("model", marks=pytest.mark.extended)])  # block: the default
def test_search_and_training_compile_at_most_twice(fresh_dynamo, scope, tmp_path):
    search = AutoBatchSize(global_batch_size=16, max_micro_batch_size=16)
    module = OOMAbove(limit=4, compile=True, compile_scope=scope)  # trials 1, 2, 4 fit; 8 runs out
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=3, limit_val_batches=0, callbacks=[search], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=TokenData(batch_size=16))
    assert search.micro_batch_size == 4 and [t.micro_batch_size for t in search.trials] == [1, 2, 4, 8]
    assert trainer.global_step == 3
    # Dynamo's own count of graphs it compiled: the model (or its blocks) twice, at micro-batch 1
    # (static) and 2 (dynamic batch, reused by the trial at 4 and by training), plus one dynamic graph
    # for the loss's per-chunk kernel. Before, the search ended with torch.compiler.reset() and
    # training compiled a third time.
    assert counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])


def test_a_tuned_compile_is_asked_through_the_protocol_not_hparams():
    """AutoBatchSize drops the trial graphs only for a module that says it compiled in a tuning mode."""
    import lightning.pytorch as pl

    from lightning_gpuopt import GPTModule
    from lightning_gpuopt.callbacks.auto_batch.trial import _tuned_compile
    from lightning_gpuopt.protocols import CompilesItself

    module = GPTModule(preset="tiny", vocab_size=320, block_size=32, compile=True, compile_mode="max-autotune")
    assert isinstance(module, CompilesItself) and not _tuned_compile(module)  # asked, not compiled yet
    module.compile_mode_in_use = "max-autotune"
    assert _tuned_compile(module)
    module.compile_mode_in_use = "default"
    assert not _tuned_compile(module)

    class SaysTunedInHparams(pl.LightningModule):  # hparams alone no longer count
        def __init__(self):
            super().__init__()
            self.save_hyperparameters({"compile": True, "compile_mode": "max-autotune"})

    assert not _tuned_compile(SaysTunedInHparams())
