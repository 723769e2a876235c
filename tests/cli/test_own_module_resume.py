"""`gpuopt fit --ckpt_path` with a module of one's own: the checks made against the module as built (real CLI runs)."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_gpuopt.cli.main import main, make_cli
from lightning_gpuopt.run.resume_checks import check_steps_left, epochs_done

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers.*", "ignore:.*has no bf16 peak FLOP/s.*", "ignore:.*smaller than the logging interval.*",
    "ignore:MFUMonitor found no tokens:UserWarning",  # the regressors' float features are not tokens, as it says
)
OWN = "tests.cli._own_modules"


def _fit(root, model: str, *extra: str) -> list[str]:
    return ["fit", "--model", f"{OWN}.{model}", "--trainer.default_root_dir", str(root), "--trainer.accelerator", "cpu",
            "--trainer.devices", "1", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", *extra]


def _refusal(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stopped:
        main(args)
    assert stopped.value.code == 2
    return capsys.readouterr().err


def test_resume_says_once_which_hyper_parameters_differ_and_the_optimizer_keeps_its_learning_rate(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    main(_fit(tmp_path, "Regressor", "--trainer.max_steps", "2"))
    with caplog.at_level(logging.INFO):
        cli = make_cli([*_fit(tmp_path, "Regressor", "--trainer.max_steps", "4"), "--ckpt_path", "last", "--model.lr", "0.05"])
    said = [r.getMessage() for r in caplog.records if "unlike the checkpoint's" in r.getMessage()]
    assert len(said) == 1 and "(lr 0.01 -> 0.05)" in said[0] and "restored as saved" in said[0], said
    # What the line says is what happened: the optimizer trained at the checkpoint's rate.
    assert cli.trainer.global_step == 4 and cli.trainer.optimizers[0].param_groups[0]["lr"] == 0.01
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["hyper_parameters"]["lr"] == 0.05


def test_resume_with_nothing_left_to_train_is_refused_for_steps_and_epochs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    main(_fit(tmp_path / "steps", "Regressor", "--trainer.max_steps", "6"))
    err = _refusal([*_fit(tmp_path / "steps", "Regressor", "--trainer.max_steps", "4"), "--ckpt_path", "last"], capsys)
    assert "is at step 6 and trainer.max_steps=4" in err and "--trainer.max_steps 12" in err
    main(_fit(tmp_path / "epochs", "Regressor", "--trainer.max_epochs", "1"))  # 4 steps
    saved = torch.load(tmp_path / "epochs" / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 4 and epochs_done(saved) == 1
    err = _refusal([*_fit(tmp_path / "epochs", "Regressor", "--trainer.max_epochs", "1"), "--ckpt_path", "last"], capsys)
    assert "has trained 1 epoch and trainer.max_epochs=1" in err and "--trainer.max_epochs 2" in err


def test_check_steps_left_reads_both_limits():
    check_steps_left(3, "c", {"max_steps": 4, "max_epochs": 2}, epochs=1)  # both left: no error
    check_steps_left(3, "c", {"max_steps": -1, "max_epochs": None}, epochs=5)  # no limits set
    with pytest.raises(ValueError, match="is at step 4 and trainer.max_steps=4"):
        check_steps_left(4, "c", {"max_steps": 4, "max_epochs": 9}, epochs=1)
    with pytest.raises(ValueError, match="has trained 2 epochs and trainer.max_epochs=2"):
        check_steps_left(8, "c", {"max_steps": 100, "max_epochs": 2}, epochs=2)  # Lightning stops at either limit
    assert epochs_done({"epoch": 3}) == 3 and epochs_done({}) is None
    assert epochs_done({"epoch": 0, "loops": {"fit_loop": {"epoch_progress": {"current": {"processed": 1}}}}}) == 1


def test_a_changed_shape_is_one_message_naming_the_checkpoints_option(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    main(_fit(tmp_path, "Regressor", "--trainer.max_steps", "2"))
    err = _refusal([*_fit(tmp_path, "Regressor", "--trainer.max_steps", "4"), "--ckpt_path", "last", "--model.d", "32"], capsys)
    assert "does not fit Regressor as configured: 3 of 4 weights differ in shape" in err
    assert "net.0.weight [16, 16] in the checkpoint, [32, 16] in the model" in err and "options (d=16)" in err
    assert "size mismatch" not in err and len(err.splitlines()) == 2


def test_a_module_without_predict_data_gets_no_sample_line_one_with_it_does(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "my libs")  # where classes of one's own are found: the printed commands carry it
    for model, root in (("Regressor", "plain"), ("PredictingRegressor", "predicting")):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            main(_fit(tmp_path / root, model, "--trainer.max_steps", "2"))
        lines = "\n".join(r.getMessage() for r in caplog.records)
        assert "train on to step 4: PYTHONPATH='my libs' gpuopt fit --model" in lines
        assert ("sample:     PYTHONPATH='my libs' gpuopt predict" in lines) == (model == "PredictingRegressor"), lines
    predicted = make_cli(["predict", "--model", f"{OWN}.PredictingRegressor", "--trainer.default_root_dir",
                          str(tmp_path / "predicting"), "--ckpt_path", "last", "--trainer.accelerator", "cpu",
                          "--trainer.enable_progress_bar", "false"])
    assert [tuple(p.shape) for p in predicted.trainer.predict_loop.predictions] == [(8, 1), (8, 1)]  # the command runs
