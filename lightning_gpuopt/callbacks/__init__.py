"""Callbacks: CUDA settings, MFU monitoring, automatic batch size."""

__all__: list[str] = []
