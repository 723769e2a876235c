"""Generation: sampling with a KV cache, continuous batching, and how many rows fit on a device.

Below the model: a loop asks of a model only ``model(idx, caches, ...)`` (or ``attention_mask`` for a Hugging Face
style module) and ``model.config``, so ``GPT.generate`` and ``GPTModule.predict_step`` call into this room."""

from lightning_gpuopt.generation.batched import Finished, GenerationJob, Request, generate_batched
from lightning_gpuopt.generation.kv_cache import KVCache
from lightning_gpuopt.generation.sampling import generate

__all__ = ["Finished", "GenerationJob", "KVCache", "Request", "generate", "generate_batched"]
