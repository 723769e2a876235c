"""A checkpoint to resume or load, checked against the module, data and Trainer as built, before any work.

The checks that need no command-line configuration: the architecture and the weights' shapes against the built
module, the steps left to train, the data's tokenizer (:func:`~lightning_gpuopt.run.prepare_run` and the ``gpuopt``
command both run them). The rules: ``docs/reliability.md`` ("Resuming and predicting from a checkpoint")."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Union

from lightning.pytorch.utilities import rank_zero_info

from lightning_gpuopt.model.checkpoint import CheckpointError, read_checkpoint
from lightning_gpuopt.model.config import PRESETS
from lightning_gpuopt.option_checks import from_command_line, option

__all__ = [
    "ARCHITECTURE",
    "OwnCheckpoint",
    "check_architecture",
    "check_steps_left",
    "epochs_done",
    "normalized",
    "resolved_architecture",
]

ARCHITECTURE = ("preset", "n_layer", "n_head", "n_embd", "n_kv_head")  # block_size and vocab_size come from the data


def normalized(value: Any) -> Any:
    """A hyper-parameter as compared: a list as a tuple (YAML and the parser give lists)."""
    return tuple(value) if isinstance(value, list) else value


def resolved_architecture(saved: dict[str, Any], name: str) -> Any:
    """A ``GPTModule``'s value of an architecture field in ``saved`` (hyper-parameters), with the preset's where the
    override was ``None``."""
    if name == "preset" or saved.get(name) is not None:
        return saved.get(name)
    return PRESETS.get(saved.get("preset"), {}).get(name)


def _ckpt_option() -> str:
    return "--ckpt_path" if from_command_line() else "ckpt_path"


def check_architecture(checkpoint: "OwnCheckpoint", model: Any) -> None:
    """Refuse a built ``GPTModule`` (a module with a ``preset`` hyper-parameter) whose architecture is not the
    checkpoint's: ``n_head`` changes no weight's shape, so the shapes alone would load it and compute another model."""
    built = {k: normalized(v) for k, v in dict(getattr(model, "hparams", None) or {}).items()}
    if "preset" not in built or "preset" not in checkpoint.hparams:
        return
    names = (*ARCHITECTURE, "block_size", "vocab_size")
    pairs = {k: (resolved_architecture(built, k), resolved_architecture(checkpoint.hparams, k)) for k in names}
    wrong = [f"{k}={now!r} but the checkpoint has {k}={saved!r}" for k, (now, saved) in pairs.items()
             if saved is not None and now != saved]
    if wrong:
        raise ValueError(
            f"The architecture cannot change when loading the checkpoint {checkpoint.path!r}: {type(model).__name__} "
            f"is built with " + "; ".join(wrong) + ". Build it with the checkpoint's values, or start a new run "
            f"without {_ckpt_option()}."
        )


def epochs_done(checkpoint: dict[str, Any]) -> Optional[int]:
    """The training epochs a Lightning checkpoint has processed, as the fit loop counts them to stop at ``max_epochs``
    (``epoch_progress.current.processed``, else ``epoch``; ``None``: neither)."""
    fit_loop = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    progress = (fit_loop.get("epoch_progress") or {}).get("current") or {}
    done = progress.get("processed", checkpoint.get("epoch"))
    return done if isinstance(done, int) else None


def check_steps_left(step: Optional[int], path: str, trainer: Any, epochs: Optional[int] = None) -> None:
    """Refuse a resumed ``fit`` whose ``trainer.max_steps`` or ``max_epochs`` the checkpoint (at ``step``, with
    ``epochs`` processed; ``None``: not checked) has reached: Lightning would train nothing and exit 0. ``trainer``:
    a ``Trainer``, or the ``gpuopt`` command's parsed ``trainer`` group."""
    trainer = trainer or {}
    get = trainer.get if hasattr(trainer, "get") else lambda name: getattr(trainer, name, None)
    reached = (("max_steps", step, f"is at step {step}"),
               ("max_epochs", epochs, f"has trained {epochs} epoch{'' if epochs == 1 else 's'}"))
    for name, done, where in reached:
        limit = get(name)
        if isinstance(done, int) and isinstance(limit, int) and 0 <= limit <= done:
            evaluate = (f"use gpuopt validate --ckpt_path {path}" if from_command_line()
                        else f"use trainer.validate(model, ckpt_path={path!r})")
            raise ValueError(
                f"The checkpoint {path!r} {where} and trainer.{name}={limit}, so this fit would train nothing (and "
                f"write no checkpoint). To train on, raise trainer.{name} above {done} (e.g. "
                f"{option('Trainer', name, 2 * done if done else 1)}); to evaluate the checkpoint, {evaluate}."
            )



@dataclass
class OwnCheckpoint:
    """What a checkpoint to resume or load says of its module, checked against the module as built (a module of
    your own in the ``gpuopt`` command, and any module through :func:`~lightning_gpuopt.run.prepare_run`)."""

    path: str
    subcommand: str
    hparams: dict[str, Any]  # its hyper_parameters (empty when the module saved none)
    shapes: dict[str, tuple[int, ...]]  # of each tensor of its state_dict
    global_step: Optional[int] = None
    epochs_done: Optional[int] = None

    @classmethod
    def read(cls, path: Union[str, os.PathLike], subcommand: str = "fit") -> "OwnCheckpoint":
        """The checkpoint at ``path``, a local Lightning checkpoint file, read for ``subcommand``."""
        return cls.of(os.fspath(path), subcommand, read_checkpoint(os.fspath(path), mmap=True))  # tensors mapped

    @classmethod
    def of(cls, path: str, subcommand: str, checkpoint: Any) -> "OwnCheckpoint":
        """What the loaded ``checkpoint`` (read from ``path``) says; refused if it is not a Lightning checkpoint."""
        state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
        if not isinstance(state, dict):
            raise CheckpointError(
                f"{path!r} is not a Lightning checkpoint (no 'state_dict'): give a checkpoint written by a Trainer, "
                "e.g. .../checkpoints/last.ckpt."
            )
        hparams = checkpoint.get("hyper_parameters") or {}
        return cls(
            path, subcommand, {k: normalized(v) for k, v in dict(hparams).items() if not str(k).startswith("_")},
            {k: tuple(v.shape) for k, v in state.items() if hasattr(v, "shape")},
            checkpoint.get("global_step"), epochs_done(checkpoint),
        )

    def check(self, model: Any, trainer: Any) -> None:
        """Every check of the checkpoint against the built ``model`` and, for a ``fit``, ``trainer`` (a ``Trainer`` or
        the command's parsed ``trainer`` group), first thing to fix first: the architecture, the weights' shapes, the
        steps left; then the settings that differ are said."""
        check_architecture(self, model)
        self.check_weights(model)
        if self.subcommand == "fit":
            check_steps_left(self.global_step, self.path, trainer, self.epochs_done)
        self.report(model)

    def differences(self, model: Any) -> dict[str, tuple[Any, Any]]:
        """The hyper-parameters of ``model`` (as built) unlike the checkpoint's: ``{name: (checkpoint's, model's)}``,
        with :data:`_ABSENT` for a name one side lacks."""
        hparams = dict(getattr(model, "hparams", None) or {})
        built = {k: normalized(v) for k, v in hparams.items() if not str(k).startswith("_")}
        names = dict.fromkeys([*self.hparams, *built])
        pairs = {k: (self.hparams.get(k, _ABSENT), built.get(k, _ABSENT)) for k in names}
        return {k: pair for k, pair in pairs.items() if not _same(*pair)}

    def check_weights(self, model: Any) -> None:
        """Refuse a model whose weights have other shapes than the checkpoint's, before Lightning's ``load_state_dict``
        (only tensors both hold: missing or extra names are ``strict_loading``'s)."""
        built = {k: tuple(v.shape) for k, v in model.state_dict().items() if hasattr(v, "shape")}
        wrong = [(k, self.shapes[k], built[k]) for k in self.shapes if k in built and built[k] != self.shapes[k]]
        if not wrong:
            return
        shown = "; ".join(f"{k} {list(saved)} in the checkpoint, {list(now)} in the model"
                          for k, saved, now in wrong[:3])
        options = ", ".join(f"{k}={old!r}" for k, (old, _) in self.differences(model).items() if old is not _ABSENT)
        hint = f"the checkpoint's options ({options})" if options else "the options the checkpoint was trained with"
        raise ValueError(
            f"The checkpoint {self.path!r} does not fit {type(model).__name__} as configured: {len(wrong)} of "
            f"{len(built)} weights differ in shape (first: {shown}). Build the module with {hint}, or start a new run "
            f"in a new {option('Trainer', 'default_root_dir')} without {_ckpt_option()}."
        )

    def report(self, model: Any) -> None:
        """On a resumed ``fit``, say once which hyper-parameters differ from the checkpoint's and that its optimizer
        state is restored as saved (logged once, rank 0)."""
        differences = self.differences(model)
        if self.subcommand != "fit" or not differences:
            return
        shown = ", ".join(f"{k} {_text(old)} -> {_text(new)}" for k, (old, new) in differences.items())
        if "learning_rate" in self.hparams and "preset" in self.hparams:  # a GPTModule: ResumedOptimizerSettings
            rank_zero_info(f"fit {_ckpt_option()} {self.path}: applied over the checkpoint's: {shown}.")
            return
        rank_zero_info(
            f"fit {_ckpt_option()} {self.path}: {type(model).__name__} is built with hyper-parameters unlike the "
            f"checkpoint's ({shown}); the checkpoint's optimizer and scheduler state (learning rates included) is "
            "restored as saved, so an optimizer setting among them takes no effect. To apply one, start a new run, or "
            "change checkpoint['optimizer_states'] in the module's on_load_checkpoint."
        )


_ABSENT = object()  # a hyper-parameter that one side (the checkpoint or the built module) does not have


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # a tensor or array hyper-parameter: no single truth value
        return repr(a) == repr(b)


def _text(value: Any) -> str:
    return "(none)" if value is _ABSENT else repr(value)
