"""Contracts between this package's pieces and the user's own, as ``typing.Protocol``\\ s.

Two pieces that must agree on something agree through one of these, checked with ``isinstance``, not
through flags or ``getattr`` probing. Implement one to plug your own class in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional, Protocol, runtime_checkable

import lightning.pytorch as pl

__all__ = [
    "CompilesItself",
    "ConvertsOwnLayers",
    "ResumableData",
    "SavesAlone",
    "SearchesMicroBatch",
    "TakesMicroBatch",
    "saving_alone",
]


@runtime_checkable
class ResumableData(Protocol):
    """A datamodule that positions its own training loaders, exactly, for any batch size (``TextDataModule`` does).

    ``ExactResume`` then treats its loaders as exact, and ``AutoBatchSize`` asks it where a step started
    when it redoes one after running out of memory. The contract:

    * ``train_position()`` returns ``(epoch, samples)``: the samples of ``epoch`` all ranks together have
      trained on, at the last optimizer-step boundary (``lightning_gpuopt.resume.step_boundary``).
    * ``state_dict()`` holds that position; Lightning saves it in checkpoints.
    * After ``load_state_dict(state)``, the next ``train_dataloader()`` starts at the saved position,
      whatever its batch size, in the same sample order.
    """

    def train_position(self) -> tuple[int, int]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@runtime_checkable
class TakesMicroBatch(Protocol):
    """A datamodule that is told its training micro-batch by a call, and builds its next training loader with it.

    ``AutoBatchSize`` reads ``batch_size`` (the micro-batch per device now) and calls ``use_micro_batch(size)``;
    the next ``train_dataloader()`` must return a loader of ``size``. ``TextDataModule`` implements it.

    Example::

        class MyData(pl.LightningDataModule):
            def use_micro_batch(self, size):
                self.batch_size = size
            def train_dataloader(self):
                return DataLoader(self.dataset, batch_size=self.batch_size)
    """

    batch_size: int

    def use_micro_batch(self, size: int) -> None: ...


@runtime_checkable
class SavesAlone(Protocol):
    """A callback whose ``on_save_checkpoint`` runs collectives, and can do without them for one save.

    Within ``saving_alone()`` it must not call a collective: one rank saves by itself (an emergency
    checkpoint after running out of memory) while the others may be stuck. ``ExactResume`` implements it.
    """

    def saving_alone(self) -> contextlib.AbstractContextManager[None]: ...


@runtime_checkable
class CompilesItself(Protocol):
    """A LightningModule that compiles its own model (in ``configure_model``) and says in which mode.

    ``compile_mode_in_use`` is ``None`` until the module has compiled, then the ``torch.compile`` mode it
    used (``"default"`` for the default), after any change it made to what was asked (e.g. under FSDP2).
    ``AutoBatchSize`` drops the trial graphs after the search under a mode that tunes for the shapes it saw.
    ``GPTModule`` implements it.
    """

    compile_mode_in_use: Optional[str]


@runtime_checkable
class ConvertsOwnLayers(Protocol):
    """A LightningModule whose ``configure_model`` converts its layers for the precision plugin by a named call,
    ``DevicePrecision.convert_layers(model, name, context)``, where a reader finds it.

    The plugin then leaves the modules it assigns alone (no conversion as they are assigned), and
    ``layer_context()`` tells it what its layers see: the tokens per micro-batch, the FLOPs per token, the
    local shape of each layer under tensor parallelism (a ``precision.base.LayerContext``). ``GPTModule``
    implements it.
    """

    def layer_context(self) -> Any: ...


@runtime_checkable
class SearchesMicroBatch(Protocol):
    """A callback that chooses the micro-batch at fit start, after the model is built and converted.

    ``largest_micro_batch()`` is the largest it can choose, known from its ``setup`` on (``None`` before):
    ``Float8Precision`` times its layers at that size. ``AutoBatchSize`` implements it.
    """

    def largest_micro_batch(self) -> Optional[int]: ...


@contextlib.contextmanager
def saving_alone(trainer: pl.Trainer) -> Iterator[None]:
    """Enter ``saving_alone()`` of every callback of ``trainer`` that implements :class:`SavesAlone`."""
    with contextlib.ExitStack() as stack:
        for callback in trainer.callbacks:
            if isinstance(callback, SavesAlone):
                stack.enter_context(callback.saving_alone())
        yield
