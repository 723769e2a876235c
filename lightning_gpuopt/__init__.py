"""lightning_gpuopt: fast-by-default transformer training on NVIDIA GPUs with PyTorch Lightning."""

from lightning_gpuopt.data import TextDataModule
from lightning_gpuopt.model import GPT, GPTConfig, GPTModule

__version__ = "0.1.0"

__all__ = ["GPT", "GPTConfig", "GPTModule", "TextDataModule", "__version__"]
