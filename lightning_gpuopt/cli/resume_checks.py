"""What a ``gpuopt fit/predict --ckpt_path`` run takes from the checkpoint, and what from the command line.

LightningCLI parses the checkpoint's hyper-parameters over the configuration, dropping options given with
``--ckpt_path`` without a word. Here, before anything is built, an asked architecture change is refused, other
asked settings are applied and reported, and the data gets the run's tokenizer; the checks that need no
configuration (a module of one's own, the steps left) are the run layer's (:mod:`lightning_gpuopt.run`). The rules:
``docs/reliability.md``. The CLI runs :func:`merge_checkpoint_settings` after parsing, in place of LightningCLI's
merge, which is shown no ``ckpt_path`` (``GPTCLI.parse_arguments``)."""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.utilities import rank_zero_info

from lightning_gpuopt.cli.run_summary import command_line
from lightning_gpuopt.model.checkpoint import (
    CheckpointError, check_weights, gpt_state_dict, gptmodule_hparams, init_from_anyway, read_checkpoint,
)
from lightning_gpuopt.model.hf import hf_architecture, is_hf_folder, resolve_hf
from lightning_gpuopt.run.folder import checkpoint_dirs, existing_run_problem, last_checkpoints, resolve_ckpt_path
from lightning_gpuopt.run.resume_checks import ARCHITECTURE, epochs_done, normalized as _norm
from lightning_gpuopt.run.resume_checks import resolved_architecture as _resolved

__all__ = [
    "CheckpointSettings",
    "asked_settings",
    "checkpoint_file",
    "merge_checkpoint_settings",
    "merge_hf_init",
    "merge_init_weights",
    "resolve_run_folder",
]

_SPECIAL_CKPT_PATHS = {"last", "best", "hpc", "registry"}

# TextDataModule options that only predict reads: never a difference from the training run worth reporting.
_PREDICT_ONLY_DATA = frozenset({"prompts", "samples_per_prompt"})


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
        """Refuse a built model whose data-linked shape (``block_size``, ``vocab_size``) is not the checkpoint's (a
        saved ``architecture`` fixes them: the data's sizes are only checked to fit it, at setup)."""
        if self.saved.get("architecture"):
            return
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


def checkpoint_file(config: Any) -> Optional[str]:
    """The local checkpoint file a parsed configuration's ``ckpt_path`` names (``None``: none is given)."""
    subcommand = config.get("subcommand")
    ckpt_path = config[subcommand].get("ckpt_path") if subcommand else None
    return os.fspath(ckpt_path) if _local_file(ckpt_path) else None


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
    saved = {
        k: _norm(v)
        for k, v in gptmodule_hparams(checkpoint, path).items()
        if not k.startswith("_") and k != "init_from"
    }
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
        rank_zero_info(f"model.init_from={init_from!r} is not read: --ckpt_path {group.get('ckpt_path')} holds the "
                       "weights.")
        merged: dict[str, Any] = {"model": {"init_from": None}}
        if is_hf_folder(init_from) and data_class is not None and group.get("data") is not None:
            merged["data"] = _hf_tokenizer(resolve_hf(init_from), group.data)  # the run's tokenizer, as at its start
        return parser.parse_object({subcommand: merged}, config), None
    if is_hf_folder(init_from):
        return merge_hf_init(parser, config, model_class, data_class), None
    path = os.fspath(Path(init_from).expanduser())
    checkpoint = read_checkpoint(path, mmap=True)  # tensors mapped: the hyper-parameters are compared here
    saved = {k: _norm(v) for k, v in gptmodule_hparams(checkpoint, path).items() if not k.startswith("_")}
    check_weights(gpt_state_dict(checkpoint), path, read_anyway=init_from_anyway(path))  # before data is prepared
    asked = asked_settings(model_config, model_class)
    refused = [f"it has {k}={_resolved(saved, k)!r} and this run asks model.{k}={asked[k]!r}"
               for k in ARCHITECTURE if k in asked and _resolved(saved, k) != asked[k]]
    if refused:
        raise ValueError(_refusal(path, refused, "--model.init_from"))
    settings = CheckpointSettings(
        path, subcommand, saved, global_step=checkpoint.get("global_step"), option="--model.init_from"
    )
    settings.kept = {
        k: (saved[k], v)
        for k in ARCHITECTURE
        if k in saved and (v := _norm(model_config.get(k))) not in (None, saved[k])
    }
    merged = {"model": {**{k: saved[k] for k in ARCHITECTURE if k in saved}, "init_from": path}}
    # the data's sizes, unless asked: the model's link to them
    if data_class is not None and group.get("data") is not None:
        settings.data_state = checkpoint.get(data_class.__qualname__)
        data_config = group.data.as_dict() if hasattr(group.data, "as_dict") else dict(group.data)
        asked_data = asked_settings(data_config, data_class, linked=False)
        merged["data"] = {
            k: saved[k] for k in ("block_size", "vocab_size") if saved.get(k) is not None and k not in asked_data
        }
    return parser.parse_object({subcommand: merged}, config), settings


def _hf_tokenizer(folder: Path, data: Any) -> dict[str, Any]:
    """The data options a Hugging Face folder sets: its ``tokenizer.json``, unless ``data.tokenizer`` is given."""
    data = data.as_dict() if hasattr(data, "as_dict") else dict(data or {})
    if data.get("tokenizer"):
        return {}
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise ValueError(
            f"model.init_from={str(folder)!r} has no tokenizer.json, and the data needs the tokenizer the model was "
            "trained with (its token ids are the model's): give --data.tokenizer PATH/tokenizer.json."
        )
    return {"tokenizer": str(file)}


def merge_hf_init(parser: Any, config: Any, model_class: type, data_class: Optional[type] = None) -> Any:
    """Take a Hugging Face folder's architecture (``model.architecture``, from its ``config.json``: no weight read)
    and tokenizer (``data.tokenizer``, unless given) into ``config``; options that would change the architecture are
    refused. ``hf:NAME`` is downloaded first; the folder's path replaces it in ``model.init_from``."""
    subcommand = config.get("subcommand")
    group = config[subcommand]
    model_config = group.model.as_dict() if hasattr(group.model, "as_dict") else dict(group.model)
    folder = resolve_hf(model_config["init_from"])
    architecture = hf_architecture(folder)
    asked = asked_settings(model_config, model_class)
    refused = [f"model.{k}={asked[k]!r}" for k in (*ARCHITECTURE, "architecture") if k in asked]
    if refused:
        raise ValueError(
            f"model.init_from={str(folder)!r} is a Hugging Face folder, whose config.json sets the architecture, and "
            f"this run asks {', '.join(refused)}: drop those options."
        )
    merged: dict[str, Any] = {"model": {"architecture": architecture, "init_from": str(folder)}}
    if data_class is not None and group.get("data") is not None:
        merged["data"] = _hf_tokenizer(folder, group.data)
    rank_zero_info(f"model.init_from: the GPT starts from the Hugging Face model in {folder} "
                   f"({architecture['n_layer']} layers, width {architecture['n_embd']}); "
                   "the optimizer and the learning-rate schedule start fresh.")
    return parser.parse_object({subcommand: merged}, config)
