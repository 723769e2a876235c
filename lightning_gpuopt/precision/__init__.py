"""Precision plugins: bf16 autocast and torchao float8 training, the public base to write one, and the dtype a plugin computes in."""

from lightning_gpuopt.precision.base import DevicePrecision
from lightning_gpuopt.precision.bf16 import BF16Precision
from lightning_gpuopt.precision.float8 import Float8Precision

__all__ = ["BF16Precision", "DevicePrecision", "Float8Precision"]
