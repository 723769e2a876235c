"""How `gpuopt` ends on errors: one message and exit 2 for a configuration error (a real process; the
traceback with GPUOPT_TRACEBACK=1), exit 1 for a diverged run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_gpuopt.cli.main import main
from lightning_gpuopt.cli.errors import explain_parser_error
from tests._paths import REPO

ROOT = REPO


def _gpuopt(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-m", "lightning_gpuopt", *args], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=300)


def _data(text_dir: Path) -> list[str]:
    return ["--data.source", str(text_dir), "--data.vocab_size", "300", "--data.block_size", "32",
            "--data.batch_size", "4", "--data.num_workers", "0", "--model.preset", "tiny",
            "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0"]


# The CLI always adds SigtermCheckpoint; with checkpointing off (a choice) it says nothing: the fits below would fail
# on its warning (pyproject turns the package's warnings into errors).


def test_a_configuration_error_is_one_message_and_exit_2(tmp_path, text_dir, cache_dir, monkeypatch):
    from lightning_gpuopt.model.checkpoint import CheckpointError

    foreign = tmp_path / "foreign.ckpt"
    torch.save({"weights": torch.ones(2)}, foreign)
    out = _gpuopt(["fit", *_data(text_dir), "--ckpt_path", str(foreign), "--trainer.max_steps", "3"], tmp_path)
    assert out.returncode == 2
    assert f"gpuopt: error: '{foreign}' is not a GPTModule checkpoint" in out.stderr
    assert "Traceback" not in out.stderr and "GPUOPT_TRACEBACK=1" in out.stderr
    assert not cache_dir.exists()  # refused before data preparation
    # GPUOPT_TRACEBACK=1: the error itself leaves main (in a process: its traceback and exit 1), no short message.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPUOPT_TRACEBACK", "1")
    with pytest.raises(CheckpointError, match="is not a GPTModule checkpoint"):
        main(["fit", *_data(text_dir), "--ckpt_path", str(foreign), "--trainer.max_steps", "3"])


def test_a_diverged_fit_exits_1(tmp_path, text_dir, cache_dir, capsys, monkeypatch):
    """No NonFiniteGuard and no checkpointing (the default stack's callbacks left out): the run used to end
    with exit 0 and NaN weights."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["fit", *_data(text_dir), "--trainer.max_steps", "12", "--model.learning_rate", "1000",
              "--model.warmup_steps", "0", "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "gpuopt: training stopped: Training ended with non-finite weights (28 of 28 parameters hold NaN/Inf" in err
    assert "train/loss=nan, step 12): the model diverged" in err


def test_an_empty_or_non_mapping_config_gets_a_real_message():
    assert explain_parser_error("Unexpected config: ").startswith("The --config file is empty")
    assert explain_parser_error("Unexpected config: # todo\n").startswith("The --config file is empty")
    assert "must be a YAML mapping of groups" in explain_parser_error("Unexpected config: [1, 2]")
    assert explain_parser_error("Something else") == "Something else"


def test_checkpointing_off_leaves_out_the_default_model_checkpoint(tmp_path, text_dir, cache_dir, monkeypatch, caplog):
    """The default stack has a ModelCheckpoint; `--trainer.enable_checkpointing false` must not collide with it."""
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("INFO"):
        main(["fit", *_data(text_dir), "--trainer.max_steps", "2", "--model.warmup_steps", "1",
              "--trainer.enable_checkpointing", "false"])
    assert "the ModelCheckpoint callback is left out" in caplog.text
    assert "SigtermCheckpoint" not in caplog.text  # gpuopt adds it and does not let it be removed: no advice to
    assert not list(tmp_path.rglob("*.ckpt"))


@pytest.mark.parametrize(("callback", "argument", "value", "says"), [
    ("MFUMonitor", "log_every_n_steps", "0", "MFUMonitor.log_every_n_steps must be an integer >= 1 or None, got 0"),
    ("AutoBatchSize", "memory_margin", "2", "AutoBatchSize.memory_margin must be in [0, 1), got 2.0"),
    ("NonFiniteGuard", "max_consecutive_skips", "0", "NonFiniteGuard.max_consecutive_skips must be an integer >= 1, got 0"),
    ("CUDASettings", "matmul_precision", "fast",
     "CUDASettings.matmul_precision must be 'highest', 'high', 'medium' or None, got 'fast'"),
])
def test_a_callback_argument_out_of_range_is_one_line_with_the_fix(callback, argument, value, says, tmp_path, capsys):
    """The parser reported these as a 15-line union dump with the constructor's line among three."""
    with pytest.raises(SystemExit) as info:
        main(["fit", "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path),
              f"--trainer.callbacks+={callback}", f"--trainer.callbacks.{argument}", value])
    assert info.value.code == 2
    first, *rest = capsys.readouterr().err.strip().splitlines()
    assert first.startswith(f"gpuopt: error: trainer.callbacks: {says}")
    assert first.endswith(f"Fix init_args.{argument} of {callback} in trainer.callbacks (the --config file, or "
                          f"--trainer.callbacks.{argument} right after --trainer.callbacks+={callback}).")
    assert rest == ["(set GPUOPT_TRACEBACK=1 to see the traceback)"]


def test_an_infinite_gradient_clip_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--trainer.max_steps", "1", "--trainer.gradient_clip_val", "inf"])
    assert capsys.readouterr().err.splitlines()[0] == (
        "gpuopt: error: trainer.gradient_clip_val must be a finite number, got inf: give a finite value for "
        "--trainer.gradient_clip_val (or trainer.gradient_clip_val in the --config file).")


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("door", ["fit --model.init_from", "predict --model.init_from", "predict --ckpt_path"])
def test_nonfinite_weights_are_refused_at_every_cli_door_with_the_tensor_named(door, value, tmp_path, text_dir, cache_dir,
                                                                              capsys, monkeypatch):
    from lightning_gpuopt import GPTModule

    torch.manual_seed(0)
    module = GPTModule(preset="tiny", vocab_size=300, block_size=32)
    module.configure_model()
    state = {f"model.{k}": v.clone() for k, v in module.model.state_dict().items()}
    state["model.transformer.h.0.attn.c_attn.weight"][1, 2] = value
    path = tmp_path / "start.ckpt"
    torch.save({"pytorch-lightning_version": "2.6.6", "global_step": 3, "hyper_parameters": dict(module.hparams),
                "state_dict": state}, path)
    monkeypatch.chdir(tmp_path)
    subcommand, option = door.split()
    extra = ["--trainer.max_steps", "2"] if subcommand == "fit" else ["--data.prompts", '["a"]', "--model.max_new_tokens", "4"]
    with pytest.raises(SystemExit) as info:
        main([subcommand, *_data(text_dir), option, str(path), "--trainer.default_root_dir", str(tmp_path / "run"), *extra])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert (f"gpuopt: error: Weights of '{path}' refused: 'transformer.h.0.attn.c_attn.weight' holds NaN/Inf (1 of "
            in err.replace("'model.transformer", "'transformer"))
    assert "Use an earlier checkpoint of that run, or start from other weights.\nTo read the file anyway: " in err
    if option == "--model.init_from":
        assert not cache_dir.exists()  # refused before data preparation


def test_a_callback_that_cannot_be_imported_is_one_line_with_a_pythonpath_hint(tmp_path, capsys):
    config = tmp_path / "cb.yaml"
    config.write_text("trainer:\n  callbacks:\n    - class_path: mypkg.NoSuchCallback\n")
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(config), "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path)])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "gpuopt: error: trainer.callbacks: cannot import mypkg.NoSuchCallback (no module named 'mypkg'). If mypkg is your "
        "own code, run from the folder that holds it with PYTHONPATH=. (e.g. PYTHONPATH=. gpuopt fit ...), or install it; "
        "else fix the class path.\n(gpuopt fit --help lists the options)\n")


def test_a_class_the_parser_cannot_use_is_one_line_with_its_cause():
    dump = ("Parser key \"trainer.callbacks\":\n  Does not validate against any of the Union subtypes\n  Subtypes: [...]\n"
            "  Errors:\n    - Problem with given class_path 'mypkg.cb.Broken':\n        invalid syntax (cb.py, line 3)\n"
            "    - Not a valid subclass of Callback\n  Given value type: <class 'list'>\n")
    assert explain_parser_error(dump) == ("trainer.callbacks: mypkg.cb.Broken cannot be used: invalid syntax (cb.py, line 3). "
                                          "Fix its class path or init_args in the --config file (or on the command line).")


def test_a_list_option_given_as_text_shows_the_bracketed_form(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["predict", "--data.prompts", '["a"]', "--generate.stop", "the", "--trainer.default_root_dir", str(tmp_path)])
    assert capsys.readouterr().err.splitlines()[0] == (
        "gpuopt: error: generate.stop takes a list, got the text 'the': write it in brackets, --generate.stop '[the]' "
        "(items separated by commas), or as a YAML list under generate.stop in the --config file.")


@pytest.mark.parametrize(("prompts", "what"), [("[]", "is empty, so predict would sample nothing"),
                                               ('["a", ""]', "holds an empty prompt (no tokens)")])
def test_empty_prompts_are_refused(prompts, what, tmp_path, text_dir, cache_dir, capsys):
    with pytest.raises(SystemExit) as info:
        main(["predict", *_data(text_dir), "--data.prompts", prompts, "--trainer.default_root_dir", str(tmp_path)])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == (
        f"gpuopt: error: --data.prompts {what}: give each prompt some text, e.g. --data.prompts '[\"Once upon a time\"]', "
        "or leave it out to sample from the start of a text.")
    assert not cache_dir.exists()


def test_the_refusal_to_overwrite_a_run_suggests_a_max_steps_that_trains(tmp_path, text_dir, capsys, monkeypatch):
    """A checkpoint at step 20 and --trainer.max_steps 6: `--ckpt_path last` alone would train nothing."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    torch.save({"global_step": 20}, tmp_path / "run" / "checkpoints" / "last.ckpt")
    args = [*_data(text_dir), "--trainer.default_root_dir", "run", "--trainer.max_steps", "6"]
    with pytest.raises(SystemExit):
        main(["fit", *args])
    err = capsys.readouterr().err
    kept = " ".join(a if " " not in a else repr(a) for a in args[:-2])
    assert f"To continue it: `gpuopt fit {kept} --ckpt_path last --trainer.max_steps 26`; to start a new run: " in err
    # at a max_steps still ahead of the checkpoint, the command is left as it was
    with pytest.raises(SystemExit):
        main(["fit", *args[:-1], "40"])
    assert f"To continue it: `gpuopt fit {kept} --trainer.max_steps 40 --ckpt_path last`;" in capsys.readouterr().err


def test_predict_from_a_checkpoint_gives_no_advice_meant_for_fit(tmp_path, text_dir, cache_dir, monkeypatch, caplog):
    """Lightning's "Please add the following callbacks: [ModelCheckpoint...]" assumes a fit: predict restores no callback."""
    import warnings

    monkeypatch.chdir(tmp_path)
    main(["fit", *_data(text_dir), "--trainer.max_steps", "1", "--model.warmup_steps", "0",
          "--trainer.default_root_dir", "run"])
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("INFO"):
        warnings.simplefilter("always")
        main(["predict", *_data(text_dir), "--ckpt_path", "run/checkpoints/last.ckpt", "--data.prompts", '["a"]',
              "--model.max_new_tokens", "2"])
    said = [str(w.message) for w in caught] + [caplog.text]
    assert not any("Please add the following callbacks" in text for text in said), said
    assert "Loaded model weights from the checkpoint" in caplog.text  # it did load the checkpoint
