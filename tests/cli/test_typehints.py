"""``gpuopt`` parses an integer given for an int-or-float option as an integer, whatever the typing cache holds.

``typing`` caches unions and treats ``Union[int, float]`` and ``Union[float, int]`` as equal, so the Trainer's
``Optional[Union[int, float]]`` can come out float-first depending on what was imported before Lightning. The tests
force that float-first form and check the parse.
"""

import subprocess
import sys
from typing import Callable, Optional, Union

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback

from lightning_gpuopt import GPTModule, TextDataModule
from lightning_gpuopt.cli.main import GPTCLI
from lightning_gpuopt.cli.typehints import int_before_float

from tests._paths import REPO

# The float-first union, built from its members so the typing cache cannot hand back an int-first one.
FLOAT_FIRST = Union[(float, int, type(None))]


def test_int_before_float_reorders_every_union():
    assert FLOAT_FIRST.__args__ == (float, int, type(None))
    assert int_before_float(FLOAT_FIRST).__args__ == (int, float, type(None))
    assert int_before_float(Union[(str, float, int)]).__args__ == (str, int, float)
    mixed = int_before_float(Union[(float, Callable[[int], int], int)])
    assert mixed.__args__ == (int, float, Callable[[int], int])
    kept = Optional[int]
    assert int_before_float(kept) is kept and int_before_float(float) is float
    assert int_before_float(int | float).__args__ == (int, float)


class _ParseOnly(GPTCLI):
    def instantiate_classes(self) -> None:
        pass


class _Counted(Callback):
    """A callback whose option reads an integer as a count and a float as a fraction, written float-first."""

    def __init__(self, every: Union[float, int] = 0.5) -> None:
        self.every = every


@pytest.fixture
def float_first_trainer(monkeypatch):
    for name in ("limit_train_batches", "limit_val_batches", "val_check_interval"):
        monkeypatch.setitem(Trainer.__init__.__annotations__, name, FLOAT_FIRST)


def test_yaml_and_flag_integers_stay_integers_with_the_float_first_form(float_first_trainer, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("trainer:\n  limit_val_batches: 20\n  val_check_interval: 0.5\n"
                      f"  callbacks:\n    - class_path: {__name__}._Counted\n      init_args: {{every: 3}}\n")
    cli = _ParseOnly(GPTModule, TextDataModule, run=False,
                     args=["--config", str(config), "--trainer.limit_train_batches", "1"])
    trainer = cli.config["trainer"]
    assert trainer["limit_val_batches"] == 20 and type(trainer["limit_val_batches"]) is int
    assert trainer["limit_train_batches"] == 1 and type(trainer["limit_train_batches"]) is int  # one batch, not all
    assert trainer["val_check_interval"] == 0.5
    (callback,) = [c for c in trainer["callbacks"] if c.class_path.endswith("_Counted")]
    assert type(callback.init_args.every) is int


def test_quickstart_parses_after_the_float_first_union_was_cached_first():
    """The real cause, in a fresh process: a float-first union created before Lightning is imported."""
    code = (
        "from typing import Optional, Union\n"
        "_ = Optional[Union[float, int]]\n"
        "import sys\n"
        "from lightning_gpuopt.cli.main import GPTCLI\n"
        "from lightning_gpuopt import GPTModule, TextDataModule\n"
        "class P(GPTCLI):\n"
        "    def instantiate_classes(self): pass\n"
        "cli = P(GPTModule, TextDataModule, run=False, args=['--config', 'examples/configs/quickstart.yaml'])\n"
        "value = cli.config['trainer']['limit_val_batches']\n"
        "print(type(value).__name__, value)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["int", "20"]
