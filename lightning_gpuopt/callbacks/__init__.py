"""Callbacks: CUDA settings, MFU monitoring, automatic batch size."""

from lightning_gpuopt.callbacks.mfu_monitor import MFUMonitor

__all__ = ["MFUMonitor"]
