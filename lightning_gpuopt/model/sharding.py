"""How the GPT is sharded with FSDP2: ``fully_shard`` each transformer block, then the root.

The sharding plan belongs to the model (as torchtitan keeps ``parallelize`` beside each model), so
``GPTModule.configure_model`` applies it without importing the strategies; ``shard_gpt`` stays
importable from ``lightning_gpuopt.strategies`` too.

Design note: sharding per block lets FSDP2 all-gather one block's parameters just before it runs
and free them after (``reshard_after_forward``), so the peak holds one block's full weights, not
the whole model's. The root wrap holds what is left: the embeddings, the final norm and the
output head (tied to the token embedding, so one parameter). An untied token embedding (Llama 3.1 8B
and 70B: 0.5 and 1 billion parameters) is sharded on its own instead, as torchtitan does: it is used
first in the forward and its gradient comes last, so it is gathered around its own lookup and freed
after, not held with the root from forward to backward. Activation checkpointing wraps the
sharded block in ``GPT.forward`` (non-reentrant ``torch.utils.checkpoint``), which FSDP2 supports.
``torch.compile`` must come after this, so the compiled graph sees the sharded parameters.
"""

from __future__ import annotations

from typing import Optional

import torch

from lightning_gpuopt.model.gpt import GPT

__all__ = ["shard_gpt"]


def shard_gpt(model: GPT, mesh, param_dtype: Optional[torch.dtype] = None, reshard_after_forward: bool = True) -> GPT:
    """Apply FSDP2 (``torch.distributed.fsdp.fully_shard``) to every block of ``model``, then to the root.

    Example::

        # in LightningModule.configure_model, under ModelParallelStrategy
        shard_gpt(self.model, self.device_mesh["data_parallel"], param_dtype=torch.bfloat16)

    Args:
        model: The GPT, with real (or meta) parameters on this rank.
        mesh: The data-parallel ``DeviceMesh`` to shard over.
        param_dtype: Dtype parameters are all-gathered and computed in (FSDP2's
            ``MixedPrecisionPolicy``); gradients are reduced in float32 and the sharded master
            weights stay float32. ``None`` keeps the parameters' dtype.
        reshard_after_forward: Free the gathered block weights after the forward (less memory,
            one more all-gather in the backward).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    if model.lm_head.weight is not model.transformer.wte.weight:  # untied: the embedding on its own
        fully_shard(model.transformer.wte, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # The root (embedding = tied head, final norm) stays gathered from forward to backward: its backward
    # comes right after the loss, and regathering the vocabulary-sized weight there would cost one more
    # all-gather per micro-batch (an explicit True is honoured for the root since torch 2.8).
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return model
