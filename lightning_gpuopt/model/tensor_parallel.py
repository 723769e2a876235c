"""How the GPT is split by tensor parallelism: ``parallelize_gpt``, applied before FSDP2.

Megatron-LM's split with sequence parallelism, as torchtitan's ``parallelize_llama``, from the parallel styles of
``torch.distributed.tensor.parallel`` (torchao's float8 ones where the collectives can move float8). Which layers
it splits is the config's (``GPTConfig.tensor_parallel_plan``: separate q/k/v projections and rotary positions,
the Llama and Qwen2 families). The plan, and why GPT-2's fused ``c_attn`` is refused: ``docs/parallel.md``
("The tensor-parallel plan")."""

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
    refusal = config.tensor_parallel_refusal()
    if refusal:
        raise ValueError(
            f"Tensor parallelism (tensor_parallel_size={size}) cannot split this architecture (arch={config.arch!r}): "
            f"{refusal}, or tensor_parallel_size=1 (FSDP2 alone)."
        )
    splits = config.tensor_parallel_splits()
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
            "splits it by vocabulary: use loss_impl='chunked' (or 'auto'), which computes the same loss from the "
            "shards."
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


_NORM_BEFORE = {"attn": "ln_1", "mlp": "ln_2"}  # a block's sub-module and the norm its input comes from


def parallelize_gpt(model: GPT, mesh: Any, float8_collectives: Optional[bool] = None) -> GPT:
    """Split ``model`` over the tensor-parallel ``mesh`` as its config's plan says, in place (``docs/parallel.md``).

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
    plan = model.config.tensor_parallel_plan()  # {"attn": ((q_proj, k_proj, v_proj), c_proj), "mlp": ...}
    for block in model.transformer.h:
        styles = {}
        for name, (columns, row) in plan.items():
            styles[_NORM_BEFORE[name]] = SequenceParallel()  # the norm before it runs on the sequence shards
            part = block.get_submodule(name)
            readers = [getattr(part, layer) for layer in columns]
            # the attention's inputs are (x, cache, rope, mask, key_padding_mask), the MLP's (x,): x is gathered
            # from its sequence shards, the others pass as they are
            rest = [None] * 4 if name == "attn" else []
            styles[name] = _gather_input(readers, float8, (Shard(1), *rest), (Replicate(), *rest))
            styles.update({f"{name}.{layer}": _colwise(getattr(part, layer), float8) for layer in columns})
            styles[f"{name}.{row}"] = _rowwise(getattr(part, row), float8, output_layouts=Shard(1))
        parallelize_module(block, mesh, styles)
    if tied:  # each style made its own DTensor of the shared weight; both are Shard(0) of the same rows
        model.lm_head.weight = model.transformer.wte.weight
    return model
