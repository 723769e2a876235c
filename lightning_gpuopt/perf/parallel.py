"""Data-parallel size and rank of a Trainer: the ranks that read different samples.

Under DDP and FSDP every rank reads its own samples, so this is the world size; under
``ModelParallelStrategy`` with a tensor-parallel dimension, the ranks of one tensor-parallel group
read the same samples, so it is the world size divided by that dimension. Lightning states both in
``strategy.distributed_sampler_kwargs`` (``num_replicas``, ``rank``); strategies without it (one
device) read everything on their one rank. Batch sizes, sampler positions and tokens/s all count
with this number, and only this module computes it.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["data_parallel_rank", "data_parallel_size", "tensor_parallel_size"]


def _sampler_kwargs(trainer: Any) -> dict[str, Any]:
    return (getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}) if trainer is not None else {}


def data_parallel_size(trainer: Optional[Any]) -> int:
    """Ranks that read different samples: the world size, less any tensor-parallel dimension.

    Example::

        >>> import lightning.pytorch as pl
        >>> data_parallel_size(pl.Trainer(accelerator="cpu", devices=1, logger=False)), data_parallel_size(None)
        (1, 1)

    Args:
        trainer: A ``lightning.pytorch.Trainer``, or ``None`` (no Trainer yet: one rank).
    """
    if trainer is None:
        return 1
    return int(_sampler_kwargs(trainer).get("num_replicas", trainer.world_size))


def data_parallel_rank(trainer: Optional[Any]) -> int:
    """This process's index among the :func:`data_parallel_size` ranks that read different samples.

    Example::

        >>> import lightning.pytorch as pl
        >>> data_parallel_rank(pl.Trainer(accelerator="cpu", devices=1, logger=False))
        0

    Args:
        trainer: A ``lightning.pytorch.Trainer``, or ``None`` (no Trainer yet: rank 0).
    """
    if trainer is None:
        return 0
    return int(_sampler_kwargs(trainer).get("rank", trainer.global_rank))


def tensor_parallel_size(trainer: Optional[Any]) -> int:
    """Ranks that split each layer and read the same samples: the world size over :func:`data_parallel_size`
    (``ModelParallelStrategy``'s ``tensor_parallel_size``; 1 under DDP, FSDP2 alone and one device).

    Example::

        >>> import lightning.pytorch as pl
        >>> tensor_parallel_size(pl.Trainer(accelerator="cpu", devices=1, logger=False)), tensor_parallel_size(None)
        (1, 1)

    Args:
        trainer: A ``lightning.pytorch.Trainer``, or ``None`` (no Trainer yet: one rank).
    """
    if trainer is None:
        return 1
    return max(1, trainer.world_size // data_parallel_size(trainer))
