"""`is_compiled`: whether a module, or any of its submodules, runs under ``torch.compile``.

Float8 conversion, MFU reporting and the compile-mode checks all need this one fact; it lives here,
beneath them, so none imports another for it.
"""

from __future__ import annotations

from torch import nn

from lightning_gpuopt.internals import compiled_by_lightning, compiled_wrapper_or_in_place

__all__ = ["is_compiled"]


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` or any submodule runs under ``torch.compile``: a ``torch.compile`` wrapper, an
    in-place ``Module.compile()``, or a LightningModule passed compiled to ``Trainer.fit``. A compile that
    captures nothing does not count (FSDP2-sharded blocks under activation checkpointing)."""
    if compiled_by_lightning(module) and _captures_graphs(module):
        return True
    return any(compiled_wrapper_or_in_place(m) and _captures_graphs(m) for m in module.modules())


def _captures_graphs(compiled: nn.Module) -> bool:
    """False for a compile Dynamo skips whole: FSDP2-sharded submodules called through ``torch.utils.checkpoint``
    (FSDP2's hooks are excluded from the graph, and inside a checkpointed region Dynamo cannot break there:
    0 graphs, torch 2.13). The checkpointing is read from ``config.activation_checkpointing``."""
    from torch.distributed.fsdp import FSDPModule

    inner = [m for m in compiled.modules() if m is not compiled]
    if not any(isinstance(m, FSDPModule) for m in inner):
        return True
    # "selective" checkpoints every other block: the others still compile
    return not any(getattr(getattr(m, "config", None), "activation_checkpointing", None) in (True, "full")
                   for m in compiled.modules())
