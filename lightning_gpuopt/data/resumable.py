"""Whether a training DataLoader resumes mid-epoch exactly, and if not, what is not exact.

``TextDataModule``'s loaders (``ResumableSampler``) resume exactly; a plain DataLoader is rebuilt around an
:class:`EpochSampler` (``ExactResume(rebuild_loaders=True)``); anything else is reported with what differs
(``docs/reliability.md``)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from lightning_gpuopt.data.sampler import ResumableSampler

from lightning_gpuopt.internals import sampler_sets_num_samples

__all__ = ["EpochSampler", "generator_seed", "make_resumable", "not_exact_reason"]


class EpochSampler(DistributedSampler):
    """The order of ``SequentialSampler`` or ``RandomSampler`` as a function of (seed, epoch), for one rank of
    ``num_replicas``, started at any position.

    Shuffled orders are ``torch.randperm`` under a generator seeded with ``seed + epoch``, and the DataLoader's
    generator (its workers' base seed) is reseeded each epoch. Ranks shard as ``DistributedSampler`` does (it is
    one, so Lightning does not wrap it); ``len()`` and ``set_epoch`` behave as :class:`ResumableSampler`'s.

    Example::

        sampler = EpochSampler(len(dataset), shuffle=True, seed=0, epoch=2, start=64)
        sampler = EpochSampler(len(dataset), shuffle=True, num_replicas=8, rank=3)

    Args:
        n: Samples in the dataset.
        start: This rank's samples of ``epoch`` already trained on.
        loader_generator: The DataLoader's generator, reseeded each epoch.
    """

    def __init__(self, n: int, shuffle: bool, seed: int = 0, epoch: int = 0, start: int = 0,
                 loader_generator: Optional[torch.Generator] = None, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(range(n), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.n, self.epoch, self.start = n, epoch, start
        self.loader_generator = loader_generator
        self.reseed_loader()

    def reseed_loader(self) -> None:
        """Seed the DataLoader's generator (its workers' base seed) for this seed and epoch."""
        if self.loader_generator is not None:
            self.loader_generator.manual_seed(self.seed * 1_000_003 + self.epoch)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.start = epoch, 0
            self.reseed_loader()

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        else:
            order = list(range(self.n))
        # padded to a multiple of the ranks
        order = (order * math.ceil(self.total_size / max(self.n, 1)))[: self.total_size]
        start, self.start = self.start, 0  # the next pass over this epoch starts at its beginning
        yield from order[self.rank : self.total_size : self.num_replicas][start:]

    def __len__(self) -> int:
        return self.num_samples


_KEEP = ("num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn", "multiprocessing_context",
         "prefetch_factor", "persistent_workers", "pin_memory_device")


def generator_seed(loader: Any) -> Optional[int]:
    """The seed the user gave a DataLoader's shuffled order (its ``RandomSampler``'s generator's, else its own
    ``generator``'s); ``None`` when it has neither (the order then comes from the global RNG)."""
    for generator in (getattr(getattr(loader, "sampler", None), "generator", None), getattr(loader, "generator", None)):
        if isinstance(generator, torch.Generator):
            return generator.initial_seed() % 2**31  # the range of the seeds ExactResume saves
    return None


def make_resumable(
    loader: Any, seed: int, epoch: int = 0, start: int = 0, num_replicas: int = 1, rank: int = 0
) -> tuple[Any, Optional[EpochSampler]]:
    """The same DataLoader with an :class:`EpochSampler` in place of its sequential or random sampler; anything but a
    plain ``DataLoader`` over a map-style dataset with those samplers comes back unchanged, with ``None``.

    Example::

        loader, sampler = make_resumable(DataLoader(dataset, batch_size=8, shuffle=True), seed=0)

    Args:
        start: This rank's samples of ``epoch`` already trained on.
        num_replicas: Ranks reading different samples (the data-parallel size).
    """
    if type(loader) is not DataLoader or isinstance(loader.dataset, IterableDataset):
        return loader, None
    sampler = loader.sampler
    plain_random = type(sampler) is RandomSampler and not sampler.replacement and not sampler_sets_num_samples(sampler)
    if not (type(sampler) is SequentialSampler or plain_random) or type(loader.batch_sampler) is not BatchSampler:
        return loader, None
    generator = torch.Generator()
    new = EpochSampler(len(loader.dataset), shuffle=plain_random, seed=seed, epoch=epoch, start=start,
                       loader_generator=generator, num_replicas=num_replicas, rank=rank)
    kwargs = {k: getattr(loader, k) for k in _KEEP if hasattr(loader, k)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs["persistent_workers"] = False
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=new, generator=generator, **kwargs), new


def _samplers(loader: DataLoader) -> list[Any]:
    found = [getattr(loader, "sampler", None)]
    batch_sampler = getattr(loader, "batch_sampler", None)
    found += [batch_sampler, getattr(batch_sampler, "sampler", None)]
    return [s for s in found if s is not None]


def not_exact_reason(loader: Any) -> Optional[str]:
    """Why a resume mid-epoch does not continue ``loader`` (whatever a ``train_dataloader`` returns) exactly; ``None``
    when it does."""
    if not isinstance(loader, DataLoader):
        return f"{type(loader).__name__} is not a torch DataLoader: its position is not saved"
    if any(isinstance(s, (ResumableSampler, EpochSampler)) for s in _samplers(loader)):
        return None
    if isinstance(loader.dataset, IterableDataset):
        return (
            f"DataLoader over the iterable dataset {type(loader.dataset).__name__} restarts from its first sample "
            "(its position is not saved)"
        )
    sampler = type(loader.sampler).__name__
    reason = f"DataLoader({sampler}) restarts at the first sample of the epoch (its position is not saved)"
    if isinstance(loader.sampler, RandomSampler):
        reason += (
            ", and each epoch's shuffled order and worker seeds come from the global RNG as it starts, "
            "which is not replayed"
        )
    return reason
