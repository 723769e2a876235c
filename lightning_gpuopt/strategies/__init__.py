"""Distributed strategies: DDP or FSDP2 for a model, FSDP2 sharding, atomic FSDP2 checkpoints, a clean end."""

from lightning_gpuopt.strategies.atomic_checkpoint import AtomicModelParallelStrategy
from lightning_gpuopt.strategies.choose import (
    AUTO_STRATEGY,
    MemoryEstimate,
    choose_strategy,
    estimate_memory,
    estimate_module_memory,
)
from lightning_gpuopt.strategies.fsdp2 import shard_gpt
from lightning_gpuopt.strategies.process_group import end_distributed

__all__ = [
    "AUTO_STRATEGY",
    "AtomicModelParallelStrategy",
    "MemoryEstimate",
    "choose_strategy",
    "end_distributed",
    "estimate_memory",
    "estimate_module_memory",
    "shard_gpt",
]
