"""`ResumableSampler`: the training order as a pure function of (epoch, position), resumable mid-epoch.

Design note: the training stream is numbered. Position ``p`` of epoch ``e`` is stream index
``e * num_samples + p``, and ``RandomWindows`` maps a stream index to a window with a generator
seeded by ``(seed, index)``. Nothing reads the global RNG, so the order survives a restart, a
different number of DataLoader workers, and a different batch size: sample ``k`` of an epoch is
the same window whatever the batch size. Under data parallelism rank ``r`` of ``W`` takes the
positions ``r, r + W, r + 2W, ...``; a resume at global position ``start`` continues each rank
exactly where it stopped (with the same ``W``; with another, the ranks split the rest of the epoch).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import Dataset, DistributedSampler

__all__ = ["ResumableSampler", "stream_indices"]


def stream_indices(epoch: int, num_samples: int, start: int = 0, rank: int = 0, world_size: int = 1) -> range:
    """Stream indices one rank reads in ``epoch``, from global position ``start`` on.

    The tail of fewer than ``world_size`` positions left after ``start`` is dropped so every rank
    reads as many.

    Example::

        list(stream_indices(epoch=1, num_samples=8, start=2, rank=1, world_size=2))  # [11, 13, 15]

    Args:
        epoch: The epoch (0-based).
        num_samples: Positions per epoch (the dataset's length).
        start: First global position to read (samples already consumed by all ranks together).
        rank: This process's data-parallel rank.
        world_size: Number of data-parallel ranks.
    """
    end = start + max(0, num_samples - start) // world_size * world_size
    base = epoch * num_samples
    return range(base + start + rank, base + end, world_size)


class ResumableSampler(DistributedSampler):
    """Sampler over a numbered training stream, that can start an epoch at any global position.

    A ``DistributedSampler`` subclass, so Lightning leaves it in place under DDP/FSDP instead of
    injecting its own (which would read the shuffle seed from the global RNG); the rank and world
    size are given explicitly. ``set_epoch`` (called by Lightning at each epoch start) moves to a new
    epoch from its beginning; calling it with the current epoch keeps the resume position.
    ``len()`` is the whole epoch's count per rank, also when starting mid-epoch, so Lightning's
    count of batches per epoch does not change on resume.

    Example::

        sampler = ResumableSampler(dataset, num_replicas=2, rank=0, epoch=3, start=64)
        loader = DataLoader(dataset, batch_size=8, sampler=sampler, drop_last=True)

    Args:
        dataset: A dataset whose ``__getitem__`` accepts any stream index (``RandomWindows``);
            its ``len()`` is the number of positions per epoch.
        num_replicas: Data-parallel world size.
        rank: This process's data-parallel rank.
        epoch: Epoch to read.
        start: Global position in ``epoch`` to start from (all ranks together).
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0, epoch: int = 0, start: int = 0) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"ResumableSampler needs 0 <= rank < num_replicas, got rank={rank}, num_replicas={num_replicas}.")
        if start < 0:
            raise ValueError(f"ResumableSampler.start={start} must be a position in the epoch (0 or more).")
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=True)
        self.epoch = epoch
        self.start = start
        self.samples_per_epoch = len(dataset)

    def __iter__(self) -> Iterator[int]:
        return iter(stream_indices(self.epoch, self.samples_per_epoch, self.start, self.rank, self.num_replicas))

    def __len__(self) -> int:
        return self.samples_per_epoch // self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch`` from its beginning, unless it is the epoch being read (a resume)."""
        if epoch != self.epoch:
            self.epoch, self.start = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "start": self.start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.start = int(state["epoch"]), int(state["start"])
