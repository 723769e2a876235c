"""A `trainer.callbacks` list means what it says: `gpuopt` parses it as plain `LightningCLI` does, never item by
item on the stack's list (jsonargparse merges two lists of the same length position by position)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import yaml
from lightning.pytorch.cli import LightningCLI

from lightning_gpuopt import GPTModule, TextDataModule
from lightning_gpuopt.cli.defaults import dropped_stack_note, is_stack_callbacks, stack_callbacks
from lightning_gpuopt.cli.main import GPTCLI

CALLBACKS = {  # the stack's four and Lightning's own, each with options set where it has any to set
    "CUDASettings": {"class_path": "lightning_gpuopt.callbacks.CUDASettings"},
    "MFUMonitor": {"class_path": "lightning_gpuopt.callbacks.MFUMonitor", "init_args": {"log_every_n_steps": 20}},
    "NonFiniteGuard": {"class_path": "lightning_gpuopt.callbacks.NonFiniteGuard", "init_args": {"policy": "stop"}},
    "ModelCheckpoint": {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                        "init_args": {"monitor": "val/loss", "save_top_k": 2}},
    "EarlyStopping": {"class_path": "lightning.pytorch.callbacks.EarlyStopping",
                      "init_args": {"monitor": "val/loss", "patience": 3}},
    "LearningRateMonitor": {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor",
                            "init_args": {"logging_interval": "step"}},
    "EveryNSteps": {"class_path": "tests.cli._own_modules.EveryNSteps", "init_args": {"message": "hi"}},  # one's own
}
NAMES = list(CALLBACKS)


def _rotations(length: int, count: int) -> list[tuple[str, ...]]:
    """``count`` lists of ``length`` names, the r-th starting at name r: over 7 rotations every callback sits at every
    position (the merge was position by position, so that is every case it had)."""
    return [tuple(NAMES[(r + j) % len(NAMES)] for j in range(length)) for r in range(count)]


LISTS = list(dict.fromkeys([  # (duplicates left out)
    *_rotations(4, 7),  # the stack's length: every callback at every position
    *(names[::-1] for names in _rotations(4, 3)),  # and backwards
    *_rotations(1, 2), *_rotations(2, 2), *_rotations(3, 2), *_rotations(5, 2), *_rotations(7, 1),
    ("CUDASettings", "MFUMonitor", "NonFiniteGuard", "ModelCheckpoint"),  # the configs of the issue
    ("NonFiniteGuard", "MFUMonitor", "ModelCheckpoint", "CUDASettings"),
    ("CUDASettings", "NonFiniteGuard", "ModelCheckpoint", "EveryNSteps"),  # a newcomer's, with a callback of their own
]))
ISSUE = LISTS[:1] + LISTS[-2:]


class _Built(Exception):
    pass


def _parser(cli_class: type) -> Any:
    """The parser of ``cli_class`` over GPTModule and TextDataModule, with its subcommands, as the command builds it."""

    class ParserOnly(cli_class):
        def parse_arguments(self, parser, args):
            raise _Built(parser)

    with pytest.raises(_Built) as built:
        ParserOnly(GPTModule, TextDataModule, args=[])
    return built.value.args[0]


@pytest.fixture(scope="module")
def parsers() -> dict:
    ours, plain = _parser(GPTCLI), _parser(LightningCLI)
    alone = {name: _callbacks(plain, [name])[0] for name in NAMES}  # each callback as plain LightningCLI parses it
    return {"gpuopt": ours, "alone": alone}


def _config(names) -> str:
    return yaml.safe_dump({"trainer": {"callbacks": [CALLBACKS[name] for name in names]}})


def _callbacks(parser, names) -> list[dict]:
    parsed = parser.parse_args(["fit", "--config", _config(names)]).fit.trainer.callbacks
    return [c.as_dict() for c in parsed]


@pytest.mark.parametrize("names", LISTS, ids=lambda names: "-".join(names))
def test_a_callbacks_list_parses_as_in_plain_lightning_cli(parsers, names):
    parsed = _callbacks(parsers["gpuopt"], names)
    assert parsed == [parsers["alone"][name] for name in names]
    for callback, name in zip(parsed, names):  # what the file says, no more
        assert callback["class_path"] == CALLBACKS[name]["class_path"]
        assert CALLBACKS[name].get("init_args", {}).items() <= (callback.get("init_args") or {}).items()


def test_the_stack_stays_and_plus_equals_adds_to_it(parsers):
    parser = parsers["gpuopt"]
    stack = parser.parse_args(["fit"]).fit.trainer.callbacks
    assert is_stack_callbacks(stack) and [c.class_path for c in stack] == [c["class_path"] for c in stack_callbacks()]
    added = parser.parse_args(["fit", "--trainer.callbacks+=LearningRateMonitor"]).fit.trainer.callbacks
    assert [c.class_path.rsplit(".", 1)[1] for c in added] == [
        "CUDASettings", "MFUMonitor", "NonFiniteGuard", "ModelCheckpoint", "LearningRateMonitor"]
    assert added[3].init_args.save_last is True  # the stack's ModelCheckpoint, whole
    edited = parser.parse_args(["fit", "--trainer.callbacks.every_n_train_steps", "7"]).fit.trainer.callbacks
    assert edited[3].init_args.every_n_train_steps == 7 and edited[3].init_args.save_last is True  # its last item


@pytest.mark.parametrize("names", ISSUE, ids=lambda names: "-".join(names))
def test_print_config_shows_the_files_callbacks(parsers, names, tmp_path, capsys):
    path = tmp_path / "callbacks.yaml"
    path.write_text(_config(names))
    with pytest.raises(SystemExit) as printed:
        parsers["gpuopt"].parse_args(["fit", "--config", str(path), "--print_config"])
    assert printed.value.code == 0
    shown = yaml.safe_load(capsys.readouterr().out)["trainer"]["callbacks"]
    assert shown == [parsers["alone"][name] for name in names]
    checkpoint = next(c for c in shown if c["class_path"].endswith("ModelCheckpoint"))["init_args"]
    assert (checkpoint["save_last"], checkpoint["every_n_train_steps"], checkpoint["mode"]) == (None, None, "min")


def test_the_left_out_pieces_of_the_stack_are_named_once():
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    from lightning_gpuopt.callbacks import CUDASettings, MFUMonitor, NonFiniteGuard

    note = dropped_stack_note([NonFiniteGuard(), ModelCheckpoint(monitor="val/loss", save_top_k=2), LearningRateMonitor()])
    assert note.startswith("gpuopt: trainer.callbacks replaces the stack's list and leaves out CUDASettings (")
    assert "MFUMonitor (no tokens/s or MFU)" in note and "NonFiniteGuard (" not in note
    assert "save_last is not set: --ckpt_path last resumes from the newest checkpoint the run wrote" in note
    assert dropped_stack_note([CUDASettings(), MFUMonitor(), NonFiniteGuard(), ModelCheckpoint(save_last=True)]) is None
    assert "ModelCheckpoint" not in dropped_stack_note([CUDASettings()], enable_checkpointing=False)
