"""Lines Lightning prints for ``gpuopt``'s defaults that tell its users nothing they can act on, left out."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["QUIETED", "quiet_callback_states", "quiet_lightning"]

# What is left out: warnings by message (regular expressions), info lines by their start.
QUIETED = {
    # logger=True with CSVLogger is what gpuopt means; tensorboard is not needed.
    "warning": (r"Starting from v1\.9\.0, `tensorboardX` has been removed",
                # Lightning's own pytree helper under torch >= 2.10; nothing a user can change.
                r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    # Advertisements: at every Trainer construction, whatever the logger ("... cloud logging"), and when
    # Lightning adds its own ModelCheckpoint, the callbacks listing none ("... cloud uploads and versioning").
    "info": ("💡 Tip: For seamless cloud logging", "💡 Tip: For seamless cloud uploads"),
}


# validate, test and predict restore no callback: Lightning's advice to add the callbacks whose state a checkpoint
# holds (a fit's ModelCheckpoint, which gpuopt leaves out there) assumes a fit.
_CALLBACK_STATES = r"Be aware that when using `ckpt_path`, callbacks used to create the checkpoint need to be provided"


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(QUIETED["info"])


@contextmanager
def quiet_lightning() -> Iterator[None]:
    """Leave out :data:`QUIETED` while the block runs (``with quiet_lightning(): GPTCLI(...)``); restored after."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    tips = _DropTips()
    logger.addFilter(tips)
    try:
        with warnings.catch_warnings():
            for message in QUIETED["warning"]:
                warnings.filterwarnings("ignore", message=message)
            yield
    finally:
        logger.removeFilter(tips)


@contextmanager
def quiet_callback_states() -> Iterator[None]:
    """Leave out Lightning's "Please add the following callbacks" while a validate, test or predict runs: they restore
    the weights only, so the callbacks a checkpoint has state for (the fit's ModelCheckpoint) are not needed."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_CALLBACK_STATES)
        yield
