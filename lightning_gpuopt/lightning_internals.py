"""Every access to Lightning's private state from this package goes through this module.

Lightning has no public API for a few things we need; each function here names the private
attribute it touches, so a Lightning upgrade that renames one breaks here, loudly, and
``tests/test_lightning_internals.py`` says which. Checked against Lightning 2.5 and 2.6.

Touched:
- ``trainer._logger_connector._progress_bar_metrics``: the dict the progress bar shows; plain floats
  written there persist until replaced and cost no device synchronisation to display.
- ``trainer.fit_loop._data_source.dataloader``: the call that builds the training loader(s), before
  Lightning starts iterating them; wrapped to rebuild a loader (``wrap_train_dataloader``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

__all__ = ["show_in_progress_bar", "wrap_train_dataloader"]


def show_in_progress_bar(trainer: pl.Trainer, metrics: dict[str, Any]) -> None:
    """Show plain numbers in the progress bar until they are replaced.

    ``LightningModule.log(..., prog_bar=True)`` stores device tensors that the progress bar
    converts with ``.item()`` on every refresh: one host-device synchronisation per training batch.
    Numbers written here are already on the host.

    Example::

        show_in_progress_bar(trainer, {"loss": 2.31, "tok/s": 512000})

    Args:
        trainer: The running Trainer.
        metrics: Names and plain ``int``/``float`` values.
    """
    connector = getattr(trainer, "_logger_connector", None)
    bar = getattr(connector, "_progress_bar_metrics", None)
    if not isinstance(bar, dict):
        raise RuntimeError(
            "lightning_gpuopt: Trainer._logger_connector._progress_bar_metrics is gone in this Lightning version "
            f"({pl.__version__}); lightning_gpuopt.lightning_internals needs an update."
        )
    bar.update(metrics)


def wrap_train_dataloader(trainer: pl.Trainer, wrap: Any) -> Any:
    """Make the training loaders pass through ``wrap(loaders) -> loaders`` when Lightning builds them.

    Returns a function that undoes it. Lightning builds the loaders in ``fit_loop.setup_data()``,
    after the ``setup`` hooks and before it starts iterating, so a callback calls this in ``setup``.

    Example::

        undo = wrap_train_dataloader(trainer, lambda loaders: loaders)
    """
    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
    if source is None or not callable(getattr(source, "dataloader", None)):
        raise RuntimeError(
            "lightning_gpuopt: Trainer.fit_loop._data_source.dataloader is gone in this Lightning version "
            f"({pl.__version__}); lightning_gpuopt.lightning_internals needs an update."
        )
    original = source.dataloader
    source.dataloader = lambda: wrap(original())

    def undo() -> None:
        source.__dict__.pop("dataloader", None)

    return undo
