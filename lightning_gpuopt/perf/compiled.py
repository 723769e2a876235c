"""`is_compiled`: whether a module, or any of its submodules, runs under ``torch.compile``.

Float8 conversion, MFU reporting and the compile-mode checks all need this one fact; it lives here,
beneath them, so none imports another for it.
"""

from __future__ import annotations

from torch import nn

__all__ = ["is_compiled"]


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` or any submodule runs under ``torch.compile``.

    Detects ``torch.compile(module)`` wrappers (``OptimizedModule``), in-place ``Module.compile()``
    (which sets ``_compiled_call_impl``) and a LightningModule passed compiled to ``Trainer.fit``
    (Lightning stores ``_compiler_ctx``).

    Example::

        >>> import torch
        >>> layer = torch.nn.Linear(16, 16)
        >>> is_compiled(layer), is_compiled(torch.nn.Sequential(torch.compile(layer)))
        (False, True)

    Args:
        module: Any ``nn.Module`` (a LightningModule included).
    """
    from torch._dynamo.eval_frame import OptimizedModule

    if getattr(module, "_compiler_ctx", None):
        return True
    return any(
        isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None for m in module.modules()
    )
