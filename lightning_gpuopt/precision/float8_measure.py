"""Where ``Float8Precision``'s timed decision meets the run: the tokens a layer sees, why nothing can be timed,
the timer on the device with its cache, and a restored decision applied to a converted model."""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_gpuopt.internals import COMPILED_PREFIX
from lightning_gpuopt.perf.cache_root import package_cache_dir
from lightning_gpuopt.perf.device import DeviceFacts
from lightning_gpuopt.perf.peaks import measure_peak_flops
from lightning_gpuopt.precision.float8_decision import (
    Float8Decision,
    Shape,
    TimingCache,
    measured_decision,
    timing_cache_file,
)
from lightning_gpuopt.precision.float8_timing import (
    ShapeTiming,
    copy_bandwidth,
    gemm_timing,
    linear_timing,
    loss_head_timing,
)
from lightning_gpuopt.protocols import SearchesMicroBatch

__all__ = [
    "TIMINGS",
    "DeviceTimer",
    "ShapeTimer",
    "cache_versions",
    "match_decision",
    "measure_on_device",
    "planned_micro_batch",
    "planned_tokens",
    "static_reason",
]

TIMINGS = ("gemm", "linear")


class ShapeTimer(Protocol):
    """Times shapes for the decision: :class:`DeviceTimer` on a GPU, or one's own (tests inject timings). A timer
    with a ``loss_head(shape, chunks)`` method times the output head inside the chunked loss with it (else with
    ``shape``)."""

    def shape(self, shape: Shape) -> ShapeTiming: ...

    def ceiling(self) -> float: ...


class DeviceTimer:
    """Times shapes on ``device`` by ``timing`` (``"gemm"``: :func:`gemm_timing`, ``"linear"``: :func:`linear_timing`);
    its ``ceiling`` is the bf16 matmul FLOP/s measured there."""

    def __init__(self, device: torch.device, recipe: str, timing: str, config: Any, cache: TimingCache) -> None:
        self.device, self.recipe, self.timing, self.config, self.cache = device, recipe, timing, config, cache

    def shape(self, shape: Shape) -> ShapeTiming:
        tokens, k, n, bias = shape
        if self.timing == "linear":
            return linear_timing(tokens, k, n, bias, self.config, self.device)
        return gemm_timing(tokens, k, n, self.recipe, self.device, self._bandwidth())

    def loss_head(self, shape: Shape, chunks: int) -> ShapeTiming:
        """The chunked loss's head, ``chunks`` chunks of ``shape`` per micro-batch: its GEMMs and modelled casts
        (:func:`loss_head_timing`), whatever ``timing`` says (it is no Linear a compile could time)."""
        tokens, k, n, _ = shape
        return loss_head_timing(tokens, k, n, chunks, self.device, self._bandwidth())

    def _bandwidth(self) -> float:
        bandwidth = self.cache.get("copy_bandwidth")
        if bandwidth is None:
            bandwidth = copy_bandwidth(self.device)
            self.cache.put(bandwidth, "copy_bandwidth")
        return bandwidth

    def ceiling(self) -> float:
        return measure_peak_flops(self.device, torch.bfloat16)


def planned_micro_batch(trainer: Optional[pl.Trainer]) -> Optional[int]:
    """The micro-batch the layers will see at most: the largest a micro-batch search can choose
    (:class:`~lightning_gpuopt.protocols.SearchesMicroBatch`), else the datamodule's ``batch_size``."""
    if trainer is None:
        return None
    for callback in trainer.callbacks:
        if isinstance(callback, SearchesMicroBatch) and callback.largest_micro_batch() is not None:
            return callback.largest_micro_batch()
    size = getattr(trainer.datamodule, "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None


def planned_tokens(trainer: Optional[pl.Trainer]) -> Optional[int]:
    """Rows a Linear sees per micro-batch: :func:`planned_micro_batch` times the datamodule's ``block_size``."""
    micro = planned_micro_batch(trainer)
    block = getattr(getattr(trainer, "datamodule", None), "block_size", None)
    return micro * block if micro and isinstance(block, int) else None


def static_reason(
    facts: Optional[DeviceFacts], emulate: bool, tokens: Optional[int], counts: dict, injected: bool
) -> Optional[str]:
    """Why the ``"auto"`` filter takes torchao's size rule instead of timing, or ``None`` to time."""
    if not counts:
        return "no layer to time"
    if not tokens:
        return "the tokens per micro-batch are unknown: a datamodule with batch_size and block_size says them"
    if injected:
        return None
    if emulate:
        return "emulated: float8 has no speed to time"
    if facts is None or not facts.is_cuda or not facts.fp8:
        return "no float8 tensor cores to time"
    return None


def cache_versions(facts: DeviceFacts) -> dict[str, str]:
    """What a cached timing depends on besides its shape: the GPU and the versions of torch, CUDA and torchao."""
    import torchao

    return {"gpu": facts.name, "capability": str(facts.capability), "torch": torch.__version__,
            "cuda": str(torch.version.cuda), "torchao": torchao.__version__}


def measure_on_device(
    counts: dict[Shape, int],
    recipe: str,
    timing: str,
    config: Any,
    flops_per_micro_batch: float,
    device: torch.device,
    facts: DeviceFacts,
    timer: Optional[ShapeTimer] = None,
    cache_root: Optional[Any] = None,
    loss_head: Optional[Shape] = None,
) -> Float8Decision:
    """Time what the cache (under the package's cache folder) lacks, on ``device`` or by ``timer``, and decide;
    ``loss_head``: the shape in ``counts`` of the output head inside the chunked loss."""
    root = cache_root if cache_root is not None else package_cache_dir("the float8 timing cache")
    cache = TimingCache(timing_cache_file(root), cache_versions(facts))
    timer = timer if timer is not None else DeviceTimer(device, recipe, timing, config, cache)
    return measured_decision(counts, recipe, timing, flops_per_micro_batch, timer.shape, timer.ceiling, cache,
                             loss_head, getattr(timer, "loss_head", None))


def _unconvert(root: nn.Module, keep: Callable[[str, nn.Module], bool]) -> None:
    # A Float8Linear back to the layer it replaced, on the same parameters (the optimizer's stay valid): that very
    # module, so its class (a Linear subclass's forward), hooks and attributes compute as in a run that never
    # converted it; an nn.Linear for a Float8Linear converted elsewhere.
    from torchao.float8.float8_linear import Float8Linear

    from lightning_gpuopt.precision.float8_layers import ORIGINAL_LAYER

    for fqn, module in list(root.named_modules()):
        if isinstance(module, Float8Linear) and not keep(fqn, module):
            parent_name, _, child = fqn.rpartition(".")
            linear = getattr(module, ORIGINAL_LAYER, None)
            if linear is None:
                linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                   device="meta")
            linear.weight, linear.bias = module.weight, module.bias
            setattr(root.get_submodule(parent_name) if parent_name else root, child, linear)


def match_decision(
    root: nn.Module,
    decision: Float8Decision,
    config: Any,
    recipe: str,
    local_shape: Optional[Callable[[str, int, int], tuple[int, int]]],
    cpu_autocast_hook: bool,
) -> list[tuple[str, str, Optional[str]]]:
    """Convert the layers of an already converted ``root`` as ``decision`` says (a restored one): float8 layers
    it keeps in bf16 go back to ``nn.Linear``, bf16 ones it converts become float8. Returns the new report."""
    from torchao.float8.float8_linear import Float8Linear

    from lightning_gpuopt.precision.float8_layers import auto_skip_reason, convert_linears_to_float8

    def converts(fqn: str, module: nn.Module) -> bool:
        name = fqn.replace(COMPILED_PREFIX, "")
        return auto_skip_reason(module, name, recipe, decision=decision, local_shape=local_shape) is None

    _unconvert(root, converts)
    kept = [(fqn.replace(COMPILED_PREFIX, ""), f"{m.in_features}x{m.out_features}", None)
            for fqn, m in root.named_modules() if isinstance(m, Float8Linear)]
    report = convert_linears_to_float8(root, config, "auto", recipe, cpu_autocast_hook=cpu_autocast_hook,
                                       decision=decision, local_shape=local_shape)
    return kept + report
