"""How the Llama-style GPT is split by tensor parallelism: ``parallelize_gpt``, applied before FSDP2.

The plan belongs to the model, as the FSDP2 one does (``model/sharding.py``); ``GPTModule.configure_model``
applies it on the ``tensor_parallel`` mesh of Lightning's ``ModelParallelStrategy``, then FSDP2 on the
``data_parallel`` mesh. Every piece is a parallel style of ``torch.distributed.tensor.parallel`` (or torchao's
float8 versions of them); the only collectives the package writes for it are the loss's two row reductions
(``model/loss.py``).

Design note (Megatron-LM's split, Shoeybi et al. 2019, arXiv:1909.08053, with sequence parallelism from
Korthikanti et al. 2022, arXiv:2205.05198; torchtitan's ``parallelize_llama`` applies the same to its Llama):

* **Attention**: ``q_proj``, ``k_proj``, ``v_proj`` column-wise (each rank computes ``n_head / tp`` query and
  ``n_kv_head / tp`` key/value heads: the attention counts its heads from the projections' outputs), ``c_proj``
  row-wise. **SwiGLU**: ``gate_proj``, ``up_proj`` column-wise, ``c_proj`` row-wise. One all-gather before
  each half of a block and one reduce-scatter after it, forward and backward.
* **Sequence parallelism** between them: the residual stream, the dropout and the two RMSNorms of a block
  hold ``T / tp`` positions per rank, so their activations are split ``tp`` ways too (the row-wise layers
  reduce-scatter over the sequence instead of all-reducing).
* **Embedding**: row-wise (by vocabulary), its output reduce-scattered over the sequence. **Output head**:
  column-wise (by vocabulary): the training loss takes its rows as they are and never forms the logits of
  the whole vocabulary on a rank (``model.loss``'s vocabulary-parallel chunked loss); a plain forward
  (``model(idx)``) gathers the logits. A tied head is the embedding's weight: both are split by vocabulary
  rows, so they stay one parameter.
* **float8** (``Float8Precision``, tensorwise recipe): the layers it converted get torchao's float8 styles,
  whose all-gathers move float8 (``Float8ColwiseParallel``, ``Float8RowwiseParallel``,
  ``PrepareFloat8ModuleInput``); with the rowwise recipes they get the plain styles and gather in bf16,
  as torchtitan does. So do all float8 layers on a backend without float8 collectives (gloo, on the CPU:
  its all-gather of a float8 tensor fails with "Invalid scalar type"), said once.

Only the Llama-style option set is split. GPT-2's fused ``c_attn`` (``q | k | v`` in one weight) cannot be:
a column-wise split of it gives rank 0 all the queries and part of the keys, not whole heads of each.
Generation (``generate``, a KV cache) is not planned for: sample from a checkpoint on one device.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_gpuopt.model.config import GPTConfig
from lightning_gpuopt.model.gpt import GPT

__all__ = ["check_tensor_parallel", "moves_float8", "parallelize_gpt"]


def check_tensor_parallel(config: GPTConfig, size: int) -> None:
    """Raise ``ValueError`` naming the fix when ``config`` cannot be split over ``size`` tensor-parallel ranks.

    Example::

        check_tensor_parallel(GPTConfig.from_name("llama-8b"), 8)   # fine: 32 query, 8 key/value heads
        check_tensor_parallel(GPTConfig.from_name("llama-8b"), 16)  # ValueError: 8 key/value heads

    Args:
        config: The model's configuration.
        size: Tensor-parallel ranks (``tensor_parallel_size``).
    """
    if size == 1:
        return
    if config.arch != "llama":
        raise ValueError(
            f"Tensor parallelism (tensor_parallel_size={size}) splits the Llama-style GPT only: GPT-2's fused c_attn "
            "projection cannot be split into whole heads. Use GPTConfig(arch='llama') (a llama-* preset), or "
            "tensor_parallel_size=1 (FSDP2 alone)."
        )
    splits = {
        "n_head": config.n_head,
        "n_kv_head": config.n_kv_head,
        "ffn_size": config.ffn_size,
        "padded_vocab_size": config.padded_vocab_size,
    }
    bad = {name: value for name, value in splits.items() if value % size}
    if bad:
        sizes = [s for s in (1, 2, 4, 8, 16, 32, 64) if all(v % s == 0 for v in splits.values())]
        raise ValueError(
            f"tensor_parallel_size={size} does not divide {', '.join(f'{k}={v}' for k, v in bad.items())}: each rank "
            f"takes an equal share of the heads, the MLP and the vocabulary. Choose tensor_parallel_size from {sizes}"
            + (" or set GPTConfig.padding_multiple to a multiple of it." if "padded_vocab_size" in bad else ".")
        )
    if config.loss_impl not in ("auto", "chunked"):
        raise ValueError(
            f"GPTConfig.loss_impl={config.loss_impl!r} needs the whole output head on one rank, and tensor parallelism "
            "splits it by vocabulary: use loss_impl='chunked' (or 'auto'), which computes the same loss from the shards."
        )


def _float8_tensorwise(layer: nn.Module) -> bool:
    """A torchao ``Float8Linear`` with dynamic tensorwise scales: what torchao's float8 tensor-parallel styles take."""
    if type(layer).__name__ != "Float8Linear":  # torchao is optional: imported only when a layer is its
        return False
    from torchao.float8.config import ScalingGranularity, ScalingType

    config = layer.config
    casts = (config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output)
    return all(
        c.scaling_type == ScalingType.DYNAMIC and c.scaling_granularity == ScalingGranularity.TENSORWISE for c in casts
    )


def _colwise(layer: nn.Module, float8: bool, **kwargs: Any) -> Any:
    if float8 and _float8_tensorwise(layer):
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

        return Float8ColwiseParallel(**kwargs)
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel(**kwargs)


def _rowwise(layer: nn.Module, float8: bool, **kwargs: Any) -> Any:
    if float8 and _float8_tensorwise(layer):
        from torchao.float8.float8_tensor_parallel import Float8RowwiseParallel

        return Float8RowwiseParallel(**kwargs)
    from torch.distributed.tensor.parallel import RowwiseParallel

    return RowwiseParallel(**kwargs)


def _gather_input(readers: list[nn.Module], float8: bool, layouts: tuple, desired: tuple) -> Any:
    """Gathers a module's input from its sequence shards: cast to float8 before the all-gather when every layer
    reading it is a tensorwise ``Float8Linear`` (one float8 all-gather for all of them), else as it is."""
    if float8 and all(_float8_tensorwise(layer) for layer in readers):
        from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

        return PrepareFloat8ModuleInput(input_layouts=layouts, desired_input_layouts=desired)
    from torch.distributed.tensor.parallel import PrepareModuleInput

    return PrepareModuleInput(input_layouts=layouts, desired_input_layouts=desired)


def _backend(mesh: Any) -> str:
    import torch.distributed as dist

    return str(dist.get_backend(mesh.get_group()))


def moves_float8(mesh: Any) -> bool:
    """Whether the collectives of ``mesh`` move float8 tensors: NCCL does; gloo (CPU) has no float8 type."""
    return _backend(mesh) == "nccl"


def parallelize_gpt(model: GPT, mesh: Any, float8_collectives: Optional[bool] = None) -> GPT:
    """Split ``model`` (Llama style) over the tensor-parallel ``mesh``, in place (see the module's design note).

    Example::

        # in LightningModule.configure_model, under ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=4)
        parallelize_gpt(self.model, self.device_mesh["tensor_parallel"])
        shard_gpt(self.model, self.device_mesh["data_parallel"])

    Args:
        model: The GPT, its float8 layers (if any) converted already; real or meta parameters.
        mesh: A one-dimensional ``DeviceMesh`` of the ranks that split each layer.
        float8_collectives: Give tensorwise float8 layers torchao's float8 styles, whose all-gathers move float8;
            ``None``: where the mesh's backend can (:func:`moves_float8`: NCCL, not gloo). Otherwise the float8
            layers still compute in float8 and their inputs are gathered in high precision, and this says so once.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel, parallelize_module

    check_tensor_parallel(model.config, mesh.size())
    float8 = moves_float8(mesh) if float8_collectives is None else float8_collectives
    if not float8 and any(_float8_tensorwise(m) for m in model.modules()):
        rank_zero_info(
            "parallelize_gpt: the float8 layers compute in float8 and their tensor-parallel all-gathers run in high "
            f"precision: this mesh's backend ({_backend(mesh)}) cannot move float8 tensors (NCCL can)."
        )
    tied = model.lm_head.weight is model.transformer.wte.weight
    parallelize_module(model, mesh, {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "transformer.ln_f": SequenceParallel(),
        # model(idx) without targets: every rank gets the logits of the whole vocabulary
        "lm_head": _colwise(model.lm_head, float8, input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        parallelize_module(block, mesh, {
            "ln_1": SequenceParallel(),
            # attention's inputs are (x, cache, rope, mask, key_padding_mask): x is gathered from its sequence shards,
            # the others pass as they are
            "attn": _gather_input(
                [attn.q_proj, attn.k_proj, attn.v_proj], float8, (Shard(1), *[None] * 4), (Replicate(), *[None] * 4)
            ),
            "attn.q_proj": _colwise(attn.q_proj, float8),
            "attn.k_proj": _colwise(attn.k_proj, float8),
            "attn.v_proj": _colwise(attn.v_proj, float8),
            "attn.c_proj": _rowwise(attn.c_proj, float8, output_layouts=Shard(1)),
            "ln_2": SequenceParallel(),
            "mlp": _gather_input([mlp.gate_proj, mlp.up_proj], float8, (Shard(1),), (Replicate(),)),
            "mlp.gate_proj": _colwise(mlp.gate_proj, float8),
            "mlp.up_proj": _colwise(mlp.up_proj, float8),
            "mlp.c_proj": _rowwise(mlp.c_proj, float8, output_layouts=Shard(1)),
        })
    if tied:  # each style made its own DTensor of the shared weight; both are Shard(0) of the same rows
        model.lm_head.weight = model.transformer.wte.weight
    return model
