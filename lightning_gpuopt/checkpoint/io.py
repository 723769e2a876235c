"""`AtomicCheckpointIO`: checkpoint files that are either the old one or the complete new one, never half-written.

Lightning's ``TorchCheckpointIO`` commits through a temporary file in the system temp folder with a
``shutil.move`` (a copy across file systems) and no fsync; ``docs/reliability.md``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lightning_gpuopt.option_checks import option
from lightning_gpuopt.model.checkpoint import CheckpointError, check_weights, read_checkpoint, weights_refusal
from lightning_gpuopt.checkpoint.atomic_files import PathLike, atomic_save, fsync_path
from lightning_gpuopt.checkpoint.safety import check_finite_weights, nonfinite_optimizer_state

__all__ = ["AtomicCheckpointIO"]


def _is_local(path: PathLike) -> bool:
    text = str(path)
    return "://" not in text or text.startswith("file://")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes checkpoints atomically and reads them with ``weights_only=True`` by default.

    A drop-in replacement for Lightning's default ``TorchCheckpointIO`` (single-file checkpoints: single
    device, DDP, FSDP with a full state dict); the ``gpuopt`` CLI uses it unless the strategy brings its own.

    Example::

        trainer = Trainer(plugins=[AtomicCheckpointIO()])

    Args:
        allow_nonfinite: Write and read checkpoints whose weights or optimizer state hold NaN/Inf. By
            default such a save raises :class:`~lightning_gpuopt.checkpoint.safety.NonFiniteCheckpointError`
            and writes nothing, and such a load raises :class:`~lightning_gpuopt.model.checkpoint.CheckpointError`.

    Note:
        Remote paths (``s3://``, ``gs://``, ...) go through Lightning's own ``fsspec`` writer, whose
        object-store uploads are all-or-nothing already.
    """

    def __init__(self, allow_nonfinite: bool = False) -> None:
        super().__init__()
        self.allow_nonfinite = allow_nonfinite

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PathLike, storage_options: Optional[Any] = None
    ) -> None:
        if not self.allow_nonfinite:
            check_finite_weights(checkpoint, path)  # before anything is written: the previous file stays
        if storage_options is not None or not _is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_save(checkpoint, path)

    @override
    def load_checkpoint(
        self,
        path: PathLike,
        map_location: Optional[Callable] = lambda storage, loc: storage,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        weights_only = True if weights_only is None else weights_only
        if not _is_local(path):
            checkpoint = super().load_checkpoint(path, map_location, weights_only)
        else:
            checkpoint = read_checkpoint(str(path).removeprefix("file://"), map_location, weights_only)
        if not self.allow_nonfinite:
            _check_finite_on_load(checkpoint, path)
        return checkpoint


def _check_finite_on_load(checkpoint: dict[str, Any], path: PathLike) -> None:
    """The weights as every door checks them (``check_weights``), and the optimizer state a resume would update with."""
    state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    anyway = option("AtomicCheckpointIO", "allow_nonfinite", True)
    if isinstance(state, dict):
        check_weights(state, path, read_anyway=anyway)
    bad, total = nonfinite_optimizer_state(checkpoint)
    if bad:
        raise CheckpointError(weights_refusal(
            path,
            f"{bad[0]!r} holds NaN/Inf ({len(bad)} of {total} optimizer-state tensors do): the run that wrote it had "
            "diverged, so a resume would skip every step",
            "Use an earlier checkpoint of that run, or start a new one", anyway))
