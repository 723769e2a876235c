import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_gpuopt.cli import GPTCLI
from lightning_gpuopt import GPTModule, TextDataModule

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "examples" / "configs").glob("*.yaml"))


def test_every_shipped_config_is_there():
    assert {p.stem for p in CONFIGS} == {"quickstart", "fast", "production", "max-quality", "mega"}


class _ParseOnly(GPTCLI):
    """Parses and validates a config without building the model and data (the recipes' WikiText-103
    folder is not on the test machine)."""

    def instantiate_classes(self) -> None:
        pass


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_config_parses_through_the_cli_parser(config):
    cli = _ParseOnly(GPTModule, TextDataModule, run=False, args=["--config", str(config)])
    raw = yaml.safe_load(config.read_text())
    ns = cli.config
    assert ns.model.preset == raw["model"]["preset"]
    assert ns.trainer.max_steps == raw["trainer"]["max_steps"]
    assert ns.model.block_size == raw["data"]["block_size"]  # linked from the data


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_key_has_a_comment(config):
    for line in config.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#") and not line.rstrip().endswith(":"):
            assert "#" in line, f"{config.name}: uncommented key: {line!r}"


def test_quickstart_fast_dev_run(cache_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    quickstart = [c for c in CONFIGS if c.stem == "quickstart"][0]
    cli = GPTCLI(GPTModule, TextDataModule, args=["fit", "--config", str(quickstart), "--trainer.fast_dev_run", "true"])
    assert cli.trainer.global_step == 1
    assert cli.datamodule.source == "stdlib"
    assert cli.model.config.n_layer == 4 and cli.model.config.vocab_size == cli.datamodule.vocab_size
    assert 3.0 < cli.trainer.callback_metrics["train/loss"].item() < 12.0


def test_predict_prints_samples(text_dir, cache_dir, capsys):
    GPTCLI(
        GPTModule,
        TextDataModule,
        args=["predict", "--data.source", str(text_dir), "--data.vocab_size", "300", "--data.num_workers", "0",
              "--data.prompts", "[the model]", "--data.samples_per_prompt", "2", "--model.max_new_tokens", "4"],
    )
    assert capsys.readouterr().out.count("the model") == 2


def test_environment_variables_set_options(cache_dir):
    env = {**os.environ, "GPUOPT_FIT__TRAINER__MAX_STEPS": "7", "GPUOPT_FIT__MODEL__LEARNING_RATE": "0.01"}
    out = subprocess.run(
        [sys.executable, "-m", "lightning_gpuopt", "fit", "--print_config"], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    assert config["trainer"]["max_steps"] == 7 and config["model"]["learning_rate"] == 0.01
    # A --config file takes precedence: the quickstart's max_steps stays; a key it does not set comes from the env.
    env["GPUOPT_FIT__TRAINER__NUM_SANITY_VAL_STEPS"] = "5"
    quickstart = [c for c in CONFIGS if c.stem == "quickstart"][0]
    out = subprocess.run(
        [sys.executable, "-m", "lightning_gpuopt", "fit", "--config", str(quickstart), "--print_config"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    assert config["trainer"]["max_steps"] == 300 and config["trainer"]["num_sanity_val_steps"] == 5


def test_vocab_size_is_linked_from_the_data(tmp_path, cache_dir):
    tok_src = tmp_path / "t.txt"
    tok_src.write_text("hello world " * 100)
    cli = GPTCLI(GPTModule, TextDataModule, run=False, args=["--data.source", str(tok_src), "--data.vocab_size", "320"])
    assert cli.model.config.vocab_size == 320 == cli.datamodule.vocab_size


def test_typo_in_option_is_reported():
    with pytest.raises(SystemExit):
        _ParseOnly(GPTModule, TextDataModule, run=False, args=["--model.presett", "124m"])


def test_python_dash_m_is_the_gpuopt_command():
    out = subprocess.run([sys.executable, "-m", "lightning_gpuopt", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "{fit,validate,test,predict}" in out.stdout and "gpuopt" in out.stdout


def test_main_ends_the_process_group_after_a_successful_run(text_dir, cache_dir, tmp_path, monkeypatch):
    """`gpuopt` destroys a gloo process group itself (Lightning does so at exit only for NCCL)."""
    import torch.distributed as dist

    from lightning_gpuopt.cli import main

    monkeypatch.chdir(tmp_path)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        main(["fit", "--data.source", str(text_dir), "--data.vocab_size", "300", "--data.num_workers", "0",
              "--data.block_size", "16", "--data.batch_size", "2", "--model.preset", "tiny",
              "--trainer.fast_dev_run", "true", "--trainer.accelerator", "cpu", "--trainer.devices", "1"])
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
