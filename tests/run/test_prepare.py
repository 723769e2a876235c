"""The run layer from Python: a plain ``lightning.Trainer`` gets the one-writer lock and the resume checks through
``prepare_run`` (a second real process refused; a checkpoint checked against the module, the Trainer and the data)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gpuopt.callbacks.resumed_optimizer import ResumedOptimizerSettings
from lightning_gpuopt.model import GPTModule
from lightning_gpuopt.model.checkpoint import read_checkpoint
from lightning_gpuopt.run import OwnCheckpoint, PathInUse, prepare_run
from lightning_gpuopt.run.folder import LOCK_FILE
from lightning_gpuopt.run.resume_checks import check_architecture
from tests._paths import REPO
from tests.cli._own_modules import Regressor

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers.*", "ignore:.*dataloader is not resumable")


def _trainer(root, max_steps):
    return Trainer(max_steps=max_steps, default_root_dir=root, accelerator="cpu", devices=1, logger=False,
                   enable_progress_bar=False, enable_model_summary=False,
                   callbacks=[ModelCheckpoint(save_last=True, save_top_k=0, every_n_train_steps=1)])


class _Data:
    """A data module's one method the run layer calls: what it was given."""

    def __init__(self):
        self.given = "not called"

    def use_checkpoint_tokenizer(self, state):
        self.given = state


_SECOND = textwrap.dedent("""
    import sys
    from lightning.pytorch import Trainer
    from lightning_gpuopt.run import prepare_run
    from tests.cli._own_modules import Regressor
    trainer = Trainer(max_steps=2, default_root_dir=sys.argv[1], logger=False)
    try:
        with prepare_run(trainer, Regressor()):
            print("held")
    except ValueError as err:
        print(err)
""")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file locks")
def test_a_python_fit_holds_its_folder_against_a_second_process_and_lets_go(tmp_path):
    root = tmp_path / "run"
    model, trainer = Regressor(), _trainer(root, 2)
    with prepare_run(trainer, model) as run:
        assert run.ckpt_path is None and (root / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} on ")
        second = subprocess.run([sys.executable, "-c", _SECOND, str(root)], capture_output=True, text=True, timeout=240,
                                env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
        said = second.stdout.strip()
        assert said.startswith(f"{root} is in use by another fit (pid {os.getpid()} on "), second.stderr[-3000:]
        assert said.endswith("or give this run another Trainer(default_root_dir=...).")
        with pytest.raises(PathInUse, match=f"pid {os.getpid()}") as ours:  # a second open in this process too
            with prepare_run(_trainer(root, 2), Regressor()):
                pass
        assert str(ours.value).startswith(f"{root} is held by this process already (pid {os.getpid()} on ")
        assert "End that block first" in str(ours.value) and "kill" not in str(ours.value)
        trainer.fit(model)
    assert read_checkpoint(root / "checkpoints" / "last.ckpt")["global_step"] == 2
    with prepare_run(_trainer(root, 4), Regressor(), ckpt_path="last"):  # free again
        pass


def test_a_python_resume_gets_the_checks_through_the_run_layer(tmp_path, caplog):
    root = tmp_path / "run"
    model, trainer = Regressor(), _trainer(root, 2)
    with prepare_run(trainer, model) as run:
        trainer.fit(model, ckpt_path=run.ckpt_path)
    last = root / "checkpoints" / "last.ckpt"
    with pytest.raises(ValueError, match=r"holds a run this fit would overwrite .*"
                                         r"`prepare_run\(\.\.\., ckpt_path='last'\)`"):
        with prepare_run(_trainer(root, 4), Regressor()):
            pass
    with pytest.raises(ValueError, match=r"is at step 2 and trainer.max_steps=2, so this fit would train nothing .*"
                                         r"\(e.g. Trainer\(max_steps=4\)\)"):
        with prepare_run(_trainer(root, 2), Regressor(), ckpt_path="last"):
            pass
    with pytest.raises(ValueError, match=r"does not fit Regressor as configured: 3 of 4 weights differ in shape "
                                         r"\(first: net.0.weight \[16, 16\] in the checkpoint, \[32, 16\] in the "
                                         r"model.*"
                                         r"Build the module with the checkpoint's options \(d=16\)"):
        with prepare_run(_trainer(root, 4), Regressor(d=32), ckpt_path="last"):
            pass
    data, trainer, model = _Data(), _trainer(root, 4), Regressor(lr=0.02)
    with caplog.at_level("INFO"), prepare_run(trainer, model, data, ckpt_path="last") as run:
        assert run.ckpt_path == str(last) and run.checkpoint.global_step == 2
        assert data.given is None  # Regressor's checkpoint carries no data state: the data is told so
        assert sum(isinstance(c, ResumedOptimizerSettings) for c in trainer.callbacks) == 1
        trainer.fit(model, ckpt_path=run.ckpt_path)
    assert "fit ckpt_path " in caplog.text and "lr 0.01 -> 0.02" in caplog.text
    assert read_checkpoint(last)["global_step"] == 4


def test_a_built_gpt_of_another_architecture_is_refused_with_both_values():
    """n_head changes no weight's shape: the shapes alone would load the checkpoint into another model."""
    checkpoint = OwnCheckpoint("run.ckpt", "fit", {"preset": "tiny", "n_head": None, "block_size": 32}, {})
    check_architecture(checkpoint, GPTModule(preset="tiny", block_size=32))  # the preset's heads on both sides
    with pytest.raises(ValueError, match=r"The architecture cannot change when loading the checkpoint 'run.ckpt': "
                                         r"GPTModule is built with n_head=2 but the checkpoint has n_head=4; "
                                         r"block_size=64 but the checkpoint has block_size=32\. Build it with"):
        check_architecture(checkpoint, GPTModule(preset="tiny", n_head=2, block_size=64))
