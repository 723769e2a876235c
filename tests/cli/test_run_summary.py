"""What `gpuopt fit` says about a run: a short start, a report whose figures agree, and where things went."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from lightning_gpuopt import GPTModule, TextDataModule
from lightning_gpuopt.cli.main import GPTCLI
from lightning_gpuopt.cli.run_summary import command_with_checkpoint, count_text, model_line, where_things_went
from tests.cli._own_modules import LazyRegressor, Regressor
from tests._paths import REPO

B, T = 2, 16


def _quickstart_args(text_dir, *extra):
    return ["fit", "--config", str(REPO / "examples/configs/quickstart.yaml"), "--data.source", str(text_dir),
            "--data.vocab_size", "300", "--data.num_workers", "0", "--data.block_size", str(T),
            "--data.batch_size", str(B), "--model.n_layer", "2", "--model.n_embd", "32", "--model.n_head", "2",
            "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0", *extra]


def test_quickstart_stack_prints_a_short_start_true_figures_and_where_things_went(text_dir, cache_dir, tmp_path):
    # A real process: what a user's console shows (Lightning's log lines and warnings included).
    TextDataModule(source=str(text_dir), vocab_size=300, block_size=T, batch_size=B, num_workers=0).prepare_data()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "lightning_gpuopt", *_quickstart_args(text_dir, "--trainer.max_steps", "43")],
                          cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]

    start = next(i for i, line in enumerate(lines) if "`Trainer.fit` stopped" in line)
    assert start < 10, "\n".join(lines[:start])
    report = "\n".join(lines)
    assert "2 windows of 20 steps in this fit" in report  # steps 4-23 and 24-43
    tokens_per_s, ms = (float(x.replace(",", "")) for x in re.search(r"([\d,]+) tokens/s \(([\d.]+) ms/step\)", report).groups())
    assert tokens_per_s == pytest.approx(B * T / (ms / 1000), rel=0.02)  # tokens/s is the tokens of a step over its time

    ckpt = "runs/quickstart/checkpoints/last.ckpt"
    assert (tmp_path / ckpt).is_file()
    tail = lines[-5:]
    assert tail[0] == "gpuopt fit: finished at step 43."
    assert tail[1] == f"  checkpoint: {ckpt}"
    assert tail[2] == "  logs:       runs/quickstart/lightning_logs/version_0" and (tmp_path / tail[2].split()[-1]).is_dir()
    assert tail[3].endswith(f"--ckpt_path {ckpt} --trainer.max_steps 86") and tail[3].count("--trainer.max_steps") == 1
    assert tail[4].startswith("  sample:     gpuopt predict --config ") and tail[4].endswith(f"--ckpt_path {ckpt}")


def test_predict_writes_no_log_folder(text_dir, cache_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match="untrained"):
        GPTCLI(GPTModule, TextDataModule, args=[
            "predict", "--data.source", str(text_dir), "--data.vocab_size", "300", "--data.num_workers", "0",
            "--data.prompts", "[the model]", "--model.max_new_tokens", "2", "--trainer.default_root_dir", "run"])
    assert not (tmp_path / "run").exists() and not (tmp_path / "lightning_logs").exists()


def test_printed_commands_replace_the_options_they_set():
    argv = ["fit", "--config", "q.yaml", "--ckpt_path=last", "--trainer.max_steps", "30", "--x", "a b"]
    assert command_with_checkpoint(argv, "fit", "c/last.ckpt", ("--trainer.max_steps", "60")) == (
        "gpuopt fit --config q.yaml --x 'a b' --ckpt_path c/last.ckpt --trainer.max_steps 60"
    )
    assert command_with_checkpoint(argv, "predict", "c/last.ckpt") == (
        "gpuopt predict --config q.yaml --trainer.max_steps 30 --x 'a b' --ckpt_path c/last.ckpt"
    )
    assert command_with_checkpoint(argv, "predict", "c/last.ckpt", env={"PYTHONPATH": "ex amples"}) == (
        "PYTHONPATH='ex amples' gpuopt predict --config q.yaml --trainer.max_steps 30 --x 'a b' --ckpt_path c/last.ckpt"
    )


def test_parameter_counts_read_as_people_write_them():
    assert [count_text(n) for n in (577, 2177, 12345, 999_999, 3_400_000, 1_500_000_000)] == [
        "577", "2,177", "12.3K", "1M", "3.4M", "1.5B"]
    assert model_line(Regressor()) == "Regressor: 289 parameters"  # 16*16 + 16 + 16 + 1
    frozen = Regressor()
    frozen.net[0].requires_grad_(False)
    assert model_line(frozen) == "Regressor: 289 parameters (17 trainable, 272 frozen)"
    assert model_line(LazyRegressor()).startswith("LazyRegressor: parameters built in configure_model")
    # GPTModule builds its GPT in configure_model too: counted from its config (the README's table: 141,056).
    from lightning_gpuopt import GPTModule

    assert model_line(GPTModule(preset="tiny")) == "GPTModule: 141K parameters (2 layers, width 64, 4 heads, context 128, vocabulary 512)"


def test_the_train_on_command_goes_past_where_the_run_ended(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "last.ckpt").write_bytes(b"")
    saved = SimpleNamespace(last_model_path=str(tmp_path / "last.ckpt"))
    past_steps = SimpleNamespace(max_steps=4, max_epochs=-1, global_step=8, current_epoch=0, checkpoint_callback=saved, logger=None)
    lines = where_things_went(past_steps, ["fit", "--trainer.max_steps", "4"], can_predict=False)
    assert lines[2] == "  train on to step 16: gpuopt fit --ckpt_path last.ckpt --trainer.max_steps 16" and len(lines) == 3
    epochs = SimpleNamespace(max_steps=-1, max_epochs=1, global_step=4, current_epoch=1, checkpoint_callback=saved, logger=None)
    lines = where_things_went(epochs, ["fit", "--trainer.max_epochs", "1"])
    assert lines[2:] == ["  train on to epoch 2: gpuopt fit --ckpt_path last.ckpt --trainer.max_epochs 2",
                         "  sample:     gpuopt predict --trainer.max_epochs 1 --ckpt_path last.ckpt"]
