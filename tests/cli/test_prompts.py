"""Prompts files -> equal-length batches -> JSONL records, with a real GPT."""

import json
import os
import signal

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_gpuopt.model import GPT, GPTConfig
from lightning_gpuopt.cli.main import main
from lightning_gpuopt.cli.prompts import PromptBatches, read_prompts, write_completions


def _encode(text):
    return [ord(c) % 64 for c in text]


def test_read_prompts_text_and_jsonl(tmp_path):
    (tmp_path / "p.txt").write_text("def main(\n\nclass A:\\n    x\n")
    assert read_prompts(tmp_path / "p.txt") == ["def main(", "class A:\n    x"]
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a\nb"}) + "\n")
    assert read_prompts(tmp_path / "p.jsonl") == ["a\nb"]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    with pytest.raises(ValueError, match='needs a "prompt" string'):
        read_prompts(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="generate.prompts_file"):
        read_prompts(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no prompt"):
        read_prompts(tmp_path / "empty.txt")


def test_batches_group_equal_lengths_and_keep_prompt_order():
    prompts = ["abc", "de", "fgh", "ij"]
    batches = PromptBatches.build(prompts, _encode, samples_per_prompt=3, batch_size=4)
    for batch in batches.batches:
        assert len(batch) <= 4 and len({len(ids) for _, _, ids in batch}) == 1
    assert sum(len(b) for b in batches.batches) == 12
    assert [len(b) for b in batches.batches] == [4, 2, 4, 2]  # 6 rows of length 2, then 6 of length 3
    tensors = batches.tensors()
    outputs = [torch.cat([t, torch.full((t.size(0), 2), 7)], dim=1) for t in tensors]
    records = batches.completions(outputs, lambda ids: "x" * len(ids))
    assert [(r["prompt"], r["sample"]) for r in records] == [(p, s) for p in prompts for s in range(3)]
    assert all(r["tokens"] == [7, 7] and r["completion"] == "xx" for r in records)


def test_batched_greedy_generation_equals_one_prompt_at_a_time(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=32)).eval()
    prompts = ["abc", "xyz", "hello", "world", "abc"]
    batches = PromptBatches.build(prompts, _encode, samples_per_prompt=1, batch_size=8)
    outputs = [model.generate(t, 6, temperature=0) for t in batches.tensors()]
    records = batches.completions(outputs, lambda ids: "")
    for record in records:
        alone = model.generate(torch.tensor([_encode(record["prompt"])]), 6, temperature=0)[0, len(record["prompt"]):]
        assert record["tokens"] == alone.tolist()
    path = write_completions(records, tmp_path / "out" / "g.jsonl")
    assert [json.loads(line)["prompt"] for line in path.read_text().splitlines()] == prompts


def test_write_completions_to_a_folder_is_refused_and_leaves_no_file(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    with pytest.raises(ValueError, match=r"generate.output=.*out' is a folder: give a file path"):
        write_completions([{"prompt": "a", "completion": " b", "tokens": [7]}], folder)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["out"]  # no temporary file beside it


class SigtermAtFirstPredictBatch(Callback):
    """Sends this process a SIGTERM as the first prediction batch starts (a scheduler stopping the job)."""

    finished_batches = 0

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_predict_batch_end(self, *args):
        SigtermAtFirstPredictBatch.finished_batches += 1


def test_sigterm_stops_predict_after_the_batch_and_writes_nothing(tmp_path, text_dir, cache_dir, monkeypatch):
    """Lightning's predict loop never read its SIGTERM flag: the job ran on through every prompt. It now stops
    during the batch it is generating (a batch of long generations can take minutes)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.txt").write_text("the model\nthe optimizer lowers\nstep by step on the\n")
    with pytest.raises(SystemExit) as info, pytest.warns(UserWarning, match="samples an untrained"):
        main(["predict", "--data.source", str(text_dir), "--data.vocab_size", "300", "--data.block_size", "32",
              "--data.num_workers", "0", "--model.preset", "tiny", "--model.max_new_tokens", "2",
              "--trainer.enable_progress_bar", "false", "--generate.prompts_file", str(tmp_path / "p.txt"),
              "--generate.batch_size", "1", "--generate.output", str(tmp_path / "g.jsonl"),
              "--trainer.callbacks+=tests.cli.test_prompts.SigtermAtFirstPredictBatch"])
    assert info.value.code == 143
    assert SigtermAtFirstPredictBatch.finished_batches == 0  # stopped inside the first batch, not after it
    assert not (tmp_path / "g.jsonl").exists()
    assert not list(tmp_path.rglob("*.ckpt"))  # no checkpoint of the predicting state (it would replace a run's last.ckpt)
    handler = signal.getsignal(signal.SIGTERM)
    assert type(getattr(handler, "__self__", None)).__name__ != "_StopPredictOnSigterm"  # its handler is put back


class SigtermAtFirstValidationBatch(Callback):
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0 and not trainer.sanity_checking:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_during_validate_leaves_the_runs_last_ckpt_alone(tmp_path, text_dir, cache_dir, monkeypatch):
    """SigtermCheckpoint, always added by gpuopt, saved the validating state (step 0, no optimizer state) over the
    checkpoint being validated; outside fit it is left out."""
    monkeypatch.chdir(tmp_path)
    data = ["--data.source", str(text_dir), "--data.vocab_size", "300", "--data.block_size", "32", "--data.num_workers", "0",
            "--model.preset", "tiny", "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / "run")]
    main(["fit", *data, "--trainer.max_steps", "2", "--model.warmup_steps", "1", "--trainer.logger", "false",
          "--trainer.limit_val_batches", "0"])
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    with pytest.raises(SystemExit) as info:
        main(["validate", *data, "--ckpt_path", str(last), "--trainer.callbacks+=tests.cli.test_prompts.SigtermAtFirstValidationBatch"])
    assert info.value.code == 143
    assert last.read_bytes() == before
