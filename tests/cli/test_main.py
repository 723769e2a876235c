import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import Precision

from lightning_gpuopt import GPTModule, TextDataModule
from lightning_gpuopt.callbacks import CUDASettings, ExactResume, MFUMonitor, NonFiniteGuard, SigtermCheckpoint
from lightning_gpuopt.cli.main import GPTCLI
from lightning_gpuopt.cli.defaults import CHECKPOINT_EVERY_N_STEPS
from lightning_gpuopt.perf.device import REFERENCE_DEVICES
from lightning_gpuopt.precision import BF16Precision, Float8Precision

from tests._paths import REPO  # noqa: E402

CONFIGS = sorted((REPO / "examples" / "configs").glob("*.yaml"))
GPT_CONFIGS = [c for c in CONFIGS if c.stem != "hf-llama"]  # hf-llama trains a module of its own (examples/hf_llama.py)


def test_every_shipped_config_is_there():
    assert {p.stem for p in CONFIGS} == {"quickstart", "fast", "production", "max-quality", "mega", "h100", "multi-gpu", "hf-llama",
                                               "llama-1b", "llama-8b-tp", "rft"}


def test_the_wandb_sync_path_in_the_docs_is_where_the_recipes_write():
    """WandbLogger writes under <save_dir>/wandb/; the docs' sync command names the recipes' save_dir."""
    import re

    docs = (REPO / "docs" / "callbacks.md").read_text()
    synced = set(re.findall(r"wandb sync (runs/[\w-]+)/wandb/offline-run-\*", docs))
    save_dirs = {}
    for config in CONFIGS:
        found = re.findall(r"WandbLogger\n\s*#\s*init_args: \{[^}]*save_dir: ([\w/-]+)\}", config.read_text())
        if found:
            save_dirs[config.stem] = found[0]
    assert save_dirs and all(path == f"runs/{stem}" for stem, path in save_dirs.items()), save_dirs
    assert synced and synced <= set(save_dirs.values())


class _ParseOnly(GPTCLI):
    """Parses and validates a config without building the model and data (the recipes' WikiText-103
    folder is not on the test machine)."""

    def instantiate_classes(self) -> None:
        pass


@pytest.mark.parametrize("config", GPT_CONFIGS, ids=lambda p: p.stem)
def test_config_parses_through_the_cli_parser(config):
    cli = _ParseOnly(GPTModule, TextDataModule, run=False, args=["--config", str(config)])
    raw = yaml.safe_load(config.read_text())
    ns = cli.config
    assert ns.model.preset == raw["model"]["preset"]
    assert ns.trainer.max_steps == raw["trainer"]["max_steps"]
    assert ns.model.block_size == raw["data"].get("block_size", 256)  # linked from the data (rft: from init_from's, at run time)
    # Every recipe runs the stack explicitly: no Lightning precision string, our plugin and callbacks. The
    # quickstart and rft, which also run on a CPU, leave the precision to the stack: float32 on a CPU.
    assert ns.trainer.precision is None
    if config.stem in ("quickstart", "rft"):
        assert "plugins" not in raw["trainer"] and _plugin_paths(ns.trainer.plugins) == _stack_plugin_paths()
    else:
        assert [p.class_path for p in ns.trainer.plugins] == ["lightning_gpuopt.precision.BF16Precision"]
    callbacks = {c.class_path.rsplit(".", 1)[1]: c.init_args for c in ns.trainer.callbacks}
    assert {"CUDASettings", "MFUMonitor", "NonFiniteGuard", "ModelCheckpoint"} <= set(callbacks)
    checkpoint = callbacks["ModelCheckpoint"]
    assert checkpoint.save_last is True and checkpoint.every_n_train_steps >= 100
    assert checkpoint.every_n_epochs is None  # not at every validation
    # Validation runs every 500 optimizer steps in the WikiText-103 recipes (val_check_interval counts micro-batches).
    if config.stem not in ("quickstart", "rft"):
        assert ns.trainer.val_check_interval == 500 * ns.trainer.accumulate_grad_batches
        assert ns.trainer.check_val_every_n_epoch is None


def test_hf_llama_recipe_parses_through_the_cli_parser(monkeypatch):
    """The recipe names its own module and TextDataModule by class path; the stack is listed as in every recipe."""
    from lightning_gpuopt.cli.named_classes import named_classes

    monkeypatch.syspath_prepend(str(REPO / "examples"))
    args = ["--config", str(REPO / "examples" / "configs" / "hf-llama.yaml")]
    named = named_classes(["fit", *args], {})
    assert (named.model, named.data) == ("hf_llama.TinyLlama", "lightning_gpuopt.data.TextDataModule")
    ns = _ParseOnly(None, None, run=False, args=args).config  # as make_cli builds it for these names
    sys.modules.pop("hf_llama", None)
    assert ns.model.init_args.vocab_size == ns.data.init_args.vocab_size
    assert ns.model.init_args.block_size == ns.data.init_args.block_size
    assert _plugin_paths(ns.trainer.plugins) == _stack_plugin_paths() and ns.trainer.precision is None  # the stack's
    names = [c.class_path.rsplit(".", 1)[1] for c in ns.trainer.callbacks]
    assert names == ["CUDASettings", "MFUMonitor", "NonFiniteGuard", "ModelCheckpoint"]
    assert ns.exact_resume.rebuild_loaders is True  # on for named data; TextDataModule's own sampler is left as it is


def test_h100_and_multi_gpu_recipes():
    h100 = _ParseOnly(GPTModule, TextDataModule, run=False, args=["--config", str(REPO / "examples/configs/h100.yaml")]).config
    auto = {c.class_path.rsplit(".", 1)[1]: c.init_args for c in h100.trainer.callbacks}["AutoBatchSize"]
    assert auto.global_batch_size * h100.data.block_size == 524_288  # ~0.5M tokens per optimizer step
    assert h100.model.preset == "124m" and h100.model.compile and h100.data.num_workers == 8
    assert h100.model.learning_rate == 6e-4 and h100.model.warmup_steps == 1000
    multi = _ParseOnly(GPTModule, TextDataModule, run=False, args=["--config", str(REPO / "examples/configs/multi-gpu.yaml")]).config
    assert multi.trainer.strategy == "gpuopt-auto"


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


def test_predict_prints_samples(text_dir, cache_dir, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match="no --ckpt_path given, so this samples an untrained"):
        GPTCLI(
            GPTModule,
            TextDataModule,
            args=["predict", "--data.source", str(text_dir), "--data.vocab_size", "300", "--data.num_workers", "0",
                  "--data.prompts", "[the model]", "--data.samples_per_prompt", "2", "--model.max_new_tokens", "4"],
        )
    assert capsys.readouterr().out.count("the model") == 2


def _printed_config(args: list[str], capsys) -> dict:
    """The config ``gpuopt fit --print_config`` prints (in this process: the parser reads the same environment)."""
    from lightning_gpuopt.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, "--print_config"])
    assert exit_info.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_environment_variables_set_options(cache_dir, monkeypatch, capsys):
    monkeypatch.setenv("GPUOPT_FIT__TRAINER__MAX_STEPS", "7")
    monkeypatch.setenv("GPUOPT_FIT__MODEL__LEARNING_RATE", "0.01")
    config = _printed_config([], capsys)
    assert config["trainer"]["max_steps"] == 7 and config["model"]["learning_rate"] == 0.01
    # A --config file takes precedence: the quickstart's max_steps stays; a key it does not set comes from the env.
    monkeypatch.setenv("GPUOPT_FIT__TRAINER__NUM_SANITY_VAL_STEPS", "5")
    quickstart = [c for c in CONFIGS if c.stem == "quickstart"][0]
    config = _printed_config(["--config", str(quickstart)], capsys)
    assert config["trainer"]["max_steps"] == 300 and config["trainer"]["num_sanity_val_steps"] == 5


def test_vocab_size_is_linked_from_the_data(tmp_path, cache_dir):
    tok_src = tmp_path / "t.txt"
    tok_src.write_text("hello world " * 100)
    cli = GPTCLI(GPTModule, TextDataModule, run=False, args=["--data.source", str(tok_src), "--data.vocab_size", "320"])
    assert cli.model.config.vocab_size == 320 == cli.datamodule.vocab_size


def test_typo_in_option_is_reported():
    with pytest.raises(SystemExit):
        _ParseOnly(GPTModule, TextDataModule, run=False, args=["--model.presett", "124m"])


def test_main_args_replace_the_command_line_without_a_warning(monkeypatch, capsys):
    """``main(args)`` from a process with its own arguments (a test runner, a script) does not warn about both."""
    import warnings

    from lightning_gpuopt.cli.main import main

    monkeypatch.setattr(sys, "argv", ["runner", "-q", "tests/"])
    with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit) as exit_:
        warnings.simplefilter("always")
        main(["fit", "--help"])
    assert exit_.value.code == 0 and "--trainer.max_steps" in capsys.readouterr().out
    assert [str(w.message) for w in caught if "args parameter" in str(w.message)] == []


def test_python_dash_m_is_the_gpuopt_command():
    out = subprocess.run([sys.executable, "-m", "lightning_gpuopt", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "{fit,validate,test,predict}" in out.stdout and "gpuopt" in out.stdout
    said = " ".join(out.stdout.split())  # what the command is and what fit runs by default, not Lightning's generic line
    assert "Lightning Trainer command line tool" not in said
    assert "train and sample a GPT" in said and "GPTModule on TextDataModule" in said and "--ckpt_path last" in said


def test_main_ends_the_process_group_after_a_successful_run(text_dir, cache_dir, tmp_path, monkeypatch):
    """`gpuopt` destroys a gloo process group itself (Lightning does so at exit only for NCCL)."""
    import torch.distributed as dist

    from lightning_gpuopt.cli.main import main

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


@pytest.mark.parametrize("name", sorted(REFERENCE_DEVICES))
def test_stack_precision_is_the_fastest_on_the_device(name):
    from lightning_gpuopt.cli.defaults import default_stack, float32_note

    facts = REFERENCE_DEVICES[name].type
    plugins = default_stack(facts)["trainer.plugins"]
    if name == "cpu":  # bf16 autocast doubles the step time on a CPU
        assert plugins is None and float32_note(None, None, facts).startswith("gpuopt: running in float32 on the CPU")
        assert float32_note("bf16-mixed", None, facts) is None and float32_note(None, [BF16Precision()], facts) is None
    else:  # BF16Precision itself falls back to fp16 where the GPU has no bf16
        assert plugins == [{"class_path": "lightning_gpuopt.precision.BF16Precision"}]
        assert float32_note(None, None, facts) is None


def _plugin_paths(plugins):
    if plugins is None:
        return None
    return [p["class_path"] if isinstance(p, dict) else p.class_path for p in plugins]


def _stack_plugin_paths():
    from lightning_gpuopt.cli.defaults import stack_device_type, stack_precision_plugins

    return _plugin_paths(stack_precision_plugins(stack_device_type()))


def test_default_stack_is_in_the_parsed_config():
    ns = _ParseOnly(GPTModule, TextDataModule, run=False, args=[]).config
    assert _plugin_paths(ns.trainer.plugins) == _stack_plugin_paths()  # float32 on a CPU, BF16Precision on a GPU
    names = [c.class_path.rsplit(".", 1)[1] for c in ns.trainer.callbacks]
    assert names == ["CUDASettings", "MFUMonitor", "NonFiniteGuard", "ModelCheckpoint"]
    checkpoint = ns.trainer.callbacks[-1].init_args
    assert checkpoint.save_last is True and checkpoint.every_n_train_steps == CHECKPOINT_EVERY_N_STEPS
    # Overridable: a flag replaces the plugin, another removes the callbacks.
    ns = _ParseOnly(GPTModule, TextDataModule, run=False,
                    args=["--trainer.plugins", "Float8Precision", "--trainer.callbacks", "null"]).config
    assert ns.trainer.plugins.class_path == "lightning_gpuopt.precision.Float8Precision" and ns.trainer.callbacks is None


def test_print_config_shows_the_stack():
    out = subprocess.run([sys.executable, "-m", "lightning_gpuopt", "fit", "--print_config"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    trainer = yaml.safe_load(out.stdout)["trainer"]
    assert _plugin_paths(trainer["plugins"]) == _stack_plugin_paths()  # float32 on a CPU, the faster there
    assert [c["class_path"].rsplit(".", 1)[1] for c in trainer["callbacks"]] == [
        "CUDASettings", "MFUMonitor", "NonFiniteGuard", "ModelCheckpoint"]
    assert "args parameter is intended" not in out.stderr


def _tiny(text_dir, *extra):
    return ["--data.source", str(text_dir), "--data.vocab_size", "300", "--data.num_workers", "0",
            "--data.block_size", "16", "--data.batch_size", "2", "--model.preset", "tiny", *extra]


def test_trainer_gets_the_stack(text_dir, cache_dir, tmp_path, caplog):
    from lightning_gpuopt.perf.device import cuda_device_count

    if cuda_device_count() > 0:
        pytest.skip("checks the CPU's stack (float32): on a GPU the stack trains in bf16")
    with caplog.at_level(logging.INFO):
        cli = GPTCLI(GPTModule, TextDataModule, run=False, args=_tiny(text_dir, "--trainer.default_root_dir", str(tmp_path)))
    trainer = cli.trainer
    assert type(trainer.precision_plugin) is Precision and trainer.precision == "32-true"
    said = [r.getMessage() for r in caplog.records if "float32" in r.getMessage()]
    assert said == ["gpuopt: running in float32 on the CPU (bf16 autocast is 5-10x slower there); pass "
                    "--trainer.plugins BF16Precision to use bf16."]
    kinds = {type(c) for c in trainer.callbacks}
    assert {CUDASettings, MFUMonitor, NonFiniteGuard, ModelCheckpoint, ExactResume, SigtermCheckpoint} <= kinds
    checkpoint = trainer.checkpoint_callback
    assert checkpoint.dirpath == os.path.realpath(tmp_path / "checkpoints")  # fixed: --ckpt_path last finds it


def test_callbacks_that_drop_checkpointing_or_the_guard_say_so_once(text_dir, cache_dir, tmp_path, caplog):
    """`--trainer.callbacks X` over a config's list replaces it: one note names what was dropped and `+=`."""
    quickstart = str(REPO / "examples" / "configs" / "quickstart.yaml")

    def notes(*flags):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            GPTCLI(GPTModule, TextDataModule, run=False,
                   args=["--config", quickstart, *_tiny(text_dir, "--trainer.default_root_dir", str(tmp_path), *flags)])
        return [r.getMessage() for r in caplog.records if "trainer.callbacks replaces" in r.getMessage()]

    monitor = "lightning.pytorch.callbacks.LearningRateMonitor"
    assert notes("--trainer.callbacks", monitor) == [
        "gpuopt: trainer.callbacks replaces the stack's list and leaves out CUDASettings (no TF32, SDPA order or "
        "allocator settings on a GPU), MFUMonitor (no tokens/s or MFU), NonFiniteGuard (NaN/Inf steps are trained on) "
        "and the ModelCheckpoint keeping last.ckpt (Lightning's default one saves at the end of each epoch only; "
        "--ckpt_path last resumes from the newest checkpoint it wrote). To keep them, add callbacks with "
        "--trainer.callbacks+=X instead, or list them too in the config."]
    assert notes(f"--trainer.callbacks+={monitor}") == []  # appended: the config's list is kept
    assert notes() == []
    # No checkpoint asked for: only the guard is named.
    said = notes("--trainer.callbacks", monitor, "--trainer.enable_checkpointing", "false")
    assert len(said) == 1 and "ModelCheckpoint" not in said[0] and "NonFiniteGuard (NaN/Inf steps are trained on)" in said[0]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_trainer_precision_replaces_the_default_plugin(text_dir, cache_dir, tmp_path, precision):
    cli = GPTCLI(GPTModule, TextDataModule, run=False,
                 args=_tiny(text_dir, "--trainer.precision", precision, "--trainer.default_root_dir", str(tmp_path)))
    assert not isinstance(cli.trainer.precision_plugin, BF16Precision)
    assert cli.trainer.precision == precision


def test_bf16_asked_for_on_a_cpu_is_kept(text_dir, cache_dir, tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        cli = GPTCLI(GPTModule, TextDataModule, run=False,
                     args=_tiny(text_dir, "--trainer.plugins", "BF16Precision", "--trainer.default_root_dir", str(tmp_path)))
    assert isinstance(cli.trainer.precision_plugin, BF16Precision)
    assert not [r for r in caplog.records if "float32" in r.getMessage()]


def test_float8_with_one_flag(text_dir, cache_dir, tmp_path):
    cli = GPTCLI(GPTModule, TextDataModule, run=False,
                 args=_tiny(text_dir, "--trainer.plugins", "Float8Precision", "--trainer.plugins.emulate", "true",
                            "--trainer.default_root_dir", str(tmp_path)))
    assert isinstance(cli.trainer.precision_plugin, Float8Precision) and cli.trainer.precision_plugin.emulate


def test_fit_without_a_run_length_names_the_option(capsys):
    from lightning_gpuopt.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--model.preset", "tiny"])
    assert exit_info.value.code == 2
    assert "trainer.max_steps" in capsys.readouterr().err


def _gpuopt(*args, cwd, env=None, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "lightning_gpuopt", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


def _step(path):
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quickstart_sigterm_then_resume_last_then_readme_predict(text_dir, cache_dir, tmp_path, monkeypatch, capsys):
    """The quickstart (at a tiny size) in real processes: SIGTERM mid-run writes last.ckpt and exits non-zero;
    `--ckpt_path last` continues from it; the README's predict command (run in this process) samples from
    that checkpoint."""
    import warnings

    from lightning_gpuopt.cli.main import main

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    quickstart = REPO / "examples/configs/quickstart.yaml"
    tiny = [*_tiny(text_dir), "--model.n_layer", "2", "--model.n_embd", "32", "--model.n_head", "2",
            "--trainer.enable_progress_bar", "false"]
    args = ["fit", "--config", str(quickstart), *tiny, "--trainer.max_steps", "60",
            "--trainer.callbacks.every_n_train_steps", "10"]  # the quickstart's ModelCheckpoint is its last callback
    ckpt = tmp_path / "runs" / "quickstart" / "checkpoints" / "last.ckpt"  # the quickstart's default_root_dir
    proc = _gpuopt(*args, cwd=tmp_path, env=env)
    try:
        deadline = time.monotonic() + 240
        while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ckpt.exists(), "no periodic last.ckpt"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "SigtermCheckpoint: received SIGTERM; saved" in out
    stopped_at = _step(ckpt)
    assert 10 <= stopped_at < 60
    assert list(ckpt.parent.iterdir()) == [ckpt]

    proc = _gpuopt(*args, "--ckpt_path", "last", cwd=tmp_path, env=env)  # the same command, continued
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "Restored all states from the checkpoint" in out and "no last checkpoint" not in out
    assert _step(ckpt) == 60

    readme = (REPO / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.startswith("gpuopt predict --config examples/configs/quickstart.yaml"))
    argv = [str(quickstart) if a == "examples/configs/quickstart.yaml" else a for a in shlex.split(command)[1:]]
    monkeypatch.chdir(tmp_path)  # the README's checkpoint path is relative to where the fit ran
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main([*argv, *tiny, "--model.max_new_tokens", "4"])
    assert not [str(w.message) for w in caught if "untrained" in str(w.message)]
    assert capsys.readouterr().out.count("def main") == 4  # data.samples_per_prompt samples of the prompt


def test_predict_from_prompts_file_writes_jsonl(text_dir, cache_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the model\nthe optimizer lowers\n\nthe model\n")
    output = tmp_path / "out.jsonl"
    with pytest.warns(UserWarning, match="untrained"):
        GPTCLI(GPTModule, TextDataModule,
               args=["predict", *_tiny(text_dir), "--model.max_new_tokens", "5",
                     "--trainer.default_root_dir", str(tmp_path), "--generate.prompts_file", str(prompts),
                     "--generate.batch_size", "4", "--generate.samples_per_prompt", "3", "--generate.output", str(output)])
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [(r["prompt"], r["sample"]) for r in records] == [
        ("the model", 0), ("the model", 1), ("the model", 2),
        ("the optimizer lowers", 0), ("the optimizer lowers", 1), ("the optimizer lowers", 2),
        ("the model", 0), ("the model", 1), ("the model", 2)]
    # an untrained model may sample end-of-text first: a row then ends early, and says so
    assert all(isinstance(r["completion"], str) and (len(r["tokens"]) == 5) == (r["finish"] == "length") and
               r["finish"] in ("length", "eot") for r in records), [(r["tokens"], r["finish"]) for r in records]


def test_prompts_file_is_refused_outside_predict(text_dir, cache_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        GPTCLI(GPTModule, TextDataModule,
               args=["fit", *_tiny(text_dir), "--trainer.max_steps", "1", "--generate.prompts_file", "p.txt"])
    assert "read by `gpuopt predict` only" in capsys.readouterr().err


def test_cli_defaults_helpers():
    from lightning_gpuopt.cli.defaults import check_run_length, precision_for_estimate, replace_precision_plugins

    bf16 = BF16Precision()
    assert precision_for_estimate(None, [bf16]) == "bf16-mixed" and precision_for_estimate(None, None) == "32-true"
    assert precision_for_estimate("16-mixed", [bf16]) == "16-mixed"
    assert replace_precision_plugins(None, [bf16]) == [bf16] and replace_precision_plugins("32-true", bf16) == []
    assert check_run_length({"max_steps": -1, "max_epochs": None}).startswith("gpuopt fit needs a run length")
    assert check_run_length({"max_steps": 10}) is None and check_run_length({"max_steps": -1, "max_epochs": 2}) is None
    assert check_run_length({"max_steps": -1, "fast_dev_run": True}) is None
    assert check_run_length({"max_steps": -1, "max_time": "00:01:00:00"}) is None


def test_prompts_file_problems_stop_before_anything_is_built(text_dir, cache_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="generate.prompts_file"):
        GPTCLI(GPTModule, TextDataModule, args=["predict", *_tiny(text_dir), "--generate.prompts_file", str(tmp_path / "no.txt")])
    (tmp_path / "p.txt").write_text("a\n")
    with pytest.raises(SystemExit):
        GPTCLI(GPTModule, TextDataModule,
               args=["predict", *_tiny(text_dir), "--generate.prompts_file", str(tmp_path / "p.txt"), "--generate.batch_size", "0"])
    assert "generate.batch_size must be >= 1, got 0" in capsys.readouterr().err
    assert not (cache_dir.exists() and any(cache_dir.iterdir()))  # no tokenising happened


def test_fit_trains_the_llama_style_preset_end_to_end(text_dir, cache_dir, tmp_path, monkeypatch, capsys):
    """`gpuopt fit --model.preset llama-tiny` with the default stack: trains, writes last.ckpt, and the
    checkpoint is a Llama-style GPT again; a resume asking for other key/value heads is refused."""
    from lightning_gpuopt.cli.main import main
    from lightning_gpuopt.model.checkpoint import load_gpt, read_checkpoint

    monkeypatch.chdir(tmp_path)
    run = ["--data.source", str(text_dir), "--data.vocab_size", "300", "--data.num_workers", "0", "--data.block_size", "32",
           "--data.batch_size", "4", "--model.preset", "llama-tiny", "--model.warmup_steps", "1", "--trainer.accelerator",
           "cpu", "--trainer.devices", "1", "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
           "--trainer.default_root_dir", "run"]
    main(["fit", *run, "--trainer.max_steps", "3"])
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    gpt = load_gpt(ckpt)
    assert gpt.config.arch == "llama" and gpt.config.n_kv_head == 2 and gpt.config.vocab_size == 300
    assert read_checkpoint(ckpt)["global_step"] == 3
    with pytest.raises(SystemExit) as stop:
        main(["fit", *run, "--trainer.max_steps", "4", "--ckpt_path", "last", "--model.n_kv_head", "4"])
    assert stop.value.code == 2
    assert "model.n_kv_head=4 but the checkpoint has n_kv_head=2" in capsys.readouterr().err


def test_a_mistyped_environment_option_is_refused_with_the_one_meant(monkeypatch, capsys):
    from lightning_gpuopt.cli.main import main

    monkeypatch.setenv("GPUOPT_FIT__TRAINER__MAX_STEP", "20")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--model.preset", "tiny", "--trainer.max_steps", "1"])
    assert exit_info.value.code == 2
    assert ("The environment variable GPUOPT_FIT__TRAINER__MAX_STEP names no option of gpuopt fit (did you mean "
            "GPUOPT_FIT__TRAINER__MAX_STEPS, for --trainer.max_steps?)") in capsys.readouterr().err
    monkeypatch.delenv("GPUOPT_FIT__TRAINER__MAX_STEP")
    monkeypatch.setenv("GPUOPT_FIT__MODEL__CLASS_PATH", "lightning_gpuopt.GPTModule")  # a class, as named_classes reads
    from lightning_gpuopt.cli.config_checks import check_environment_options

    check_environment_options({"GPUOPT_FIT__MODEL__CLASS_PATH": "a.B", "GPUOPT_CACHE_DIR": "/x"}, {"fit": ["model"]})
    with pytest.raises(ValueError, match=r"GPUOPT_PREDICT__MODEL__TEMPRATURE names no option of gpuopt predict \(did you "
                                         r"mean GPUOPT_PREDICT__MODEL__TEMPERATURE, for --model.temperature\?\)"):
        check_environment_options({"GPUOPT_PREDICT__MODEL__TEMPRATURE": "0"}, {"predict": ["model.temperature"]})
