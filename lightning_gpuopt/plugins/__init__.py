"""Precision plugins: BF16Precision and TorchAO Float8Precision."""

from lightning_gpuopt.plugins.bf16 import BF16Precision
from lightning_gpuopt.plugins.float8 import Float8Precision

__all__ = ["BF16Precision", "Float8Precision"]
