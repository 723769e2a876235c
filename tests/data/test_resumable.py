"""Which training loaders resume mid-epoch exactly (TextDataModule's, and a module's own sequential or
shuffled DataLoader that ExactResume rebuilds around an EpochSampler), and what it says about the others."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

from lightning_gpuopt.callbacks import ExactResume
from lightning_gpuopt.data import TextDataModule
from lightning_gpuopt.data.resumable import not_exact_reason
from lightning_gpuopt.model import GPTModule
from tests._module_shapes import NanoGPTModule, shape_loader

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
        callbacks=[ExactResume(rebuild_loaders=True), ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=True)],
        **kwargs,
    )


def _weighted_loader():
    dataset = shape_loader("nanogpt", n=32).dataset
    return DataLoader(dataset, batch_size=2, sampler=WeightedRandomSampler(torch.ones(32), 32))


def test_a_loader_it_cannot_rebuild_is_named_once_as_not_exact(tmp_path):
    with pytest.warns(UserWarning, match=r"ExactResume: the data order of NanoGPTModule's training loader is not resumed") as record:
        trainer = _trainer(tmp_path, 3)
        trainer.fit(NanoGPTModule(), _weighted_loader())
    (message,) = [str(w.message) for w in record if "ExactResume: the data order" in str(w.message)]
    assert "DataLoader(WeightedRandomSampler) restarts at the first sample of the epoch" in message
    assert "rebuild_loaders=True" in message and "TextDataModule" in message and "every_n_epochs=1" in message
    # resumed mid-epoch: Lightning's own warning is right here, and stays
    with pytest.warns(UserWarning) as record:
        _trainer(tmp_path, 5).fit(NanoGPTModule(), _weighted_loader(), ckpt_path="last")
    assert any(NOT_RESUMABLE in str(w.message) for w in record)


class _TwoLoaders(NanoGPTModule):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch["a"], batch_idx) + super().training_step(batch["b"], batch_idx)


def test_several_loaders_are_named_once_as_not_rebuilt(tmp_path):
    dataset = shape_loader("nanogpt", n=16).dataset
    loaders = {"a": DataLoader(dataset, batch_size=2, shuffle=True), "b": DataLoader(dataset, batch_size=2)}
    with pytest.warns(UserWarning, match=r"ExactResume: the data order of _TwoLoaders's training loaders") as record:
        _trainer(tmp_path, 3).fit(_TwoLoaders(), loaders)
    (message,) = [str(w.message) for w in record if "ExactResume: the data order" in str(w.message)]
    assert "returns 2 loaders in a dict, which Lightning combines and ExactResume does not rebuild" in message
    assert "For an exact data order: return one DataLoader" in message
    assert "For an exact data order: ExactResume(rebuild_loaders=True)" not in message  # it is set already


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


class Losses(pl.Callback):
    def __init__(self):
        self.rows = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows[(trainer.current_epoch, batch_idx)] = float(outputs["loss"].detach())


def _own_fit(tmp_path, max_steps, shuffle, ckpt=None, num_workers=0, generator_seed=None):
    torch.manual_seed(0)
    module = NanoGPTModule()
    torch.manual_seed(1234)
    losses = Losses()
    generator = None if generator_seed is None else torch.Generator().manual_seed(generator_seed)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=max_steps, accumulate_grad_batches=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
        callbacks=[ExactResume(rebuild_loaders=True), losses, ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)],
    )
    loader = DataLoader(shape_loader("nanogpt", n=24).dataset, batch_size=2, shuffle=shuffle, num_workers=num_workers,
                        generator=generator)
    trainer.fit(module, loader, ckpt_path=ckpt)
    return losses.rows


@pytest.mark.parametrize(("shuffle", "workers", "seed"), [(False, 0, None), (True, 0, None), (True, 2, None), (True, 0, 42)])
def test_own_loader_resumes_exactly_mid_epoch_and_at_its_end(tmp_path, shuffle, workers, seed):
    reference = _own_fit(tmp_path / "ref", 9, shuffle, num_workers=workers, generator_seed=seed)  # 12 micro-batches per epoch, 2 per step
    assert len(reference) == 18
    for step, first in [(3, (0, 6)), (6, (1, 0))]:  # mid-epoch, and at the epoch's end
        ckpt = next((tmp_path / "ref" / "ckpt").glob(f"*step={step}.ckpt"))
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            resumed = _own_fit(tmp_path / f"resumed{step}", 9, shuffle, ckpt=str(ckpt), num_workers=workers,
                               generator_seed=seed)
        assert min(resumed) == first
        assert resumed == {k: v for k, v in reference.items() if k >= first}
        assert not any(NOT_RESUMABLE in str(w.message) or "ExactResume: the data order" in str(w.message) for w in record)


@pytest.mark.filterwarnings("ignore:The dirpath has changed")
def test_own_loader_generator_seeds_the_rebuilt_order(tmp_path):
    """The rebuilt order follows the seed of the user's generator (the sampler's before the loader's), not the
    global seed; a resume keeps the checkpoint's seed and says so when the generator's now differs."""
    dataset = TensorDataset(torch.arange(16))

    def order(seed, sampler_seed=None, ckpt=None, root="a"):
        seen = []

        class Record(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                seen.extend(batch[0].tolist())

        if sampler_seed is None:
            loader = DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed))
        else:
            sampler = torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(sampler_seed))
            loader = DataLoader(dataset, batch_size=4, sampler=sampler, generator=torch.Generator().manual_seed(seed))
        torch.manual_seed(7)
        trainer = pl.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=tmp_path / root,
                             callbacks=[ExactResume(rebuild_loaders=True), Record(),
                                        ModelCheckpoint(dirpath=tmp_path / root / "ckpt", every_n_train_steps=2, save_top_k=-1)])
        trainer.fit(_Identity(), loader, ckpt_path=ckpt)
        return seen

    first = order(42)
    assert sorted(first) == list(range(16))
    assert order(43) != first
    assert order(42, root="b") == first  # the same seed, the same order
    assert order(0, sampler_seed=42) == first  # the sampler's generator before the loader's
    ckpt = next((tmp_path / "a" / "ckpt").glob("*step=2.ckpt"))
    with pytest.warns(UserWarning, match=r"generator is seeded 43 but the checkpoint's data order was seeded 42"):
        assert order(43, ckpt=str(ckpt), root="c") == first[8:]  # the checkpoint's order, from its position


class _Identity(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(16, 16)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0].float().unsqueeze(1).expand(-1, 16)).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_without_permission_an_own_loader_is_left_alone_and_named(tmp_path):
    loader = shape_loader("nanogpt", batch_size=2, n=32)
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[ExactResume()])
    with pytest.warns(UserWarning, match=r"SequentialSampler\) restarts .*ExactResume\(rebuild_loaders=True\)"):
        trainer.fit(NanoGPTModule(), loader)
    assert trainer.train_dataloader is loader


def test_own_loader_resumes_exactly_under_two_process_ddp(tmp_path):
    """The rebuilt loader shards like DistributedSampler: each rank of a resumed 2-process run trains on the
    same samples in the same order, with the same losses, as in the uninterrupted run (mid-epoch resume)."""
    import json
    import os
    import subprocess
    import sys

    from tests._paths import SCRIPTS

    script = SCRIPTS / "ddp_own_loader_resume.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for run in runs:
        reference, resumed = run["reference"], run["resumed"]
        assert len(reference) == 16 and min(resumed, key=lambda k: tuple(map(int, k.split(",")))) == "0,6"
        assert resumed == {k: v for k, v in reference.items() if k in resumed} and len(resumed) == 10
    samples = [[x for k, (_, s) in sorted(run["reference"].items()) if k.startswith("0,") for x in s] for run in runs]
    assert len(samples[0]) == len(samples[1]) == 20  # 40 samples, 20 per rank per epoch
    assert samples[0] != samples[1]  # sharded: the ranks read different samples
    # ... and together the whole dataset once, although each rank's loader had its own generator seed
    from tests._module_shapes import Tokens

    assert sorted(samples[0] + samples[1]) == sorted(Tokens(40).data[:, 0].tolist())


def test_epoch_sampler_shards_like_distributed_sampler_and_starts_anywhere():
    from torch.utils.data import DistributedSampler

    from lightning_gpuopt.data.resumable import EpochSampler

    shards = [list(EpochSampler(10, shuffle=True, seed=3, epoch=1, num_replicas=3, rank=r)) for r in range(3)]
    assert [len(s) for s in shards] == [4, 4, 4]  # 10 padded to 12
    assert set().union(*map(set, shards)) == set(range(10))
    assert isinstance(EpochSampler(4, shuffle=False), DistributedSampler)  # Lightning leaves it in place under DDP
    resumed = EpochSampler(10, shuffle=True, seed=3, epoch=1, start=3, num_replicas=3, rank=2)
    assert list(resumed) == shards[2][3:] and len(resumed) == 4
    assert list(resumed) == shards[2]  # the next pass starts at the epoch's beginning
