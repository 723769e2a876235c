"""Contracts between this package's pieces and the user's own, as ``typing.Protocol``\\ s.

Two pieces that must agree on something (how a datamodule positions its training loaders, how a
callback saves without collectives) agree through one of these, checked with ``isinstance``, not
through module-level flags or ``getattr`` probing. Implement one to plug your own class in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional, Protocol, runtime_checkable

import lightning.pytorch as pl

__all__ = ["CompilesItself", "ResumableData", "SavesAlone", "TakesMicroBatch", "saving_alone"]


@runtime_checkable
class ResumableData(Protocol):
    """A datamodule that positions its own training loaders, exactly, for any batch size.

    ``TextDataModule`` implements it. With one, ``ExactResume`` treats the training loaders as
    exact (no "not resumed exactly" warning, Lightning's "dataloader is not resumable" silenced),
    and ``AutoBatchSize``, when it redoes a step with a smaller micro-batch after running out of
    memory, asks the datamodule where the step started instead of replaying the epoch from its
    first batch.

    The contract:

    * ``train_position()`` returns ``(epoch, samples)``: the samples of ``epoch`` that all ranks
      together have trained on, counted at the last optimizer-step boundary (micro-batches of an
      unfinished step do not count; ``lightning_gpuopt.resume.step_boundary`` gives that count).
    * ``state_dict()`` holds that position; Lightning saves it in checkpoints.
    * After ``load_state_dict(state)``, the next ``train_dataloader()`` starts at the saved
      position, whatever its batch size, in the same sample order.

    Example::

        class MyData(pl.LightningDataModule):
            def train_position(self): ...
            def state_dict(self): return {"epoch": e, "position": p}
            def load_state_dict(self, state): ...

        isinstance(MyData(), ResumableData)  # True
    """

    def train_position(self) -> tuple[int, int]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@runtime_checkable
class TakesMicroBatch(Protocol):
    """A datamodule that is told its training micro-batch by a call, and builds its next training loader with it.

    ``TextDataModule`` implements it. ``AutoBatchSize`` reads ``batch_size`` (the micro-batch per device now)
    and calls ``use_micro_batch(size)``; the fit loop then asks ``train_dataloader()`` again, which must
    return a loader of ``size``. A datamodule without it gets its ``batch_size`` attribute set instead.

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

    Within ``saving_alone()`` it must not call a collective: one rank is saving by itself (an
    emergency checkpoint after running out of memory) while the others may be stuck in another
    collective. ``ExactResume`` implements it (it then stores only this rank's RNG state).

    Example::

        class MyCallback(pl.Callback):
            @contextlib.contextmanager
            def saving_alone(self):
                self.alone = True
                try:
                    yield
                finally:
                    self.alone = False
    """

    def saving_alone(self) -> contextlib.AbstractContextManager[None]: ...


@runtime_checkable
class CompilesItself(Protocol):
    """A LightningModule that compiles its own model (in ``configure_model``) and says in which mode.

    ``GPTModule`` implements it. ``AutoBatchSize`` asks it: under a mode that tunes or records for
    the shapes it saw (``max-autotune``, ``reduce-overhead``), the trial steps' graphs are dropped
    after the search so training compiles its own.

    The contract: ``compile_mode_in_use`` is ``None`` until the module has compiled, then the
    ``torch.compile`` mode it compiled with (``"default"`` for the default mode), after any change
    the module made to what was asked (e.g. under FSDP2).
    """

    compile_mode_in_use: Optional[str]


@contextlib.contextmanager
def saving_alone(trainer: pl.Trainer) -> Iterator[None]:
    """Enter ``saving_alone()`` of every callback that implements :class:`SavesAlone`.

    Example::

        with saving_alone(trainer):
            checkpoint = dump_checkpoint(trainer)

    Args:
        trainer: The Trainer whose callbacks are told.
    """
    with contextlib.ExitStack() as stack:
        for callback in trainer.callbacks:
            if isinstance(callback, SavesAlone):
                stack.enter_context(callback.saving_alone())
        yield
