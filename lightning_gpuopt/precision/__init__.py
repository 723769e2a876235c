"""Precision plugins: bf16 autocast, torchao float8 training, and their public base to write one."""

from lightning_gpuopt.precision.base import DevicePrecision
from lightning_gpuopt.precision.bf16 import BF16Precision
from lightning_gpuopt.precision.float8 import Float8Precision

__all__ = ["BF16Precision", "DevicePrecision", "Float8Precision"]
