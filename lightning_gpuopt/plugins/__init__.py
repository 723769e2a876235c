"""Plugins: BF16Precision, TorchAO Float8Precision, and AtomicCheckpointIO."""

from lightning_gpuopt.plugins.bf16 import BF16Precision
from lightning_gpuopt.plugins.checkpoint_io import AtomicCheckpointIO
from lightning_gpuopt.plugins.checkpoint_safety import NonFiniteCheckpointError
from lightning_gpuopt.plugins.float8 import Float8Precision

__all__ = ["AtomicCheckpointIO", "BF16Precision", "Float8Precision", "NonFiniteCheckpointError"]
