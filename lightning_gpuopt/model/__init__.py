"""GPT model, its config and presets, generation, and the ``GPTModule`` LightningModule."""

from lightning_gpuopt.model.checkpoint import CheckpointError, load_gpt
from lightning_gpuopt.model.config import PRESETS, GPTConfig
from lightning_gpuopt.model.generation import generate
from lightning_gpuopt.model.gpt import GPT, KVCache
from lightning_gpuopt.model.module import GPTModule

__all__ = ["CheckpointError", "GPT", "GPTConfig", "GPTModule", "KVCache", "PRESETS", "generate", "load_gpt"]
