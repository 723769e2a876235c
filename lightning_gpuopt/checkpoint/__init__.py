"""Checkpoints written whole or not at all, and checked before they are written."""

from lightning_gpuopt.checkpoint.io import AtomicCheckpointIO
from lightning_gpuopt.checkpoint.model_parallel import AtomicModelParallelStrategy
from lightning_gpuopt.checkpoint.safety import NonFiniteCheckpointError

__all__ = ["AtomicCheckpointIO", "AtomicModelParallelStrategy", "NonFiniteCheckpointError"]
