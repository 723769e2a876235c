"""How the Llama-style GPT is split by tensor parallelism: ``parallelize_gpt``, applied before FSDP2.

Megatron-LM's split with sequence parallelism, as torchtitan's ``parallelize_llama``, from the parallel styles of
``torch.distributed.tensor.parallel`` (torchao's float8 ones where the collectives can move float8). The plan,
and why GPT-2's fused ``c_attn`` is refused: ``docs/parallel.md`` ("The tensor-parallel plan")."""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_gpuopt.model.config import GPTConfig
from lightning_gpuopt.model.gpt import GPT

__all__ = ["check_tensor_parallel", "local_linear_shape", "moves_float8", "parallelize_gpt"]


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


def local_linear_shape(name: str, in_features: int, out_features: int, size: int) -> tuple[int, int]:
    """This rank's ``(in, out)`` of a projection under :func:`parallelize_gpt`'s plan over ``size`` ranks: the
    ``c_proj`` layers split their input (rowwise), the others their output (colwise)."""
    if name.endswith("c_proj"):
        return in_features // size, out_features
    return in_features, out_features // size


def _float8_tensorwise(layer: nn.Module) -> bool:
    """A torchao ``Float8Linear`` with dynamic tensorwise scales, which torchao's float8 tensor-parallel styles take."""
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
    """Gathers a module's input from its sequence shards, in float8 when every layer reading it is tensorwise float8."""
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
    """Split ``model`` (Llama style) over the tensor-parallel ``mesh``, in place (``docs/parallel.md``).

    Example::

        # in LightningModule.configure_model, under ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=4)
        parallelize_gpt(self.model, self.device_mesh["tensor_parallel"])
        shard_gpt(self.model, self.device_mesh["data_parallel"])

    Args:
        model: The GPT, its float8 layers (if any) converted already; real or meta parameters.
        mesh: A one-dimensional ``DeviceMesh`` of the ranks that split each layer.
        float8_collectives: Give tensorwise float8 layers torchao's float8 styles, whose all-gathers move float8;
            ``None``: where the mesh's backend can (:func:`moves_float8`: NCCL, not gloo). Otherwise their inputs
            are gathered in high precision, said once.
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
