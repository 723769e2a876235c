"""FSDP2 for the GPT: :func:`~lightning_gpuopt.model.sharding.shard_gpt`, re-exported here.

The sharding plan lives with the model (``lightning_gpuopt/model/sharding.py``), since
``GPTModule`` applies it and ``model/`` does not import the strategies; this keeps
``from lightning_gpuopt.strategies.fsdp2 import shard_gpt`` working.
"""

from lightning_gpuopt.model.sharding import shard_gpt

__all__ = ["shard_gpt"]
