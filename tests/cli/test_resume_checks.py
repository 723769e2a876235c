"""`gpuopt fit/predict --ckpt_path`: asked settings applied and reported, architecture changes refused, the
checkpoint's tokenizer kept when the corpus changed, no `-vN` copies on a resumed fit (real Trainers through the CLI)."""

from __future__ import annotations

import inspect
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from lightning_gpuopt import GPTModule, TextDataModule
from lightning_gpuopt.callbacks.resumed_optimizer import ResumedOptimizerSettings, apply_optimizer_settings
from lightning_gpuopt.cli.main import GPTCLI, main
from lightning_gpuopt.data.tokenizer import tokenizer_fingerprint
from lightning_gpuopt.model.checkpoint import read_checkpoint
from lightning_gpuopt.model.optim import build_adamw, warmup_cosine_schedule


def _args(text_dir: Path, ckpt_dir: Path, *extra: str) -> list[str]:
    return [
        "--data.source", str(text_dir), "--data.vocab_size", "300", "--data.block_size", "32", "--data.batch_size", "4",
        "--data.num_workers", "0", "--trainer.default_root_dir", str(ckpt_dir.parent / "run"),
        "--model.preset", "tiny", "--model.warmup_steps", "2", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.limit_val_batches", "0",
        "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.dirpath", str(ckpt_dir),
        "--trainer.callbacks.every_n_train_steps", "2", "--trainer.callbacks.save_top_k", "-1", *extra,
    ]


def _cli(args: list[str]) -> GPTCLI:
    return GPTCLI(GPTModule, TextDataModule, save_config_kwargs={"overwrite": True}, args=args)


@pytest.fixture
def six_steps(tmp_path, cache_dir, text_dir, monkeypatch):
    """A 6-step run saving every 2 steps: epoch=0-step={2,4,6}.ckpt."""
    monkeypatch.chdir(tmp_path)  # the CLI writes config.yaml into the working folder
    ckpt_dir = tmp_path / "ckpt"
    _cli(["fit", *_args(text_dir, ckpt_dir, "--trainer.max_steps", "6")])
    return ckpt_dir


def test_resume_applies_the_asked_learning_rate_and_writes_no_version_copies(six_steps, text_dir, caplog):
    # Resume from step 4 as after a kill that left the step-6 file of the abandoned run behind.
    cli = _cli(["fit", *_args(text_dir, six_steps, "--trainer.max_steps", "8"),
                "--ckpt_path", str(six_steps / "epoch=0-step=4.ckpt"), "--model.learning_rate", "0.02",
                "--data.batch_size", "2"])
    assert sorted(p.name for p in six_steps.iterdir()) == [f"epoch=0-step={s}.ckpt" for s in (2, 4, 6, 8)]  # no -v1
    resumed = [c for c in cli.trainer.callbacks if isinstance(c, ResumedOptimizerSettings)][0]
    assert resumed.applied["learning_rate"] == (6e-4, 0.02) and resumed.applied["decay_steps"] == (4, 6)
    assert cli.model.hparams.learning_rate == 0.02 and cli.datamodule.batch_size == 2
    assert cli.checkpoint_settings.applied == {"learning_rate": (6e-4, 0.02)}
    assert cli.checkpoint_settings.data == {"batch_size": (4, 2)}  # reported; the data's settings are used as given
    optimizer = cli.trainer.optimizers[0]
    assert optimizer.param_groups[0]["initial_lr"] == 0.02
    # The learning rate is the new schedule's (peak 0.02, warm-up 2, 8 steps) at step 8.
    reference = build_adamw(torch.nn.Linear(2, 2), 0.02, 0.1, (0.9, 0.95))
    schedule = warmup_cosine_schedule(reference, 2, 8, 0.1)
    for _ in range(8):
        reference.step()
        schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(reference.param_groups[0]["lr"], rel=1e-12)
    saved = read_checkpoint(six_steps / "epoch=0-step=8.ckpt")
    assert saved["hyper_parameters"]["learning_rate"] == 0.02 and saved["global_step"] == 8


def test_a_resume_that_shortens_the_run_says_so_in_the_run_s_terms(six_steps, text_dir, caplog):
    with caplog.at_level("INFO"):
        cli = _cli(["fit", *_args(text_dir, six_steps, "--trainer.max_steps", "5"), "--model.warmup_steps", "5",
                    "--ckpt_path", str(six_steps / "epoch=0-step=4.ckpt")])
    resumed = [c for c in cli.trainer.callbacks if isinstance(c, ResumedOptimizerSettings)][0]
    assert resumed.applied["decay_steps"] == (4, 1) and resumed.applied["warmup_steps"] == (2, 5)
    assert ("warmup_steps 2 -> 5, the run's length 6 -> 5 optimizer steps (warm-up now lasts the whole run: the "
            "learning rate does not decay)") in caplog.text
    assert "decay_steps" not in caplog.text


def test_training_on_past_a_run_its_warm_up_outlasted_says_what_happened(tmp_path, cache_dir, text_dir, monkeypatch, caplog):
    """A 4-step run with warmup_steps=6 warms up over all 4 steps; trained on to 8, its warm-up and decay resume as
    asked, and the message says the earlier run was 4 steps of warm-up (not 5, and not a warmup_steps change)."""
    monkeypatch.chdir(tmp_path)
    ckpt_dir = tmp_path / "ckpt"
    with pytest.warns(UserWarning, match="warmup_steps=6 is longer than the run"):
        _cli(["fit", *_args(text_dir, ckpt_dir, "--trainer.max_steps", "4"), "--model.warmup_steps", "6"])
    with caplog.at_level("INFO"):
        _cli(["fit", *_args(text_dir, ckpt_dir, "--trainer.max_steps", "8"), "--model.warmup_steps", "6",
              "--ckpt_path", str(ckpt_dir / "epoch=0-step=4.ckpt")])
    assert ("warm-up 4 -> 6 steps (model.warmup_steps=6, which the earlier run's 4 steps cut short), the run's length "
            "4 -> 8 optimizer steps (the cosine decays over the 2 after warm-up, where it did not decay)") in caplog.text


def test_predict_applies_the_asked_sampling_settings(six_steps, text_dir):
    cli = _cli([
        "predict", *_args(text_dir, six_steps), "--ckpt_path", str(six_steps / "epoch=0-step=6.ckpt"),
        "--model.max_new_tokens", "3", "--model.temperature", "0", "--data.prompts", "[the model]",
        "--data.samples_per_prompt", "2",
    ])
    samples = [s for batch in cli.trainer.predict_loop.predictions for s in batch]
    prompt = len(cli.datamodule.encode("the model"))
    assert len(samples) == 2 and all(len(s) == prompt + 3 for s in samples)
    assert torch.equal(samples[0], samples[1])  # temperature 0: greedy, both the same
    assert cli.checkpoint_settings.applied == {"max_new_tokens": (64, 3), "temperature": (0.8, 0.0)}


GROWTH = "zebras quartz jumping over lazy foxes " * 400 + "\n"  # text the first run's BPE never saw


def _files(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_resume_after_the_corpus_grew_keeps_the_checkpoints_tokenizer_and_its_cache(six_steps, text_dir, cache_dir,
                                                                                   capsys, caplog):
    ckpt = six_steps / "epoch=0-step=4.ckpt"
    state = read_checkpoint(ckpt)["TextDataModule"]
    before = _files(cache_dir)
    with open(text_dir / "doc3.txt", "a") as f:
        f.write(GROWTH)
    grown = TextDataModule(source=str(text_dir), vocab_size=300, num_workers=0, cache_dir=str(cache_dir))
    grown.prepare_data()  # a BPE trained on the grown text, in a new folder: other token ids
    grown_bpe = grown.data_dir / "tokenizer.json"
    assert tokenizer_fingerprint(Tokenizer.from_file(str(grown_bpe))) != state["tokenizer_sha256"]
    folders = set(cache_dir.iterdir())

    # Another tokenizer asked for: refused before any data preparation, with the fix ...
    with pytest.raises(SystemExit) as info:
        main(["fit", *_args(text_dir, six_steps, "--trainer.max_steps", "8"), "--ckpt_path", str(ckpt),
              "--data.tokenizer", str(grown_bpe)])
    assert info.value.code == 2 and "Leave data.tokenizer unset" in capsys.readouterr().err
    assert set(cache_dir.iterdir()) == folders

    # ... which works: the grown text is tokenised with the checkpoint's tokenizer, said in one line.
    with caplog.at_level(logging.INFO):
        cli = _cli(["fit", *_args(text_dir, six_steps, "--trainer.max_steps", "8"), "--ckpt_path", str(ckpt)])
    assert cli.trainer.global_step == 8
    data = cli.datamodule
    assert tokenizer_fingerprint(data.tokenizer) == state["tokenizer_sha256"]
    assert data.data_dir not in folders
    said = [r.getMessage() for r in caplog.records if "checkpoint's tokenizer" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("The data uses the checkpoint's tokenizer (sha256 ")
    train = np.fromfile(data.data_dir / "train.bin", dtype=np.uint16).astype(np.int64).tolist()
    assert GROWTH.strip() in data.tokenizer.decode(train)
    assert _files(cache_dir).items() >= before.items()  # every file of the first run's cache is byte-identical
    assert read_checkpoint(six_steps / "epoch=0-step=8.ckpt")["TextDataModule"]["tokenizer_sha256"] == state["tokenizer_sha256"]


def test_predict_decodes_with_the_checkpoints_tokenizer_whatever_the_cache_holds(six_steps, tmp_path, text_dir, cache_dir):
    ckpt = six_steps / "epoch=0-step=6.ckpt"
    carried = Tokenizer.from_str(read_checkpoint(ckpt)["TextDataModule"]["tokenizer_json"])
    with open(text_dir / "doc3.txt", "a") as f:
        f.write(GROWTH)
    shutil.rmtree(cache_dir)  # sampling needs no token cache
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the model\nzebras jumping\n")
    output = tmp_path / "out.jsonl"
    cli = _cli(["predict", *_args(text_dir, six_steps), "--ckpt_path", str(ckpt), "--model.max_new_tokens", "4",
                "--model.temperature", "0", "--generate.prompts_file", str(prompts), "--generate.output", str(output)])
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["the model", "zebras jumping"]
    assert all(len(r["tokens"]) == 4 and r["completion"] == carried.decode(r["tokens"]) for r in records)
    assert cli.datamodule.encode("zebras jumping") == carried.encode("zebras jumping").ids
    assert not cache_dir.exists()  # nothing was tokenised


def test_an_older_checkpoint_without_its_tokenizer_resumes_by_the_advice_after_the_corpus_grew(
    six_steps, tmp_path, text_dir, cache_dir, capsys
):
    checkpoint = read_checkpoint(six_steps / "epoch=0-step=4.ckpt")
    state = checkpoint["TextDataModule"]
    carried = Tokenizer.from_str(state.pop("tokenizer_json"))  # as written before checkpoints carried it
    assert tokenizer_fingerprint(carried) == state["tokenizer_sha256"]
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)
    with open(text_dir / "doc3.txt", "a") as f:
        f.write(GROWTH)
    with pytest.raises(SystemExit) as info:
        main(["fit", *_args(text_dir, six_steps, "--trainer.max_steps", "8"), "--ckpt_path", str(old)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "is not the one the checkpoint was trained with" in err
    assert f"set data.tokenizer {state['tokenizer_file']}" in err  # the first run's file: never overwritten
    cli = _cli(["fit", *_args(text_dir, six_steps, "--trainer.max_steps", "8"), "--ckpt_path", str(old),
                "--data.tokenizer", state["tokenizer_file"]])  # the advice, followed
    assert cli.trainer.global_step == 8 and tokenizer_fingerprint(cli.datamodule.tokenizer) == state["tokenizer_sha256"]


def test_apply_optimizer_settings_scales_the_schedule_exactly():
    model = torch.nn.Linear(4, 4)
    optimizer = build_adamw(model, 1e-3, 0.1, (0.9, 0.95))
    schedule = warmup_cosine_schedule(optimizer, 2, 10, 0.1)
    for _ in range(5):
        optimizer.step()
        schedule.step()
    before = optimizer.param_groups[0]["lr"]
    apply_optimizer_settings(optimizer, 2e-3, 0.05, (0.8, 0.9), 2, 0.1, total_steps=10, steps_done=5)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2 * before, rel=1e-12)
    assert optimizer.param_groups[0]["weight_decay"] == 0.05 and optimizer.param_groups[1]["weight_decay"] == 0.0
    assert all(g["betas"] == (0.8, 0.9) for g in optimizer.param_groups)


def test_the_lightning_internals_used_are_there():
    """The resumed fit turns off ModelCheckpoint._enable_version_counter: fail here, not silently, if a Lightning
    upgrade renames it. The CLI overrides no private method of LightningCLI (only its public hooks)."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.cli import LightningCLI

    from lightning_gpuopt.cli.main import GPTCLI

    assert ModelCheckpoint(enable_version_counter=True)._enable_version_counter is True
    private = [name for name in vars(GPTCLI) if name.startswith("_") and not name.startswith("__") and hasattr(LightningCLI, name)]
    assert private == []


def test_init_from_says_which_architecture_it_takes_from_the_checkpoint(tmp_path, text_dir, cache_dir, caplog, monkeypatch):
    """A config that sets the default preset (the quickstart's `preset: tiny`) and init_from a llama-tiny checkpoint trains
    the checkpoint's architecture, as documented: said with the load, where the llama model trained without a word."""
    from lightning_gpuopt.model import GPT, GPTConfig

    monkeypatch.chdir(tmp_path)
    path = tmp_path / "llama.ckpt"
    gpt = GPT(GPTConfig.from_name("llama-tiny", vocab_size=300, block_size=32))
    hparams = {**{k: p.default for k, p in inspect.signature(GPTModule.__init__).parameters.items() if k != "self"},
               "preset": "llama-tiny", "n_layer": 2, "vocab_size": 300, "block_size": 32, "betas": (0.9, 0.95)}
    torch.save({"pytorch-lightning_version": "2.6.6", "global_step": 3, "hyper_parameters": hparams,
                "state_dict": {f"model.{k}": v for k, v in gpt.state_dict().items()}}, path)
    with caplog.at_level(logging.INFO):
        cli = _cli(["fit", *_args(text_dir, tmp_path / "ckpt", "--trainer.max_steps", "2"), "--model.init_from", str(path)])
    assert cli.model.config.arch == "llama"
    assert (f"model.init_from: the GPT starts from the weights of {path} (step 3 of its run); the optimizer and the "
            "learning-rate schedule start fresh; from the checkpoint's architecture: model.preset='llama-tiny' (configured "
            "'tiny').") in caplog.text  # n_layer=2 is the checkpoint's too, but unset here: nothing it replaces


def test_a_setting_the_checkpoint_replaces_is_called_configured_not_a_default(caplog):
    """An explicit --model.preset tiny equals GPTModule's default: what replaces it is not called a "default"."""
    from lightning_gpuopt.cli.resume_checks import CheckpointSettings

    settings = CheckpointSettings("last.ckpt", "predict", {"preset": "124m"}, kept={"preset": ("124m", "tiny")})
    with caplog.at_level("INFO"):
        settings.report()
    assert "predict --ckpt_path last.ckpt: from the checkpoint: model.preset='124m' (over the configured 'tiny')." in caplog.text
    assert "default" not in caplog.text
