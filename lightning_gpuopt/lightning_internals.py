"""Every access to Lightning's private state from this package goes through this module.

Lightning has no public API for a few things we need; each function here names the private
attribute it touches, so a Lightning upgrade that renames one breaks here, loudly, and
``tests/test_lightning_internals.py`` says which. Checked against Lightning 2.5 and 2.6.

Touched:
- ``trainer._logger_connector._progress_bar_metrics``: the dict the progress bar shows; plain floats
  written there persist until replaced and cost no device synchronisation to display.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

__all__ = ["show_in_progress_bar"]


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
