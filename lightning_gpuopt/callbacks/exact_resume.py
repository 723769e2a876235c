"""`ExactResume`: a run resumed from a checkpoint continues as if it had never stopped."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_gpuopt.option_checks import check_bool, option
from lightning_gpuopt.data.resumable import EpochSampler, generator_seed, make_resumable, not_exact_reason
from lightning_gpuopt.internals import (
    batch_counters,
    data_parallel_ranks,
    require_internals,
    warning_filters_changed,
    wrap_train_dataloader,
)
from lightning_gpuopt.protocols import ResumableData
from lightning_gpuopt.resume import (
    capture_rng_state,
    microbatches_since_step,
    restore_rng_state,
    rollback_fit_loop_state,
    start_next_epoch_if_ended,
    step_boundary,
)

__all__ = ["ExactResume"]

_LIGHTNING_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is"


def _all_gather(obj: Any, rank: int, world_size: int, alone: bool) -> list[Any]:
    """Every rank's ``obj``; only this rank's (``None`` for the others) when saving ``alone`` (no collectives)."""
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        out: list[Any] = [None] * world_size
        if not alone:
            dist.all_gather_object(out, obj)
        else:
            out[rank] = obj
        return out
    return [obj]


class ExactResume(Callback):
    """Makes a resumed ``fit`` repeat the uninterrupted run's losses exactly.

    On top of what Lightning restores, it saves every rank's RNG states (put back before the first resumed
    batch) and rolls a checkpoint written mid-accumulation back to the last optimizer step, which is then
    replayed. Details: ``docs/reliability.md``.

    Example::

        trainer = Trainer(callbacks=[ExactResume(), ModelCheckpoint(every_n_train_steps=100, save_last=True)])
        trainer.fit(module, datamodule=data, ckpt_path="last")

    Args:
        rebuild_loaders: Rebuild a plain ``DataLoader`` (map-style dataset, default sequential or shuffled
            sampler) around an :class:`~lightning_gpuopt.data.resumable.EpochSampler`, so its data order
            resumes too (a replayable shuffle, not the one torch would draw).

    Note:
        Exactness assumes nothing but the training steps draws from the global RNG between two optimizer
        steps. The data order resumes exactly with a :class:`~lightning_gpuopt.protocols.ResumableData`
        datamodule or a rebuilt loader; any other restarts at the epoch's first sample, said at fit start.
    """

    def __init__(self, rebuild_loaders: bool = False) -> None:
        check_bool("ExactResume", "rebuild_loaders", rebuild_loaders)
        self.rebuild_loaders = rebuild_loaders
        self._snapshot: Optional[dict[str, Any]] = None
        self._snapshot_step: Optional[int] = None
        self._pending: Optional[dict[str, Any]] = None
        self._warned_loader = False
        self._filter: Optional[tuple] = None
        self._data_state: Optional[dict[str, int]] = None  # from the checkpoint: seed, epoch, start
        self._sampler: Optional[EpochSampler] = None
        self._seed = 0
        self._seed_fixed = False  # True once the checkpoint's or the loader's generator's seed is chosen
        self._undo_wrap: Optional[Any] = None
        self._ranks = (1, 0)  # (num_replicas, rank) of the rebuilt loader's sampler
        self._warned_ranks = False
        self._warned_seed = False
        self._alone = False  # inside saving_alone(): one rank saves by itself

    @contextlib.contextmanager
    def saving_alone(self) -> Iterator[None]:
        """A save by one rank alone (:class:`~lightning_gpuopt.protocols.SavesAlone`): only this rank's RNG
        state is gathered."""
        self._alone = True
        try:
            yield
        finally:
            self._alone = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self.rebuild_loaders or stage != "fit" or self._undo_wrap is not None:
            return
        require_internals(trainer, "ExactResume(rebuild_loaders=True)")
        self._sampler = None
        self._ranks = data_parallel_ranks(trainer)
        # One seed on every rank (ranks may be seeded differently): each shards the same order. A seeded
        # generator of the loader's own replaces it when the loader is built; a checkpoint's seed replaces both.
        self._seed = int(trainer.strategy.broadcast(torch.initial_seed() % 2**31))
        self._seed_fixed = False
        self._broadcast = trainer.strategy.broadcast  # every rank builds the loader: rank 0's generator seed rules
        self._undo_wrap = wrap_train_dataloader(trainer, self._resumable)

    def _resumable(self, loaders: Any) -> Any:
        """A DataLoader of the module's own, rebuilt around an ``EpochSampler`` at the saved position.

        Every build before training starts (``estimated_stepping_batches``, ``AutoBatchSize``) starts at the
        checkpoint's position; a build later (an OOM recovery) at the epoch's start, fast-forwarded by its caller.
        """
        epoch, start = self._saved_position()
        own = generator_seed(loaders)
        if self._ranks[0] > 1:  # a generator seeded per rank would shard different orders: rank 0's for all
            own = self._broadcast(own)
        if own is not None and not self._seed_fixed:
            self._seed, self._seed_fixed = own, True
        elif own is not None and own != self._seed and not self._warned_seed:
            self._warned_seed = True
            rank_zero_warn(
                f"ExactResume: the training loader's generator is seeded {own} but the checkpoint's data order was "
                f"seeded {self._seed}: the resumed run continues the checkpoint's order (seed {self._seed}) so that "
                f"it resumes exactly. Start a new run (no ckpt_path) to train in the order of seed {own}."
            )
        loaders, self._sampler = make_resumable(loaders, self._seed, epoch, start, *self._ranks)
        return loaders

    def _saved_position(self) -> tuple[int, int]:
        """``(epoch, start)`` of the checkpoint for this run's ranks, ``(0, 0)`` without one."""
        if self._data_state is None:
            return 0, 0
        state = self._data_state
        replicas, start, saved_replicas = self._ranks[0], int(state["start"]), int(state.get("replicas", 1))
        if saved_replicas != replicas:
            start = start * saved_replicas // replicas  # the same global position, spread over the new ranks
            if not self._warned_ranks:
                self._warned_ranks = True
                rank_zero_warn(
                    f"ExactResume: the checkpoint's data position was saved with {saved_replicas} data-parallel ranks "
                    f"and this run has {replicas}: it continues after the same samples, but each rank sees other "
                    f"samples than in the original run. Resume with {saved_replicas} ranks for an exact continuation."
                )
        return int(state["epoch"]), start

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._data_state = None  # the loaders are built: from here on positions come from the sampler
        combined = trainer.train_dataloader
        loaders = (
            list(combined.values())
            if isinstance(combined, dict)
            else combined
            if isinstance(combined, (list, tuple))
            else [combined]
        )
        if isinstance(trainer.datamodule, ResumableData):  # it positions its own loaders
            reasons = []
        else:
            reasons = [r for r in (not_exact_reason(loader) for loader in loaders) if r is not None]
        if reasons and not self._warned_loader:
            self._warned_loader = True
            rank_zero_warn(self._not_exact_message(type(pl_module).__name__, combined, reasons[0]))
        elif not reasons and self._filter is None:
            # Lightning warns for every loader without state_dict(); ours resume through the datamodule.
            warnings.filterwarnings("ignore", message=_LIGHTNING_NOT_RESUMABLE)
            self._filter = warnings.filters[0]

    def _not_exact_message(self, name: str, combined: Any, reason: str) -> str:
        """The one warning for a training loader that does not resume exactly, with the fixes that apply."""
        exact = ("Weights, optimizer, schedule, loop counters and RNG states resume exactly; a run resumed from a "
                 "checkpoint saved inside an epoch sees other samples than the uninterrupted run. For an exact "
                 "data order: ")
        epoch_ends = (f"or save checkpoints only at epoch ends ({option('ModelCheckpoint', 'every_n_epochs', 1)}) and "
                      "accept a new shuffle per resumed epoch.")
        rebuild_on = option("ExactResume", "rebuild_loaders", True)
        if isinstance(combined, (dict, list, tuple)):
            count = f"{len(combined)} loader{'s' if len(combined) != 1 else ''} in a {type(combined).__name__}"
            return (
                f"ExactResume: the data order of {name}'s training loaders is not resumed exactly: train_dataloader "
                f"returns {count}, which Lightning combines and ExactResume does not rebuild (rebuild_loaders=True "
                f"rebuilds a single DataLoader only); {reason}. {exact}return one DataLoader with the default "
                "sequential or shuffled sampler over a map-style dataset that yields every part of a batch, with "
                f"{rebuild_on}; {epoch_ends}"
            )
        rebuild = ("a DataLoader with the default sequential or shuffled sampler over a map-style dataset (the "
                   f"only kind {rebuild_on} rebuilds)" if self.rebuild_loaders else
                   f"{rebuild_on} for a DataLoader with the default sequential or shuffled sampler "
                   "over a map-style dataset")
        return (
            f"ExactResume: the data order of {name}'s training loader is not resumed exactly: {reason}. {exact}"
            f"{rebuild}; train from token files with lightning_gpuopt.data.TextDataModule; {epoch_ends}"
        )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_filter()
        if self._undo_wrap is not None:
            self._undo_wrap()
            self._undo_wrap = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove_filter()

    def _remove_filter(self) -> None:
        if self._filter is not None and self._filter in warnings.filters:
            warnings.filters.remove(self._filter)
            warning_filters_changed()
        self._filter = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._snapshot, self._snapshot_step = None, None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._pending is not None:
            self._restore(trainer)
        if trainer.global_step != self._snapshot_step:  # first micro-batch of an optimizer step
            self._snapshot, self._snapshot_step = capture_rng_state(), trainer.global_step

    def _restore(self, trainer: pl.Trainer) -> None:
        pending, self._pending = self._pending, None
        states = pending["rng"]
        if len(states) != trainer.world_size:
            rank_zero_warn(
                f"ExactResume: the checkpoint holds RNG states of {len(states)} ranks but this run has "
                f"{trainer.world_size}, so they are not restored and dropout draws differ from the original run. "
                f"Resume with {len(states)} processes for an exact continuation."
            )
            return
        if states[trainer.global_rank] is None:  # every rank without a state says so (rank 0 may have one)
            warnings.warn(rank_prefixed_message(
                "ExactResume: the checkpoint was saved by one rank alone (an emergency save), so this rank's RNG "
                "state is not in it and its dropout draws differ from the original run.", trainer.global_rank,
            ))
            return
        restore_rng_state(states[trainer.global_rank])

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if trainer.state.fn != "fit" or "loops" not in checkpoint:
            return
        partial = microbatches_since_step(trainer)
        boundary = step_boundary(trainer)
        step_started = batch_counters(trainer).ready > boundary
        if step_started and self._snapshot_step == trainer.global_step and self._snapshot is not None:
            rng = self._snapshot  # a step has started since the last optimizer step: the RNG as it found it
        else:
            rng = capture_rng_state()
        states = _all_gather(rng, trainer.global_rank, trainer.world_size, self._alone)
        rollback_fit_loop_state(checkpoint["loops"]["fit_loop"], boundary)
        ended = start_next_epoch_if_ended(checkpoint["loops"]["fit_loop"])
        state: dict[str, Any] = {"rng": states, "rolled_back": partial}
        loader = trainer.train_dataloader
        if self._sampler is not None and getattr(loader, "batch_size", None):
            epoch, start = trainer.current_epoch, boundary * loader.batch_size
            if ended:  # saved after the epoch's end ran (a SIGTERM in its last batch): current_epoch is the next one
                start = 0
            elif start >= len(self._sampler):  # saved at the epoch's end: the resumed run starts the next one
                epoch, start = epoch + 1, 0
            state["data"] = {"seed": self._seed, "epoch": epoch, "start": start, "replicas": self._sampler.num_replicas}
        checkpoint.setdefault("callbacks", {})[self.state_key] = state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict if "rng" in state_dict else None
        self._data_state = dict(state_dict["data"]) if "data" in state_dict else None
        if self._data_state is not None:
            self._seed, self._seed_fixed = int(self._data_state["seed"]), True
            if self._sampler is not None:  # built before the checkpoint arrived (strategies that restore late)
                self._sampler.seed = self._seed
                self._sampler.epoch, self._sampler.start = self._saved_position()
                self._sampler.reseed_loader()
