"""Which training loaders resume mid-epoch exactly, and what ExactResume says about the others."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from _module_shapes import NanoGPTModule, shape_loader
from lightning_gpuopt.callbacks import ExactResume
from lightning_gpuopt.data import TextDataModule
from lightning_gpuopt.data.resumable import not_exact_reason
from lightning_gpuopt.model import GPTModule

NOT_RESUMABLE = "your dataloader is not resumable"


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(4)


def test_not_exact_reasons():
    data = TensorDataset(torch.zeros(8, 4))
    assert "restarts at the first sample" in not_exact_reason(DataLoader(data, batch_size=2))
    shuffled = not_exact_reason(DataLoader(data, batch_size=2, shuffle=True))
    assert "RandomSampler" in shuffled and "global RNG" in shuffled
    assert "iterable dataset Stream" in not_exact_reason(DataLoader(Stream()))
    assert "not a torch DataLoader" in not_exact_reason([1, 2])


def _trainer(tmp_path, max_steps, **kwargs):
    return pl.Trainer(
        accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[ExactResume(), ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=True)],
        **kwargs,
    )


def test_own_loader_is_named_once_as_not_exact(tmp_path):
    with pytest.warns(UserWarning, match=r"ExactResume: the data order of NanoGPTModule's training loader is not resumed") as record:
        trainer = _trainer(tmp_path, 3)
        trainer.fit(NanoGPTModule(), shape_loader("nanogpt", batch_size=2, n=32))
    (message,) = [str(w.message) for w in record if "ExactResume: the data order" in str(w.message)]
    assert "RandomSampler" not in message and "restarts at the first sample of the epoch" in message
    assert "TextDataModule" in message and "every_n_epochs=1" in message
    # resumed mid-epoch: Lightning's own warning is right here, and stays
    with pytest.warns(UserWarning) as record:
        _trainer(tmp_path, 5).fit(NanoGPTModule(), shape_loader("nanogpt", batch_size=2, n=32), ckpt_path="last")
    assert any(NOT_RESUMABLE in str(w.message) for w in record)


def test_text_datamodule_resume_has_no_wrong_warning(tmp_path, text_dir, cache_dir):
    def data():
        return TextDataModule(source=str(text_dir), block_size=16, batch_size=2, vocab_size=300, num_workers=0,
                              samples_per_epoch=40)

    module = lambda: GPTModule(n_layer=1, n_head=2, n_embd=32, vocab_size=320, warmup_steps=1)  # noqa: E731
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _trainer(tmp_path, 3).fit(module(), datamodule=data())
        _trainer(tmp_path, 5).fit(module(), datamodule=data(), ckpt_path="last")
    messages = [str(w.message) for w in record]
    assert not any(NOT_RESUMABLE in m or "ExactResume: the data order" in m for m in messages), messages
    assert not any("You're resuming" in str(f[1].pattern if f[1] else "") for f in warnings.filters)  # filter removed
