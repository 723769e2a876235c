"""Precision plugins: BF16Precision and TorchAO Float8Precision."""

__all__: list[str] = []
