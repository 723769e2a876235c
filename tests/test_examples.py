import os
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_train_wikitext_script_trains(tmp_path, text_dir, cache_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import train_wikitext

    trainer = train_wikitext.main(
        ["--data_dir", str(text_dir), "--max_steps", "4", "--d_model", "64", "--num_layers", "2", "--num_heads", "4",
         "--block_size", "32", "--vocab_size", "300", "--batch_size", "4", "--gradient_accumulation_steps", "2",
         "--mixed_precision", "bf16", "--num_workers", "0", "--checkpoint_dir", str(tmp_path / "ckpt")]
    )
    sys.modules.pop("train_wikitext", None)
    assert trainer.global_step == 4 and trainer.accumulate_grad_batches == 2
    assert trainer.lightning_module.config.n_embd == 64
    assert (tmp_path / "ckpt" / "last.ckpt").is_file()


def test_train_wikitext_validates_past_a_short_epoch_and_resumes(tmp_path, text_dir, cache_dir, monkeypatch):
    """A corpus with fewer training batches than the validation interval: no crash (the interval counts
    across epochs); the stack is on; --resume continues from last.ckpt."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_gpuopt.callbacks import MFUMonitor, NonFiniteGuard
    from lightning_gpuopt.checkpoint import AtomicCheckpointIO
    from lightning_gpuopt.precision import BF16Precision

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import train_wikitext

    small = tmp_path / "small.txt"
    small.write_text((text_dir / "doc0.txt").read_text()[:6000])
    args = ["--data_dir", str(small), "--d_model", "32", "--num_layers", "1", "--num_heads", "2", "--block_size", "32",
            "--vocab_size", "300", "--batch_size", "4", "--num_workers", "0", "--checkpoint_dir", str(tmp_path / "ckpt"),
            "--val_every", "30", "--checkpoint_every", "10"]
    trainer = train_wikitext.main([*args, "--max_steps", "40"])
    assert trainer.num_training_batches < 30 * trainer.accumulate_grad_batches  # the interval spans epochs
    assert trainer.global_step == 40 and trainer.current_epoch >= 1
    # No --mixed_precision: the stack's choice for the device, bf16 on a GPU and float32 on a CPU.
    assert isinstance(trainer.precision_plugin, BF16Precision) == torch.cuda.is_available()
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    assert {MFUMonitor, NonFiniteGuard, ModelCheckpoint} <= {type(c) for c in trainer.callbacks}
    assert "val/loss" in trainer.callback_metrics  # validated at step 30
    resumed = train_wikitext.main([*args, "--max_steps", "45", "--resume"])
    sys.modules.pop("train_wikitext", None)
    assert resumed.ckpt_path == os.path.realpath(tmp_path / "ckpt" / "last.ckpt")  # continued from step 40
    assert resumed.global_step == 45


def test_rft_recipe_train_generate_score_keep_fine_tune(tmp_path, text_dir, cache_dir, monkeypatch, caplog):
    """The rejection-sampling loop of examples/configs/rft.yaml at a tiny size, through gpuopt: train, generate
    samples per prompt of examples/rft_prompts.jsonl, score them with examples/rft_checker.py, fine-tune on the
    kept ones from the trained weights (a new run: step 0, fresh optimizer; the run's tokenizer)."""
    import json

    import torch

    from lightning_gpuopt.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import rft_checker

    data = ["--data.source", str(text_dir), "--data.vocab_size", "300", "--data.block_size", "32", "--data.num_workers", "0"]
    quiet = ["--trainer.enable_progress_bar", "false", "--trainer.logger", "false"]
    main(["fit", *data, *quiet, "--model.preset", "tiny", "--trainer.max_steps", "3", "--model.warmup_steps", "1",
          "--trainer.limit_val_batches", "0", "--trainer.default_root_dir", "base"])
    base = tmp_path / "base" / "checkpoints" / "last.ckpt"
    main(["predict", *data, "--trainer.enable_progress_bar", "false", "--ckpt_path", str(base),
          "--generate.prompts_file", str(EXAMPLES / "rft_prompts.jsonl"), "--generate.samples_per_prompt", "2",
          "--model.temperature", "0.7", "--model.max_new_tokens", "8", "--generate.stop", '["\\n"]',
          "--generate.scorer", "rft_checker:score", "--generate.keep_min_score", "0",  # keep all: a 3-step model rarely passes
          "--generate.output", "gen/generations.jsonl"])
    lines = [json.loads(line) for line in (tmp_path / "gen" / "generations.jsonl").read_text().splitlines()]
    assert len(lines) == 40 and all("\n" not in r["completion"] for r in lines)
    assert all(r["score"] == rft_checker.score(r, r["completion"]) for r in lines)
    # A prompt that is valid Python alone ("    return ") scores 0 with an empty completion, 1 with a value.
    assert rft_checker.score({"prompt": "    return "}, "") == 0 and rft_checker.score({"prompt": "    return "}, "x") == 1
    assert len((tmp_path / "gen" / "generations.kept.jsonl").read_text().splitlines()) == 40
    with caplog.at_level("INFO"):
        main(["fit", "--config", str(EXAMPLES / "configs" / "rft.yaml"), *quiet, "--model.init_from", str(base),
              "--data.source", "gen/generations.kept.jsonl", "--trainer.max_steps", "2", "--model.learning_rate", "1e-9",
              "--model.warmup_steps", "1", "--model.dropout", "0.0", "--trainer.default_root_dir", "tuned"])
    assert f"model.init_from: the GPT starts from the weights of {base} (step 3 of its run)" in caplog.text
    tuned = torch.load(tmp_path / "tuned" / "checkpoints" / "last.ckpt", weights_only=True)
    before = torch.load(base, weights_only=True)
    assert tuned["global_step"] == 2  # a new run, not step 3 + 2
    assert tuned["hyper_parameters"]["block_size"] == 32 and tuned["hyper_parameters"]["vocab_size"] == before["hyper_parameters"]["vocab_size"]
    for key, weight in before["state_dict"].items():  # lr 1e-9: the fine-tuned weights are the trained ones
        torch.testing.assert_close(tuned["state_dict"][key], weight, atol=1e-6, rtol=0)
    assert tuned["TextDataModule"]["tokenizer_sha256"] == before["TextDataModule"]["tokenizer_sha256"]
    sys.modules.pop("rft_checker", None)
def test_train_wikitext_without_flags_says_what_to_pass_in_one_line(tmp_path, monkeypatch, capsys):
    """No flags and no WikiText-103 on the machine (its default corpus): one line, not a traceback."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import train_wikitext

    with pytest.raises(SystemExit) as info:
        train_wikitext.main([])
    sys.modules.pop("train_wikitext", None)
    message = str(info.value)
    assert "\n" not in message and message.startswith("train_wikitext.py: no --data_dir, and WikiText-103 is not in")
    assert "--data_dir stdlib for the offline corpus" in message and train_wikitext.CPU_COMMAND in message


def test_train_wikitext_prints_little_before_training_and_takes_mixed_precision_alone(tmp_path, text_dir, cache_dir,
                                                                                     monkeypatch, capsys):
    """`--mixed_precision` with no value (as the seed commands wrote it) is the device's choice; no model summary
    table, and no warning about a checkpoint folder the run was not asked for (a warning fails the test)."""
    from lightning_gpuopt.callbacks import ResumedRichProgressBar, ResumedTQDMProgressBar, SigtermCheckpoint

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import train_wikitext

    trainer = train_wikitext.main(
        ["--data_dir", str(text_dir), "--max_steps", "2", "--d_model", "32", "--num_layers", "1", "--num_heads", "2",
         "--block_size", "32", "--vocab_size", "300", "--batch_size", "4", "--num_workers", "0", "--mixed_precision"])
    sys.modules.pop("train_wikitext", None)
    assert trainer.global_step == 2
    out = capsys.readouterr()
    assert out.out.count("GPTModule: ") == 1 and "Modules in train mode" not in out.out + out.err
    assert ("float32 on the CPU" in out.out) != torch.cuda.is_available()
    assert isinstance(trainer.progress_bar_callback, (ResumedRichProgressBar, ResumedTQDMProgressBar))
    assert not any(isinstance(c, SigtermCheckpoint) for c in trainer.callbacks)  # nowhere to save without --checkpoint_dir
