"""`ResumableSampler`: the training order as a pure function of (epoch, position), resumable mid-epoch.

It reads a numbered stream (``RandomWindows`` draws window ``i`` from ``(seed, i)``), never the global RNG, so the
order survives a restart, another number of workers and another batch size (``docs/data.md``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import Dataset, DistributedSampler

from lightning_gpuopt.option_checks import check_int, check_number

__all__ = ["ResumableSampler", "stream_indices"]


def stream_indices(epoch: int, num_samples: int, start: int = 0, rank: int = 0, world_size: int = 1) -> range:
    """Stream indices one rank reads in ``epoch`` from global position ``start`` on (all ranks read as many).

    Example::

        list(stream_indices(epoch=1, num_samples=8, start=2, rank=1, world_size=2))  # [11, 13, 15]
    """
    end = start + max(0, num_samples - start) // world_size * world_size
    base = epoch * num_samples
    return range(base + start + rank, base + end, world_size)


class ResumableSampler(DistributedSampler):
    """Sampler over a numbered training stream, that can start an epoch at any global position.

    A ``DistributedSampler``, so Lightning leaves it in place under DDP/FSDP instead of injecting its own. ``len()``
    is the whole epoch's per rank, also mid-epoch, so Lightning's count of batches per epoch does not change on
    resume; ``set_epoch`` with the current epoch keeps the resume position.

    Example::

        sampler = ResumableSampler(dataset, num_replicas=2, rank=0, epoch=3, start=64)
        loader = DataLoader(dataset, batch_size=8, sampler=sampler, drop_last=True)

    Args:
        dataset: A dataset whose ``__getitem__`` accepts any stream index (``RandomWindows``); its ``len()`` is the
            number of positions per epoch.
        start: Global position in ``epoch`` to start from (all ranks together).
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0, epoch: int = 0, start: int = 0) -> None:
        own = "ResumableSampler"
        check_int(own, "num_replicas", num_replicas, minimum=1)
        check_number(
            own, "rank", rank, low=0, high=num_replicas, high_open=True, hint=f" (num_replicas={num_replicas})"
        )
        check_int(own, "start", start, minimum=0, hint=" (a position in the epoch)")
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
