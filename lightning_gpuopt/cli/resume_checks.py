"""What a ``gpuopt fit/predict --ckpt_path`` run takes from the checkpoint, and what from the command line.

LightningCLI parses the checkpoint's hyper-parameters over the configuration, dropping options given with
``--ckpt_path`` without a word. Here, before anything is built, an asked architecture change is refused, other
asked settings are applied and reported, a fit with nothing left to train is refused, and the data gets the
run's tokenizer; a module of one's own is checked after it is built (:class:`OwnCheckpoint`). The rules:
``docs/reliability.md``. The CLI replaces ``LightningCLI._parse_ckpt_path`` with :func:`merge_checkpoint_settings`
(``tests/cli/test_resume_checks.py`` fails if an upgrade renames it)."""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.utilities import rank_zero_info

from lightning_gpuopt.cli.run_folder import checkpoint_dirs, existing_run_problem, last_checkpoints, resolve_ckpt_path
from lightning_gpuopt.cli.run_summary import command_line
from lightning_gpuopt.internals import no_version_counter
from lightning_gpuopt.model.checkpoint import (
    CheckpointError, check_weights, gpt_state_dict, gptmodule_hparams, init_from_anyway, read_checkpoint,
)
from lightning_gpuopt.model.config import PRESETS

__all__ = [
    "ARCHITECTURE",
    "CheckpointSettings",
    "OwnCheckpoint",
    "asked_settings",
    "check_steps_left",
    "merge_checkpoint_settings",
    "merge_init_weights",
    "prepare_resumed_fit",
    "resolve_run_folder",
]

ARCHITECTURE = ("preset", "n_layer", "n_head", "n_embd", "n_kv_head")  # block_size and vocab_size come from the data
_SPECIAL_CKPT_PATHS = {"last", "best", "hpc", "registry"}

# TextDataModule options that only predict reads: never a difference from the training run worth reporting.
_PREDICT_ONLY_DATA = frozenset({"prompts", "samples_per_prompt"})


def _norm(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def asked_settings(model_config: dict[str, Any], model_class: type, linked: bool = True) -> dict[str, Any]:
    """The options of a parsed ``model`` group whose value is not ``model_class``'s default (``linked``: leaving out
    ``block_size`` and ``vocab_size``, which the data sets)."""
    defaults = {
        name: p.default
        for name, p in inspect.signature(model_class.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    return {
        k: _norm(v)
        for k, v in model_config.items()
        if k in defaults and not (linked and k in ("block_size", "vocab_size")) and _norm(v) != _norm(defaults[k])
    }


@dataclass
class CheckpointSettings:
    """The outcome of comparing a run's configuration with its checkpoint's hyper-parameters."""

    path: str
    subcommand: str
    saved: dict[str, Any]  # the checkpoint's GPTModule hyper-parameters
    applied: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # asked, unlike the checkpoint's: (its, asked)
    kept: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # not asked; the checkpoint's used: (its, default)
    data: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # data options unlike the run's, used as given
    data_state: Optional[dict[str, Any]] = None  # the data module's saved state (its tokenizer)
    global_step: Optional[int] = None
    epochs_done: Optional[int] = None  # training epochs processed (epochs_done)
    option: str = "--ckpt_path"  # how the checkpoint was named: --ckpt_path, or --model.init_from for weights alone

    def check_model(self, model: Any) -> None:
        """Refuse a built model whose data-linked shape (``block_size``, ``vocab_size``) is not the checkpoint's."""
        errors = []
        for name, flag in (("block_size", "data.block_size"), ("vocab_size", "data.vocab_size")):
            saved, built = self.saved.get(name), getattr(model.config, name, None)
            if saved is not None and built != saved:
                fix = f"set {flag} {saved} (as in the training run)"
                if name == "vocab_size":
                    fix += ", or data.tokenizer to the training run's tokenizer.json"
                errors.append(f"model.{name}={built} (linked from {flag}) but the checkpoint has {name}={saved}: {fix}")
        if errors:
            raise ValueError(_refusal(self.path, errors, self.option))

    def report(self) -> None:
        """Say which asked settings replace the checkpoint's (logged once, rank 0)."""
        if self.applied:
            changes = ", ".join(f"model.{k} {old!r} -> {new!r}" for k, (old, new) in self.applied.items())
            rank_zero_info(f"{self.subcommand} --ckpt_path {self.path}: applied over the checkpoint's: {changes}.")
        if self.kept:
            kept = ", ".join(f"model.{k}={old!r} (over the configured {new!r})" for k, (old, new) in self.kept.items())
            rank_zero_info(f"{self.subcommand} --ckpt_path {self.path}: from the checkpoint: {kept}.")
        if self.data:
            data = ", ".join(f"data.{k} {old!r} -> {new!r}" for k, (old, new) in self.data.items())
            rank_zero_info(f"{self.subcommand} --ckpt_path {self.path}: data unlike the training run's: {data}.")


def _resolved(saved: dict[str, Any], name: str) -> Any:
    """The checkpoint's value of an architecture field, with the preset's where the override was ``None``."""
    if name == "preset" or saved.get(name) is not None:
        return saved.get(name)
    return PRESETS.get(saved.get("preset"), {}).get(name)


def _refusal(path: str, problems: list[str], option: str = "--ckpt_path") -> str:
    if option == "--ckpt_path":
        return (
            f"The architecture cannot change when loading the checkpoint {path!r}: " + "; ".join(problems) + ". "
            "Drop those options (the checkpoint's values are used), or start a new run without --ckpt_path."
        )
    return (
        f"model.init_from={path!r} holds weights of another architecture than this run's: " + "; ".join(problems) + ". "
        "Drop those options (the file's architecture is used), or start from a checkpoint of this architecture."
    )


def _local_file(ckpt_path: Any) -> bool:
    if not ckpt_path or str(ckpt_path) in _SPECIAL_CKPT_PATHS or "://" in str(ckpt_path):
        return False
    return not Path(ckpt_path).is_dir()  # a distributed (FSDP2) checkpoint folder: left to the strategy


def resolve_run_folder(config: Any, argv: Optional[list[str]] = None) -> None:
    """Put the file ``--ckpt_path last`` / ``hpc`` names into ``config``, before :func:`merge_checkpoint_settings` (so
    it is checked as an explicit path is); refuse a ``fit`` that would overwrite a run, naming the two commands to
    choose from as ``argv`` (the command line, without the program) would run them."""
    subcommand = config.get("subcommand")
    if not subcommand:
        return
    group = config[subcommand]
    trainer = group.get("trainer")
    ckpt_path = group.get("ckpt_path")
    if subcommand == "fit":
        resume = ("--ckpt_path", "last", *_steps_to_continue(trainer))
        if argv is None:
            base = f"gpuopt fit {_config_hint(group)}".strip()
            commands = (f"{base} {' '.join(resume)}", f"{base} --trainer.default_root_dir NEW_FOLDER")
        else:
            commands = (command_line(argv, "fit", resume),
                        command_line(argv, "fit", ("--trainer.default_root_dir", "NEW_FOLDER")))
        problem = existing_run_problem(ckpt_path, trainer, commands)
        if problem:
            raise ValueError(problem)
    group["ckpt_path"] = resolve_ckpt_path(ckpt_path, subcommand, trainer)


def _steps_to_continue(trainer: Any) -> tuple[str, ...]:
    """``("--trainer.max_steps", N)`` for the command that continues the run in the run folder when its last checkpoint
    has reached this fit's ``max_steps`` (that command would train nothing): as many steps again past the checkpoint."""
    limit = (trainer or {}).get("max_steps")
    found = last_checkpoints(checkpoint_dirs(trainer)) if isinstance(limit, int) and limit >= 0 else []
    try:
        step = read_checkpoint(found[0], mmap=True).get("global_step") if found else None
    except (CheckpointError, AttributeError):  # an unreadable file: the resume's own check says why
        return ()
    if not isinstance(step, int) or step < limit:
        return ()
    return ("--trainer.max_steps", str(step + max(limit, 1)))


def _config_hint(group: Any) -> str:
    configs = group.get("config") or []
    paths = [str(getattr(c, "relative", c)) for c in (configs if isinstance(configs, list) else [configs])]
    return " ".join(f"--config {p}" for p in paths) + " ..." if paths else "..."


def epochs_done(checkpoint: dict[str, Any]) -> Optional[int]:
    """The training epochs a Lightning checkpoint has processed, as the fit loop counts them to stop at ``max_epochs``
    (``epoch_progress.current.processed``, else ``epoch``; ``None``: neither)."""
    progress = (((checkpoint.get("loops") or {}).get("fit_loop") or {}).get("epoch_progress") or {}).get("current") or {}
    done = progress.get("processed", checkpoint.get("epoch"))
    return done if isinstance(done, int) else None


def check_steps_left(step: Optional[int], path: str, trainer: Any, epochs: Optional[int] = None) -> None:
    """Refuse a resumed ``fit`` whose ``trainer.max_steps`` or ``max_epochs`` the checkpoint (at ``step``, with
    ``epochs`` processed; ``None``: not checked) has reached: Lightning would train nothing and exit 0."""
    trainer = trainer or {}
    reached = (("max_steps", step, f"is at step {step}"),
               ("max_epochs", epochs, f"has trained {epochs} epoch{'' if epochs == 1 else 's'}"))
    for option, done, where in reached:
        limit = trainer.get(option)
        if isinstance(done, int) and isinstance(limit, int) and 0 <= limit <= done:
            raise ValueError(
                f"The checkpoint {path!r} {where} and trainer.{option}={limit}, so this fit would train nothing (and "
                f"write no checkpoint). To train on, raise trainer.{option} above {done} (e.g. --trainer.{option} "
                f"{2 * done if done else 1}); to evaluate the checkpoint, use gpuopt validate --ckpt_path {path}."
            )


def merge_checkpoint_settings(
    parser: Any, config: Any, model_class: type, data_class: Optional[type] = None
) -> tuple[Any, Optional[CheckpointSettings]]:
    """Merge a ``--ckpt_path`` checkpoint's hyper-parameters into ``config``; return it and the comparison (``None``
    without a local checkpoint file). ``model_class``'s defaults tell asked settings from unasked ones."""
    subcommand = config.get("subcommand")
    if not subcommand:
        return config, None
    ckpt_path = config[subcommand].get("ckpt_path")
    if not _local_file(ckpt_path):
        return config, None
    path = os.fspath(ckpt_path)
    checkpoint = read_checkpoint(path, mmap=True)  # tensors mapped, not read: only the hyper-parameters are used
    # init_from names where the checkpoint's run started, not what it holds: never merged (see merge_init_weights)
    saved = {k: _norm(v) for k, v in gptmodule_hparams(checkpoint, path).items() if not k.startswith("_") and k != "init_from"}
    if "pytorch-lightning_version" not in checkpoint:
        raise CheckpointError(
            f"{path!r} is not a Lightning checkpoint (no 'pytorch-lightning_version'): give a checkpoint written by "
            "a Trainer fitting lightning_gpuopt.GPTModule; for weights alone, use lightning_gpuopt.model.load_gpt."
        )
    model_config = config[subcommand].model
    model_config = model_config.as_dict() if hasattr(model_config, "as_dict") else dict(model_config)
    asked = asked_settings(model_config, model_class)
    asked.pop("init_from", None)
    refused = [
        f"model.{k}={asked[k]!r} but the checkpoint has {k}={_resolved(saved, k)!r}"
        for k in ARCHITECTURE
        if k in asked and _resolved(saved, k) != asked[k]
    ]
    if refused:
        raise ValueError(_refusal(path, refused))
    known = set(inspect.signature(model_class.__init__).parameters) - {"self"}
    merged = {k: v for k, v in saved.items() if k in known}
    settings = CheckpointSettings(path, subcommand, saved, global_step=checkpoint.get("global_step"),
                                  epochs_done=epochs_done(checkpoint))
    if data_class is not None:  # Lightning saves a data module's state under its class's qualified name
        settings.data_state = checkpoint.get(data_class.__qualname__)
    for k, v in asked.items():
        if k not in ARCHITECTURE and saved.get(k) != v:
            settings.applied[k] = (saved.get(k), v)
        merged[k] = v
    for k, v in merged.items():
        configured = _norm(model_config.get(k))
        if k not in asked and k not in ("block_size", "vocab_size") and configured != v:
            settings.kept[k] = (v, configured)
    merged = {k: list(v) if isinstance(v, tuple) else v for k, v in merged.items()}
    saved_data = checkpoint.get("datamodule_hyper_parameters") or {}
    data_config = config[subcommand].get("data")
    data_config = data_config.as_dict() if hasattr(data_config, "as_dict") else dict(data_config or {})
    for k, v in data_config.items():
        if k in _PREDICT_ONLY_DATA:  # what to generate from, not what was trained on
            continue
        if k in saved_data and _norm(saved_data[k]) != _norm(v):
            settings.data[k] = (_norm(saved_data[k]), _norm(v))
    config = parser.parse_object({subcommand: {"model": merged}}, config)
    return config, settings


def merge_init_weights(
    parser: Any, config: Any, model_class: type, data_class: Optional[type] = None
) -> tuple[Any, Optional[CheckpointSettings]]:
    """Take the architecture (and the data's block and vocabulary sizes, unless asked) of ``model.init_from``'s
    checkpoint into ``config``, refusing an asked architecture that differs, as with ``--ckpt_path``; every other
    setting is the configuration's (a new run: fresh optimizer and schedule). The data gets the checkpoint's
    tokenizer (``data_state``). With ``--ckpt_path`` that file holds the weights: ``init_from`` is dropped, said once.
    """
    subcommand = config.get("subcommand")
    if not subcommand:
        return config, None
    group = config[subcommand]
    model_config = group.model.as_dict() if hasattr(group.model, "as_dict") else dict(group.model)
    init_from = model_config.get("init_from")
    if not init_from:
        return config, None
    if group.get("ckpt_path"):
        rank_zero_info(f"model.init_from={init_from!r} is not read: --ckpt_path {group.get('ckpt_path')} holds the weights.")
        return parser.parse_object({subcommand: {"model": {"init_from": None}}}, config), None
    path = os.fspath(Path(init_from).expanduser())
    checkpoint = read_checkpoint(path, mmap=True)  # tensors mapped: the hyper-parameters are compared here
    saved = {k: _norm(v) for k, v in gptmodule_hparams(checkpoint, path).items() if not k.startswith("_")}
    check_weights(gpt_state_dict(checkpoint), path, read_anyway=init_from_anyway(path))  # before data is prepared
    asked = asked_settings(model_config, model_class)
    refused = [f"it has {k}={_resolved(saved, k)!r} and this run asks model.{k}={asked[k]!r}"
               for k in ARCHITECTURE if k in asked and _resolved(saved, k) != asked[k]]
    if refused:
        raise ValueError(_refusal(path, refused, "--model.init_from"))
    settings = CheckpointSettings(path, subcommand, saved, global_step=checkpoint.get("global_step"), option="--model.init_from")
    settings.kept = {k: (saved[k], v) for k in ARCHITECTURE if k in saved and (v := _norm(model_config.get(k))) not in (None, saved[k])}
    merged = {"model": {**{k: saved[k] for k in ARCHITECTURE if k in saved}, "init_from": path}}
    if data_class is not None and group.get("data") is not None:  # the data's sizes, unless asked: the model's link to them
        settings.data_state = checkpoint.get(data_class.__qualname__)
        data_config = group.data.as_dict() if hasattr(group.data, "as_dict") else dict(group.data)
        asked_data = asked_settings(data_config, data_class, linked=False)
        merged["data"] = {k: saved[k] for k in ("block_size", "vocab_size") if saved.get(k) is not None and k not in asked_data}
    return parser.parse_object({subcommand: merged}, config), settings


@dataclass
class OwnCheckpoint:
    """What a ``--ckpt_path`` checkpoint of a module of your own says, checked against the module as built."""

    path: str
    subcommand: str
    hparams: dict[str, Any]  # its hyper_parameters (empty when the module saved none)
    shapes: dict[str, tuple[int, ...]]  # of each tensor of its state_dict
    global_step: Optional[int] = None
    epochs_done: Optional[int] = None

    @classmethod
    def read(cls, config: Any) -> Optional["OwnCheckpoint"]:
        """The checkpoint a parsed configuration's ``ckpt_path`` names (``None``: no local file is given)."""
        subcommand = config.get("subcommand")
        ckpt_path = config[subcommand].get("ckpt_path") if subcommand else None
        if not _local_file(ckpt_path):
            return None
        path = os.fspath(ckpt_path)
        checkpoint = read_checkpoint(path, mmap=True)  # tensors mapped, not read: only shapes are used
        state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
        if not isinstance(state, dict):
            raise CheckpointError(
                f"{path!r} is not a Lightning checkpoint (no 'state_dict'): give a checkpoint written by a Trainer, "
                "e.g. .../checkpoints/last.ckpt."
            )
        hparams = checkpoint.get("hyper_parameters") or {}
        return cls(
            path, subcommand, {k: _norm(v) for k, v in dict(hparams).items() if not str(k).startswith("_")},
            {k: tuple(v.shape) for k, v in state.items() if hasattr(v, "shape")},
            checkpoint.get("global_step"), epochs_done(checkpoint),
        )

    def differences(self, model: Any) -> dict[str, tuple[Any, Any]]:
        """The hyper-parameters of ``model`` (as built) unlike the checkpoint's: ``{name: (checkpoint's, model's)}``,
        with :data:`_ABSENT` for a name one side lacks."""
        built = {k: _norm(v) for k, v in dict(getattr(model, "hparams", None) or {}).items() if not str(k).startswith("_")}
        pairs = {k: (self.hparams.get(k, _ABSENT), built.get(k, _ABSENT)) for k in dict.fromkeys([*self.hparams, *built])}
        return {k: pair for k, pair in pairs.items() if not _same(*pair)}

    def check_weights(self, model: Any) -> None:
        """Refuse a model whose weights have other shapes than the checkpoint's, before Lightning's ``load_state_dict``
        (only tensors both hold: missing or extra names are ``strict_loading``'s)."""
        built = {k: tuple(v.shape) for k, v in model.state_dict().items() if hasattr(v, "shape")}
        wrong = [(k, self.shapes[k], built[k]) for k in self.shapes if k in built and built[k] != self.shapes[k]]
        if not wrong:
            return
        shown = "; ".join(f"{k} {list(saved)} in the checkpoint, {list(now)} in the model" for k, saved, now in wrong[:3])
        options = ", ".join(f"{k}={old!r}" for k, (old, _) in self.differences(model).items() if old is not _ABSENT)
        hint = f"the checkpoint's options ({options})" if options else "the options the checkpoint was trained with"
        raise ValueError(
            f"The checkpoint {self.path!r} does not fit {type(model).__name__} as configured: {len(wrong)} of "
            f"{len(built)} weights differ in shape (first: {shown}). Build the module with {hint}, or start a new run "
            "in a new trainer.default_root_dir without --ckpt_path."
        )

    def report(self, model: Any) -> None:
        """On a resumed ``fit``, say once which hyper-parameters differ from the checkpoint's and that its optimizer
        state is restored as saved (logged once, rank 0)."""
        differences = self.differences(model)
        if self.subcommand != "fit" or not differences:
            return
        shown = ", ".join(f"{k} {_text(old)} -> {_text(new)}" for k, (old, new) in differences.items())
        rank_zero_info(
            f"fit --ckpt_path {self.path}: {type(model).__name__} is built with hyper-parameters unlike the checkpoint's "
            f"({shown}); the checkpoint's optimizer and scheduler state (learning rates included) is restored as saved, "
            "so an optimizer setting among them takes no effect. To apply one, start a new run, or change "
            "checkpoint['optimizer_states'] in the module's on_load_checkpoint."
        )


_ABSENT = object()  # a hyper-parameter that one side (the checkpoint or the built module) does not have


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # a tensor or array hyper-parameter: no single truth value
        return repr(a) == repr(b)


def _text(value: Any) -> str:
    return "(none)" if value is _ABSENT else repr(value)


def prepare_resumed_fit(trainer: Any) -> None:
    """On a resumed ``fit``, make each ``ModelCheckpoint`` replace a file of the same name (the stopped run's) instead
    of adding ``-vN`` beside it (``internals.no_version_counter``: no public setter), and add
    ``ResumedOptimizerSettings``, which applies asked optimizer settings over the restored ones."""
    from lightning_gpuopt.callbacks.resumed_optimizer import ResumedOptimizerSettings

    for callback in trainer.checkpoint_callbacks:
        no_version_counter(callback)
    if not any(isinstance(c, ResumedOptimizerSettings) for c in trainer.callbacks):
        trainer.callbacks.append(ResumedOptimizerSettings())
