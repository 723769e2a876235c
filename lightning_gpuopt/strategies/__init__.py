"""Distributed strategies: pick DDP or FSDP2 for a model, and the GPT's FSDP2 sharding."""

from lightning_gpuopt.strategies.choose import AUTO_STRATEGY, MemoryEstimate, choose_strategy, estimate_memory
from lightning_gpuopt.strategies.fsdp2 import shard_gpt

__all__ = ["AUTO_STRATEGY", "MemoryEstimate", "choose_strategy", "estimate_memory", "shard_gpt"]
