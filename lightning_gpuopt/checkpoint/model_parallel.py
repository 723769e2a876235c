"""`AtomicModelParallelStrategy`: Lightning's FSDP2 strategy, whose distributed checkpoints are never half written
(and which reduces gradients once per optimizer step under gradient accumulation).

Lightning writes a distributed checkpoint in place: killed after the shards and before ``meta.pt``, it
loads with new weights and old loop counters. Here it is swapped in whole (``docs/reliability.md``).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_gpuopt.checkpoint.atomic_files import (
    PathLike,
    checkpoint_to_load,
    fsync_path,
    partial_path,
    previous_path,
    remove_tree,
    swap_in,
)
from lightning_gpuopt.checkpoint.safety import NonFiniteCheckpointError, non_finite_message, nonfinite_weights

__all__ = ["AtomicModelParallelStrategy"]


class AtomicModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 with Lightning) whose distributed checkpoints are replaced atomically.

    Same arguments and behaviour as Lightning's, but saving: a checkpoint is swapped in whole, an error on
    rank 0 is raised on every rank, and weights holding NaN/Inf on any rank are not written
    (:class:`~lightning_gpuopt.checkpoint.NonFiniteCheckpointError`). Under gradient accumulation gradients
    are reduce-scattered once per optimizer step (``docs/parallel.md``).

    Example::

        trainer = Trainer(devices=8, strategy=AtomicModelParallelStrategy(data_parallel_size=8, tensor_parallel_size=1))

    Args:
        sync_every_micro_batch: Reduce-scatter gradients after every micro-batch (less memory, more traffic).
        *args, **kwargs: Those of Lightning's ``ModelParallelStrategy``.

    Note:
        The folder must be on a file system all ranks share (as for Lightning's own distributed
        checkpoints); the hidden folder is created beside the target, so the swap stays on one file system.
    """

    def __init__(self, *args: Any, sync_every_micro_batch: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sync_every_micro_batch = sync_every_micro_batch

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Every micro-batch of an optimizer step but the last runs in here: FSDP2 keeps the gradients unsharded
        and reduce-scatters them once, after the last (as DDP's ``no_sync``)."""
        from torch.distributed.fsdp import FSDPModule

        modules = [] if self.sync_every_micro_batch else self.lightning_module.modules()
        sharded = [m for m in modules if isinstance(m, FSDPModule)]
        for module in sharded:
            module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for module in sharded:
                module.set_requires_gradient_sync(True, recurse=False)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Optional[Any] = None
    ) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(filepath))
        partial = partial_path(path)
        state = checkpoint.get("state_dict") or {}
        bad = nonfinite_weights(state)  # this rank's shards; the ranks agree before anything is written
        if not self.reduce_boolean_decision(not bad, all=True):
            raise NonFiniteCheckpointError(
                non_finite_message(path, len(bad), len(state), bad[0] if bad else "on another rank", path.exists(),
                                   guarded="NonFiniteGuard" in (checkpoint.get("callbacks") or {}))
            )

        def prepare() -> None:
            remove_tree(partial)  # what a killed save left
            partial.parent.mkdir(parents=True, exist_ok=True)

        def commit() -> None:
            fsync_path(partial / "meta.pt")  # the shards are fsynced by the distributed-checkpoint writer
            fsync_path(partial)
            swap_in(partial, path)

        self._on_rank_zero(prepare, f"Could not prepare {partial} for the checkpoint {path}")
        super().save_checkpoint(checkpoint, partial, storage_options)  # every rank writes its shard
        self.barrier("atomic_checkpoint_written")
        self._on_rank_zero(commit, f"Could not swap the checkpoint written to {partial} in as {path}")

    def _on_rank_zero(self, work: Any, failure: str) -> None:
        """Run ``work`` on rank 0; all ranks agree on the outcome, so an error is raised on every rank."""
        error: Optional[BaseException] = None
        if self.global_rank == 0:
            try:
                work()
            except Exception as err:
                error = err
        if not self.reduce_boolean_decision(error is None, all=True):
            raise RuntimeError(
                failure + (f": {type(error).__name__}: {error}" if error is not None else " (the error is on rank 0).")
            ) from error

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return super().load_checkpoint(checkpoint_to_load(Path(checkpoint_path)), weights_only=weights_only)

    @override
    def remove_checkpoint(self, filepath: PathLike) -> None:
        super().remove_checkpoint(filepath)
        if self.global_rank == 0:
            for leftover in (partial_path(Path(filepath)), previous_path(Path(filepath))):
                remove_tree(leftover)
