"""GPT model, its config and presets, its FSDP2 and tensor-parallel plans, and the ``GPTModule`` LightningModule."""

from lightning_gpuopt.model.checkpoint import CheckpointError, load_gpt
from lightning_gpuopt.model.config import PRESETS, GPTConfig
from lightning_gpuopt.model.gpt import GPT
from lightning_gpuopt.model.module import GPTModule
from lightning_gpuopt.model.sharding import shard_gpt
from lightning_gpuopt.model.tensor_parallel import check_tensor_parallel, parallelize_gpt

__all__ = [
    "CheckpointError", "GPT", "GPTConfig", "GPTModule", "PRESETS",
    "check_tensor_parallel", "load_gpt", "parallelize_gpt", "shard_gpt",
]
