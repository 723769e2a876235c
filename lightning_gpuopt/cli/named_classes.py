"""Which LightningModule and LightningDataModule a ``gpuopt`` command trains: ours unless it names its own.

``GPTModule`` and ``TextDataModule`` are parsed flat (``--model.preset``); a class of one's own as LightningCLI
parses any (``class_path``, ``init_args``), so the form must be known before the parser is built. A class is named
on the command line (``--model X``, ``--model=X``, ``--model.class_path X``), in a ``--config`` file (``model:`` a
class path or a ``class_path``), or in the environment (``GPUOPT_<SUBCOMMAND>__MODEL[__CLASS_PATH]``); likewise data."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

__all__ = ["NamedClasses", "named_classes"]

_SUBCOMMANDS = ("fit", "validate", "test", "predict")
_OURS = {"model": "GPTModule", "data": "TextDataModule"}
_OUR_FLAGS = {"model": "--model.preset, --model.n_layer, ...", "data": "--data.source, --data.block_size, ..."}


@dataclass(frozen=True)
class NamedClasses:
    """The class paths a command gives for ``model`` and ``data``; ``None``: ours (``GPTModule``,
    ``TextDataModule``)."""

    model: Optional[str] = None
    data: Optional[str] = None


def _from_args(argv: Sequence[str], group: str) -> Optional[str]:
    found = None
    for i, arg in enumerate(argv):
        for flag in (f"--{group}", f"--{group}.class_path"):
            if arg == flag and i + 1 < len(argv):
                found = argv[i + 1]
            elif arg.startswith(flag + "="):
                found = arg[len(flag) + 1:]
    return found


def _class_in(value: Any) -> Optional[str]:
    if isinstance(value, str) and value.strip() and not value.strip().startswith(("{", "[")):
        return value.strip()
    if isinstance(value, Mapping) and isinstance(value.get("class_path"), str):
        return value["class_path"]
    return None


def _from_configs(argv: Sequence[str], subcommand: Optional[str], group: str) -> Optional[str]:
    found = None
    for i, arg in enumerate(argv):
        path = (
            argv[i + 1] if arg == "--config" and i + 1 < len(argv) else arg[9:] if arg.startswith("--config=") else None
        )
        if path is None or not Path(path).is_file():
            continue  # a missing file is the parser's error to report
        try:
            config = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError:
            continue  # likewise
        if not isinstance(config, Mapping):
            continue
        if (
            subcommand is not None
            and subcommand in config
            and isinstance(config[subcommand], Mapping)
            and i < argv.index(subcommand)
        ):
            config = config[subcommand]  # a --config given before the subcommand holds one mapping per subcommand
        found = _class_in(config.get(group)) or found
    return found


def named_classes(argv: Sequence[str], environ: Mapping[str, str]) -> NamedClasses:
    """The model and data classes ``argv`` (without the program name) and ``environ`` name; a later ``--config`` or
    flag wins, and the command line over the environment, as for the parser.

    ``GPTModule``, or ``TextDataModule`` with it, named as a class is refused: they take their options flat (with a
    module of one's own, ``--data TextDataModule`` is how to train it on ``TextDataModule``).

    Example::

        named_classes(["fit", "--model", "my_pkg.NanoGPT"], {})   # NamedClasses(model="my_pkg.NanoGPT", data=None)
        named_classes(["fit", "--config", "quickstart.yaml"], {}) # NamedClasses(model=None, data=None): ours
    """
    subcommand = next((a for a in argv if a in _SUBCOMMANDS), None)
    named = {}
    for group in ("model", "data"):
        env = f"GPUOPT_{(subcommand or '').upper()}__{group.upper()}"
        value = _from_args(argv, group) or _from_configs(argv, subcommand, group)
        value = value or environ.get(env + "__CLASS_PATH") or environ.get(env) or None
        ours = value is not None and value.rsplit(".", 1)[-1] == _OURS[group] and (
            "." not in value or value.startswith("lightning_gpuopt.")
        )
        if ours and (group == "model" or named["model"] is None):
            raise ValueError(
                f"{group}: {value} is gpuopt's default {group} and takes its options directly: drop the class path "
                f"(--{group} / {group}.class_path) and give them as {_OUR_FLAGS[group]}."
            )
        named[group] = value
    return NamedClasses(**named)
