"""AutoBatchSize: the largest micro-batch that fits, the global batch kept through accumulation."""

from lightning_gpuopt.callbacks.auto_batch.callback import AutoBatchSize

__all__ = ["AutoBatchSize"]
