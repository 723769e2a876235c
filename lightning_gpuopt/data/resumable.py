"""Whether a training DataLoader resumes mid-epoch exactly, and if not, what is not exact.

Design note: Lightning restores a loader's position only for loaders with ``state_dict`` /
``load_state_dict``; any other loader restarts at the first sample of the epoch when a run resumes
from a checkpoint saved inside one, and a shuffling ``RandomSampler`` without a generator draws each
epoch's order (and the workers' base seed) from the global RNG when the loader starts, which a
resumed run does not replay. ``TextDataModule``'s loaders use a
:class:`~lightning_gpuopt.data.sampler.ResumableSampler`, whose order is a function of (seed, epoch,
position) and whose position the datamodule saves: those resume exactly. Everything else is reported
as not exact, with what differs, so ``ExactResume`` can say so once instead of claiming exactness.
"""

from __future__ import annotations

from typing import Any, Optional

from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from lightning_gpuopt.data.sampler import ResumableSampler

__all__ = ["not_exact_reason"]


def _samplers(loader: DataLoader) -> list[Any]:
    found = [getattr(loader, "sampler", None)]
    batch_sampler = getattr(loader, "batch_sampler", None)
    found += [batch_sampler, getattr(batch_sampler, "sampler", None)]
    return [s for s in found if s is not None]


def not_exact_reason(loader: Any) -> Optional[str]:
    """Why a resume mid-epoch does not continue ``loader`` exactly; ``None`` when it does.

    Example::

        not_exact_reason(DataLoader(dataset, batch_size=8, shuffle=True))
        # 'DataLoader(RandomSampler) restarts at the first sample of the epoch ...'

    Args:
        loader: A training DataLoader (or anything a ``train_dataloader`` returns).
    """
    if not isinstance(loader, DataLoader):
        return f"{type(loader).__name__} is not a torch DataLoader: its position is not saved"
    if any(isinstance(s, ResumableSampler) for s in _samplers(loader)):
        return None
    if isinstance(loader.dataset, IterableDataset):
        return (
            f"DataLoader over the iterable dataset {type(loader.dataset).__name__} restarts from its first sample "
            "(its position is not saved)"
        )
    sampler = type(loader.sampler).__name__
    reason = f"DataLoader({sampler}) restarts at the first sample of the epoch (its position is not saved)"
    if isinstance(loader.sampler, RandomSampler):
        reason += ", and each epoch's shuffled order and worker seeds come from the global RNG as it starts, which is not replayed"
    return reason
