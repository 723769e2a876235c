"""How ``GPTModule`` compiles the GPT: per block or as one graph, in a ``torch.compile`` mode.

Under FSDP2 a whole-model graph breaks at every sharded block (FSDP2's hooks are excluded from Dynamo;
with activation checkpointing nothing compiles at all), so ``"model"`` runs as ``"block"``; and CUDA-graph
modes run without CUDA graphs, since FSDP2 allocates its buffers anew each step. Both say so once."""

from __future__ import annotations

from typing import Callable, Literal, Optional, Union

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_gpuopt.model.gpt import GPT

__all__ = ["WITHOUT_CUDA_GRAPHS", "CompileMode", "CompileScope", "compile_gpt", "compile_settings", "loss_fits_graph"]

CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
CompileScope = Literal["block", "model"]

# torch.compile modes that record CUDA graphs -> the same mode without them (reduce-overhead is default + CUDA graphs)
WITHOUT_CUDA_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def compile_settings(
    scope: CompileScope, mode: Optional[str], fsdp2: bool
) -> tuple[CompileScope, Optional[str], list[str]]:
    """The scope and mode to compile with, and one message per asked setting changed to work under FSDP2."""
    notes = []
    if fsdp2 and scope == "model":
        notes.append(
            "GPTModule.compile_scope='model' under FSDP2: FSDP2's hooks on each sharded block are excluded from "
            "torch.compile, so a whole-model graph breaks at every block (with activation checkpointing nothing "
            "compiles at all). Compiling each block instead; set compile_scope='block' to say so."
        )
        scope = "block"
    if fsdp2 and mode in WITHOUT_CUDA_GRAPHS:
        notes.append(
            f"GPTModule.compile_mode={mode!r} under FSDP2: this mode records CUDA graphs, which replay fixed memory "
            "addresses, but FSDP2 allocates the gathered parameters and reduced gradients anew each step, so the "
            f"graphs are re-recorded or fall back instead of saving time. Compiling with {WITHOUT_CUDA_GRAPHS[mode]!r} "
            "(the same without CUDA graphs); set it as compile_mode to say so."
        )
        mode = WITHOUT_CUDA_GRAPHS[mode]
    return scope, mode, notes


def _is_fsdp2(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def compile_gpt(
    model: GPT, scope: CompileScope = "block", mode: Optional[str] = None, backend: Union[str, Callable] = "inductor"
) -> tuple[CompileScope, Optional[str]]:
    """Compile ``model`` in place (state-dict keys stay those of the plain model), after any sharding; under FSDP2
    with :func:`compile_settings`' scope and mode, one warning per change.

    Args:
        scope: ``"block"``: each block on its own, plus the loss kernel; ``"model"``: one whole-model graph, with the
            loss inside it where :func:`loss_fits_graph`.

    Returns:
        The scope and the mode compiled with.
    """
    scope, mode, notes = compile_settings(scope, mode, _is_fsdp2(model))
    for note in notes:
        rank_zero_warn(note)
    if scope == "block":
        model.compile_blocks(mode=mode, backend=backend)
    else:
        model.compile_whole(mode=mode, backend=backend)
    model.loss_in_graph = scope == "model" and loss_fits_graph(model)
    return scope, mode


def loss_fits_graph(model: GPT) -> bool:
    """Whether a whole-model graph computes the loss itself: from the full logits with ``F.cross_entropy``, as
    nanoGPT does, so Inductor fuses the head's softmax and its gradient with the rest of the step.

    Yes for ``loss_impl="auto"`` and ``"plain"``; an explicit ``"chunked"`` or ``"liger"`` keeps its own kernels
    outside the graph, and so does a tensor-parallel head (its logits are vocabulary shards, the chunked loss
    combines them)."""
    if model.config.loss_impl not in ("auto", "plain"):
        return False
    if not torch.distributed.is_available():  # no DTensor in this build: no tensor-parallel head either
        return True
    from torch.distributed.tensor import DTensor

    return not isinstance(model.lm_head.weight, DTensor)
