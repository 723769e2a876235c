"""Distributed strategies: DDP, FSDP2 or FSDP2 + tensor parallel for a model (with the reason), and a clean end of the
process group."""

from lightning_gpuopt.strategies.choose import (
    AUTO_STRATEGY,
    NETWORK_BANDWIDTH,
    MemoryEstimate,
    PlanDoesNotFit,
    choose_strategy,
    estimate_memory,
    estimate_module_memory,
)
from lightning_gpuopt.strategies.process_group import end_distributed

__all__ = [
    "AUTO_STRATEGY",
    "MemoryEstimate",
    "NETWORK_BANDWIDTH",
    "PlanDoesNotFit",
    "choose_strategy",
    "end_distributed",
    "estimate_memory",
    "estimate_module_memory",
]
