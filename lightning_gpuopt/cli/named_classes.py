"""Which LightningModule and LightningDataModule a ``gpuopt`` command trains: ours unless it names its own.

Design note: ``GPTModule`` and ``TextDataModule`` are parsed flat (``--model.preset``,
``--data.source``) so the recipes, ``--print_config`` and the resume checks stay as they are. A
module or data module of your own is parsed the way LightningCLI parses any class (``class_path``
and ``init_args``), so ``gpuopt`` has to know which of the two forms a command uses before the
parser is built. :func:`named_classes` reads that from where a class can be named:

* the command line: ``--model my_pkg.NanoGPT``, ``--model=...``, ``--model.class_path ...``
  (likewise ``--data``);
* a ``--config`` file (before or after the subcommand) whose ``model:`` or ``data:`` is a class
  path or holds a ``class_path``;
* the environment: ``GPUOPT_<SUBCOMMAND>__MODEL`` or ``GPUOPT_<SUBCOMMAND>__MODEL__CLASS_PATH``.

Example::

    named_classes(["fit", "--model", "my_pkg.NanoGPT"], {})        # NamedClasses(model="my_pkg.NanoGPT", data=None)
    named_classes(["fit", "--config", "quickstart.yaml"], {})      # NamedClasses(model=None, data=None): ours
"""

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
    """The class paths a command gives for ``model`` and ``data``; ``None``: ours (``GPTModule``, ``TextDataModule``)."""

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
        path = argv[i + 1] if arg == "--config" and i + 1 < len(argv) else arg[9:] if arg.startswith("--config=") else None
        if path is None or not Path(path).is_file():
            continue  # a missing file is the parser's error to report
        try:
            config = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError:
            continue  # likewise
        if not isinstance(config, Mapping):
            continue
        if subcommand is not None and subcommand in config and isinstance(config[subcommand], Mapping) and i < argv.index(subcommand):
            config = config[subcommand]  # a --config given before the subcommand holds one mapping per subcommand
        found = _class_in(config.get(group)) or found
    return found


def named_classes(argv: Sequence[str], environ: Mapping[str, str]) -> NamedClasses:
    """The model and data classes ``argv`` (and the environment) name, read as the module docstring lists.

    A later ``--config`` or flag wins over an earlier one, and the command line over the environment,
    as for the parser itself.

    Args:
        argv: The command's arguments, without the program name.
        environ: The environment (``os.environ``).

    Raises:
        ValueError: ``GPTModule`` named as a class, or ``TextDataModule`` with ``GPTModule``: they are the
            default and take their options flat. (With a module of your own, ``--data TextDataModule``
            is how to train it on ``TextDataModule``: without a ``data`` class the module's own loaders are used.)
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
