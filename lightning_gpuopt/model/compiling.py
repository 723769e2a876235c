"""How ``GPTModule`` compiles the GPT: per block or as one graph, in a ``torch.compile`` mode."""

from __future__ import annotations

from typing import Callable, Literal, Optional, Union

from lightning_gpuopt.model.gpt import GPT

__all__ = ["CompileMode", "CompileScope", "compile_gpt"]

CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
CompileScope = Literal["block", "model"]


def compile_gpt(
    model: GPT, scope: CompileScope = "block", mode: Optional[str] = None, backend: Union[str, Callable] = "inductor"
) -> None:
    """Compile ``model`` in place (state-dict keys stay those of the plain model), after any sharding.

    Example::

        compile_gpt(model, "block", mode="max-autotune-no-cudagraphs")

    Args:
        model: The GPT (sharded already, if it is to be: the graph must see FSDP2's parameters).
        scope: ``"block"``: each block on its own, plus the loss kernel; ``"model"``: one whole-model graph.
        mode: ``torch.compile`` mode (``None``: the default).
        backend: ``torch.compile`` backend.
    """
    if scope == "block":
        model.compile_blocks(mode=mode, backend=backend)
    else:
        model.compile(mode=mode, backend=backend)
        model.compile_loss = True
