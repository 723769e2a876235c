"""Callbacks: CUDA settings, MFU monitoring, the non-finite guard."""

from lightning_gpuopt.callbacks.cuda_settings import CUDASettings
from lightning_gpuopt.callbacks.mfu_monitor import MFUMonitor
from lightning_gpuopt.callbacks.nonfinite_guard import NonFiniteError, NonFiniteGuard

__all__ = ["CUDASettings", "MFUMonitor", "NonFiniteError", "NonFiniteGuard"]
