"""How the GPT is sharded with FSDP2: ``fully_shard`` each transformer block, then the root.

Per block, so the peak holds one block's gathered weights; an untied token embedding on its own, as
torchtitan does (it is used first and its gradient comes last). The plan lives with the model so
``GPTModule.configure_model`` applies it without importing the strategies. ``torch.compile`` comes after."""

from __future__ import annotations

from typing import Optional

import torch

from lightning_gpuopt.model.gpt import GPT

__all__ = ["shard_gpt"]


def shard_gpt(model: GPT, mesh, param_dtype: Optional[torch.dtype] = None, reshard_after_forward: bool = True) -> GPT:
    """Apply FSDP2 (``fully_shard``) to every block of ``model``, then to the root, over the data-parallel ``mesh``.

    Example::

        # in LightningModule.configure_model, under ModelParallelStrategy
        shard_gpt(self.model, self.device_mesh["data_parallel"], param_dtype=torch.bfloat16)

    Args:
        param_dtype: Dtype parameters are gathered and computed in (gradients reduced and master weights kept in
            float32); ``None`` keeps the parameters' dtype.
        reshard_after_forward: Free the gathered block weights after the forward (less memory, one more all-gather).
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
