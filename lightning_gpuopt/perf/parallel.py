"""Data-parallel size and rank of a Trainer: the ranks that read different samples.

The world size, less a tensor-parallel dimension (whose ranks read the same samples), as Lightning's
``strategy.distributed_sampler_kwargs`` states; only this module computes it.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["data_parallel_rank", "data_parallel_size", "tensor_parallel_size"]


def _sampler_kwargs(trainer: Any) -> dict[str, Any]:
    return (getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}) if trainer is not None else {}


def data_parallel_size(trainer: Optional[Any]) -> int:
    """Ranks that read different samples: the world size, less any tensor-parallel dimension (1 without a Trainer)."""
    if trainer is None:
        return 1
    return int(_sampler_kwargs(trainer).get("num_replicas", trainer.world_size))


def data_parallel_rank(trainer: Optional[Any]) -> int:
    """This process's index among the :func:`data_parallel_size` ranks (0 without a Trainer)."""
    if trainer is None:
        return 0
    return int(_sampler_kwargs(trainer).get("rank", trainer.global_rank))


def tensor_parallel_size(trainer: Optional[Any]) -> int:
    """Ranks that split each layer and read the same samples: the world size over :func:`data_parallel_size`
    (1 under DDP, FSDP2 alone, one device, or without a Trainer)."""
    if trainer is None:
        return 1
    return max(1, trainer.world_size // data_parallel_size(trainer))
