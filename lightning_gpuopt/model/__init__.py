"""GPT model, its config and presets, its FSDP2 and tensor-parallel plans, and the ``GPTModule`` LightningModule."""

from lightning_gpuopt.model.checkpoint import CheckpointError, load_gpt
from lightning_gpuopt.model.config import PRESETS, GPTConfig
from lightning_gpuopt.model.gpt import GPT
from lightning_gpuopt.model.hf import load_hf, save_hf
from lightning_gpuopt.model.hf_families import HFError
from lightning_gpuopt.model.module import GPTModule
from lightning_gpuopt.model.sharding import shard_gpt
from lightning_gpuopt.model.tensor_parallel import check_tensor_parallel, parallelize_gpt

__all__ = [
    "CheckpointError", "GPT", "GPTConfig", "GPTModule", "HFError", "PRESETS",
    "check_tensor_parallel", "load_gpt", "load_hf", "parallelize_gpt", "save_hf", "shard_gpt",
]
