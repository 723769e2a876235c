"""The run layer's entry point: a plain ``Trainer``'s run gets what the ``gpuopt`` command gives its own.

:func:`prepare_run` holds the run folder (one writer), names the file ``ckpt_path="last"``/``"hpc"`` means, refuses a
``fit`` that would start over a run's checkpoints, checks the checkpoint against the module, the Trainer and the data
(its tokenizer), and merges the callbacks, before any work; the ``gpuopt`` command runs the same pieces. The
behaviour: ``docs/reliability.md`` ("The run layer")."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning_gpuopt.model.checkpoint import read_checkpoint
from lightning_gpuopt.run.callbacks import merge_callbacks, prepare_resumed_fit
from lightning_gpuopt.run.folder import existing_run_problem, hold_run_folder, resolve_ckpt_path
from lightning_gpuopt.run.resume_checks import OwnCheckpoint

__all__ = ["Run", "prepare_run"]

_STAGES = ("fit", "validate", "test", "predict")


@dataclass
class Run:
    """What :func:`prepare_run` found.

    Attributes:
        ckpt_path: The checkpoint to pass to ``trainer.fit``/``validate``/... (``"last"`` resolved to its file;
            ``None``: a fit from step 0).
        checkpoint: What that checkpoint says, checked against the module (``None``: no local checkpoint file).
        locks: The locks held until the ``with`` block ends (the run folder, and a checkpoint folder outside it).
    """

    ckpt_path: Optional[str]
    checkpoint: Optional[OwnCheckpoint] = None
    locks: list[Any] = field(default_factory=list)

    def close(self, tidy: bool = False) -> None:
        """Let go of the locks; ``tidy``: the run failed, so a lock file (and folder) taking it created goes too."""
        while self.locks:
            self.locks.pop().close(tidy)


@contextmanager
def prepare_run(
    trainer: Any, model: Any, datamodule: Any = None, ckpt_path: Any = None, stage: str = "fit",
    env: Mapping[str, str] = os.environ,
) -> Iterator[Run]:
    """Prepare a run of a plain ``lightning.Trainer``, and hold its folder until the block ends.

    Example::

        trainer = Trainer(max_steps=2000, default_root_dir="runs/a")
        model, data = GPTModule(preset="124m"), TextDataModule(source="data/")
        with prepare_run(trainer, model, data, ckpt_path="last") as run:
            trainer.fit(model, datamodule=data, ckpt_path=run.ckpt_path)

    Before the block: a ``fit`` holds ``trainer.default_root_dir`` (``.gpuopt-fit.lock``: a second fit there, in
    this process or another, is refused naming its pid; a ``kill -9`` leaves no lock to remove) and each
    ``ModelCheckpoint`` folder outside it; ``ckpt_path="last"``/``"hpc"`` becomes the file, as the fit would pick it;
    a ``fit`` without ``ckpt_path`` over a run's checkpoints is refused; a checkpoint file is checked against the
    module (architecture, weights' shapes), the Trainer (steps left) and gives the data its tokenizer
    (``use_checkpoint_tokenizer``); a resumed ``fit`` gets ``ResumedOptimizerSettings`` and checkpoints that replace
    the stopped run's. Each refusal is a ``ValueError`` naming the fix, raised before anything is written.

    Args:
        trainer: The ``Trainer`` that will run.
        model: The ``LightningModule``, as built.
        datamodule: Its data module, if any.
        ckpt_path: As for ``trainer.fit``: a file, a folder (a distributed checkpoint), ``"last"``, ``"hpc"``, ``None``.
        stage: ``"fit"``, ``"validate"``, ``"test"`` or ``"predict"``: only a ``fit`` holds the folder.
        env: The environment, whose rank variables tell the process that holds the folder (rank 0).
    """
    if stage not in _STAGES:
        raise ValueError(f"prepare_run(stage={stage!r}): use one of {', '.join(map(repr, _STAGES))}.")
    merge_callbacks(trainer)  # first: the checkpoint folders locked and searched are those the run writes
    run = Run(None)
    try:
        if stage == "fit":
            run.locks = hold_run_folder(trainer, env, keep=False)
        run.ckpt_path = resolve_ckpt_path(ckpt_path, stage, trainer)
        if stage == "fit":
            problem = existing_run_problem(run.ckpt_path, trainer, (
                "prepare_run(..., ckpt_path='last')", "Trainer(default_root_dir=NEW_FOLDER)"))
            if problem:
                raise ValueError(problem)
        run.checkpoint = _check_checkpoint(trainer, model, datamodule, run.ckpt_path, stage)
        if stage == "fit" and run.ckpt_path:
            prepare_resumed_fit(trainer)
    except BaseException:
        run.close(tidy=True)
        raise
    try:
        yield run
    except BaseException:
        run.close(tidy=True)
        raise
    run.close()


def _check_checkpoint(trainer: Any, model: Any, datamodule: Any, ckpt_path: Any, stage: str) -> Optional[OwnCheckpoint]:
    """The checks of a local checkpoint file against the built module, the Trainer's length and the data."""
    if not isinstance(ckpt_path, (str, os.PathLike)) or "://" in str(ckpt_path) or not Path(ckpt_path).is_file():
        return None  # none, a distributed checkpoint's folder (the strategy's to read) or a remote file
    path = os.fspath(ckpt_path)
    loaded = read_checkpoint(path, mmap=True)  # tensors mapped, not read: shapes and hyper-parameters are used
    checkpoint = OwnCheckpoint.of(path, stage, loaded)
    checkpoint.check(model, trainer)
    if datamodule is not None and hasattr(datamodule, "use_checkpoint_tokenizer"):  # token ids keep their meaning
        datamodule.use_checkpoint_tokenizer(loaded.get(type(datamodule).__qualname__))
    return checkpoint
