"""Prompts files -> requests -> completions written as they finish, scored and kept; the bar; through gpuopt predict."""

import io
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_gpuopt.cli.completions import CompletionWriter, kept_path
from lightning_gpuopt.cli.generation_progress import GenerationProgress, format_seconds
from lightning_gpuopt.cli.main import main
from lightning_gpuopt.cli.prompts import check_scorer, load_scorer, plan_requests, read_prompts
from lightning_gpuopt.model import load_gpt
from lightning_gpuopt.generation.batched import Finished
from tests._paths import REPO


calls = {"n": 0}  # the test scorers' calls in this process


def _encode(text):
    return [ord(c) % 64 for c in text]


def test_read_prompts_text_and_jsonl(tmp_path):
    (tmp_path / "p.txt").write_text("def main(\n\nclass A:\\n    x\n")
    assert read_prompts(tmp_path / "p.txt") == [{"prompt": "def main("}, {"prompt": "class A:\n    x"}]
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a\nb", "answer": "5"}) + "\n")
    assert read_prompts(tmp_path / "p.jsonl") == [{"prompt": "a\nb", "answer": "5"}]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    with pytest.raises(ValueError, match=r'bad.jsonl, line 1: each JSONL line needs a "prompt" string'):
        read_prompts(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="generate.prompts_file"):
        read_prompts(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no prompt"):
        read_prompts(tmp_path / "empty.txt")


def test_a_broken_json_line_is_named_by_its_line_in_the_file(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": "b", }\n{"prompt": "c"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl, line 3: not valid JSON \(Expecting property name enclosed in double quotes "
                                         r"at column 17\): fix that line"):
        read_prompts(tmp_path / "p.jsonl")


def test_a_prompts_file_not_in_utf8_is_named_with_the_fix(tmp_path):
    (tmp_path / "p.txt").write_bytes("first\nsecond caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"generate.prompts_file=.*p.txt' is not UTF-8 text \(byte 0xe9 on line 2 cannot be "
                                         r"decoded\): save it as UTF-8, e.g. iconv -f latin1 -t utf-8 p.txt > p.utf8.txt"):
        read_prompts(tmp_path / "p.txt")


def test_plan_requests_keys_samples_and_cuts_long_prompts():
    records = [{"prompt": "abc"}, {"prompt": "x" * 30}]
    requests, cut = plan_requests(records, _encode, samples_per_prompt=2, max_new_tokens=8, block_size=24)
    assert [r.key for r in requests] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [len(r.ids) for r in requests] == [3, 3, 16, 16] and cut == 1  # 24 - 8 tokens left for the prompt
    assert all(r.max_new_tokens == 8 for r in requests)
    with pytest.raises(ValueError, match="Prompt 1 \\(''\\) has no tokens"):
        plan_requests([{"prompt": ""}], _encode, 1, 8, 24)


def accept_long(record, completion):
    """A scorer for the tests: completions of at least 3 characters."""
    return len(completion) >= 3


def raise_always(record, completion):
    raise KeyError("answer")


def words(record, completion):
    return "many"


def test_scorer_loading_and_checking_errors_name_the_fix():
    assert load_scorer("tests.cli.test_prompts:accept_long") is accept_long
    with pytest.raises(ValueError, match=r"generate.scorer='no_such_module:f': cannot import no_such_module .*PYTHONPATH=."):
        load_scorer("no_such_module:f")
    with pytest.raises(ValueError, match=r"tests.cli.test_prompts has no function 'nope' \(it has \[.*'accept_long'"):
        load_scorer("tests.cli.test_prompts:nope")
    with pytest.raises(ValueError, match="must name a function as module:function, e.g. my_checks:score"):
        load_scorer("tests.cli.test_prompts")
    with pytest.raises(ValueError, match=r"raised KeyError: 'answer' for the prompt 'q' and the completion '': make it return a number"):
        check_scorer(raise_always, "m:raise_always", {"prompt": "q"})
    with pytest.raises(ValueError, match=r"returned 'many' \(str\) for the prompt 'q': it must return a finite number or a bool"):
        check_scorer(words, "m:words", {"prompt": "q"})


def test_writer_sorts_cuts_scores_and_keeps(tmp_path):
    records = [{"prompt": "p0", "answer": "x"}, {"prompt": "p1"}]
    decode = lambda ids: "".join(chr(96 + i) for i in ids)  # noqa: E731
    writer = CompletionWriter(records, decode, tmp_path / "g.jsonl", scorer=accept_long, scorer_spec="t:accept_long",
                              stop_strings=["zz"])
    with writer:
        writer.add(Finished((1, 0), [1, 2, 3, 26, 26, 4], "length"))  # "abczzd": cut at the stop string
        writer.add(Finished((0, 1), [1], "eot"))
        writer.add(Finished((0, 0), [1, 2, 3, 4], "stop"))
        assert (tmp_path / "g.jsonl.partial").read_text().count("\n") == 3  # on disk as each finished
    lines = [json.loads(line) for line in (tmp_path / "g.jsonl").read_text().splitlines()]
    assert [(r["index"], r["sample"], r["completion"], r["finish"], r["score"]) for r in lines] == [
        (0, 0, "abcd", "stop", 1.0), (0, 1, "a", "eot", 0.0), (1, 0, "abc", "length", 1.0)]
    assert lines[0]["answer"] == "x" and lines[0]["tokens"] == [1, 2, 3, 4]
    kept = [json.loads(line) for line in kept_path(tmp_path / "g.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["completion"]) for r in kept] == [("p0", "abcd"), ("p1", "abc")]
    assert not list(tmp_path.glob("*.partial"))
    assert writer.summary(3, 4.0) == (f"3 completions (11 tokens: 1 at end-of-text, 1 at max_new_tokens, 1 at a stop sequence) in "
                                      f"4.0 s, 3 tokens/s; written to {tmp_path / 'g.jsonl'}; kept 2 with score >= 1 in "
                                      f"{tmp_path / 'g.kept.jsonl'}")


def test_writer_keeps_what_finished_when_the_run_stops(tmp_path):
    writer = CompletionWriter([{"prompt": "p"}], lambda ids: "x" * len(ids), tmp_path / "g.jsonl")
    with pytest.raises(SystemExit), writer:
        writer.add(Finished((0, 1), [5, 5], "length"))
        raise SystemExit(143)
    assert [json.loads(line)["sample"] for line in (tmp_path / "g.jsonl").read_text().splitlines()] == [1]
    assert not (tmp_path / "g.jsonl.partial").exists()
    empty = CompletionWriter([{"prompt": "p"}], str, tmp_path / "none.jsonl")
    with pytest.raises(SystemExit), empty:
        raise SystemExit(143)
    assert not list(tmp_path.glob("none.jsonl*"))  # nothing finished: nothing written


def test_a_completion_the_scorer_fails_on_is_kept_without_a_score(tmp_path):
    """A scorer that returns NaN (or raises) for one completion stops the run with its error once the rows that
    finished in the same step are written (scored where it can); the one it failed on is written without a score,
    and the summary never says a file was written when none was."""
    def nan_for_long(record, completion):
        return float("nan") if len(completion) > 2 else 1

    writer = CompletionWriter([{"prompt": "p"}], lambda ids: "x" * len(ids), tmp_path / "g.jsonl", scorer=nan_for_long,
                              scorer_spec="m:nan_for_long")
    with pytest.raises(ValueError, match="returned nan"), writer:
        writer.add(Finished((0, 0), [5], "eot"))
        writer.check()
        writer.add(Finished((0, 1), [5, 5, 5], "length"))
        writer.add(Finished((0, 2), [5, 5], "eot"))  # finished in the same step: written and scored
        writer.add(Finished((0, 3), [5, 5, 5, 5], "length"))
        writer.check()
    lines = [json.loads(line) for line in (tmp_path / "g.jsonl").read_text().splitlines()]
    assert [(r["sample"], r.get("score")) for r in lines] == [(0, 1.0), (1, None), (2, 1.0), (3, None)]
    assert [json.loads(line)["sample"] for line in kept_path(tmp_path / "g.jsonl").read_text().splitlines()] == [0, 2]
    assert writer.summary(5, 1.0).endswith(f"written to {tmp_path / 'g.jsonl'}; kept 2 with score >= 1 in {tmp_path / 'g.kept.jsonl'}")
    nothing = CompletionWriter([{"prompt": "p"}], str, tmp_path / "none.jsonl", scorer=nan_for_long, scorer_spec="m:f")
    assert nothing.summary(3, 1.0) == "0 of 3 completions (0 tokens) in 1.0 s, 0 tokens/s; nothing written"


def test_progress_bar_counts_completions_tokens_and_time_left():
    now = [0.0]
    stream = io.StringIO()
    bar = GenerationProgress(10, stream=stream, log_every=5.0, clock=lambda: now[0])
    now[0] = 2.0
    bar.step(400)
    bar.finished(4)
    assert stream.getvalue() == ""  # not a terminal: a line every 5 s
    now[0] = 6.0
    bar.step(200)
    assert stream.getvalue() == "generating 4/10 completions | 100 tokens/s | ETA 9 s\n"
    assert format_seconds(3725) == "1:02:05" and format_seconds(125) == "2:05"


def _data_args(text_dir, *extra):
    return ["--data.source", str(text_dir), "--data.vocab_size", "300", "--data.block_size", "32", "--data.num_workers", "0",
            "--model.preset", "tiny", "--trainer.enable_progress_bar", "false", *extra]


@pytest.fixture
def trained(tmp_path, text_dir, cache_dir):
    """A checkpoint of a 2-step fit of the tiny GPT on the test corpus."""
    main(["fit", *_data_args(text_dir), "--trainer.max_steps", "2", "--model.warmup_steps", "1", "--trainer.logger", "false",
          "--trainer.limit_val_batches", "0", "--trainer.default_root_dir", str(tmp_path / "run")])
    return tmp_path / "run" / "checkpoints" / "last.ckpt"


def test_predict_mixed_lengths_greedy_as_alone_with_stops_scores_and_kept(trained, tmp_path, text_dir, caplog):
    """Prompts of different token lengths share a batch through gpuopt predict: greedy completions equal GPT.generate
    on each prompt alone (cut at the stop string), the score is written and the accepted ones are kept."""
    from lightning_gpuopt import TextDataModule

    prompts = ["the model", "the optimizer lowers the loss step", "step", "learns to predict the next token of every"]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": i}) + "\n" for i, p in enumerate(prompts)))
    with caplog.at_level("INFO"):
        main(["predict", *_data_args(text_dir), "--ckpt_path", str(trained), "--model.max_new_tokens", "6", "--model.temperature",
              "0", "--generate.prompts_file", str(tmp_path / "p.jsonl"), "--generate.samples_per_prompt", "2", "--generate.batch_size",
              "3", "--generate.output", str(tmp_path / "g.jsonl"), "--generate.stop", '["the"]',
              "--generate.scorer", "tests.cli.test_prompts:accept_long"])
    assert "gpuopt predict: 8 completions (" in caplog.text and "; kept " in caplog.text
    assert "1 of 4 prompts are longer than the 26 tokens that block_size=32 leaves beside model.max_new_tokens=6" in caplog.text
    lines = [json.loads(line) for line in (tmp_path / "g.jsonl").read_text().splitlines()]
    assert [(r["index"], r["sample"]) for r in lines] == [(p, s) for p in range(4) for s in range(2)]
    gpt = load_gpt(trained)
    data = TextDataModule(source=str(text_dir), vocab_size=300, block_size=32, num_workers=0)
    for r in lines:
        ids = data.encode(r["prompt"])[-26:]  # the long prompt keeps its last 26 tokens
        alone = gpt.generate(torch.tensor([ids]), 6, temperature=0)[0, len(ids):].tolist()
        text = data.decode(alone)
        assert r["completion"] == text.split("the")[0] and r["answer"] == r["index"]
        assert r["score"] == float(len(r["completion"]) >= 3)
    kept = [json.loads(line) for line in (tmp_path / "g.kept.jsonl").read_text().splitlines()]
    assert [(k["index"], k["sample"]) for k in kept] == [(r["index"], r["sample"]) for r in lines if r["score"] == 1.0]


def zero_unless_optimizer(record, completion):
    if "optimizer" in record["prompt"]:
        raise KeyError("answer")
    return 0


def test_a_scorer_failing_mid_run_keeps_every_completion_finished_in_that_step(tmp_path, text_dir, cache_dir, capsys):
    """Rows that finish in one step are handed over one by one: the scorer's failure on one of them stops the run
    after all of them are written (the failed one without a score), with the scorer's error and exit 2."""
    (tmp_path / "p.txt").write_text("the model\nthe optimizer lowers\nstep by step on the\n")
    with pytest.raises(SystemExit) as info, pytest.warns(UserWarning, match="samples an untrained"):
        main(["predict", *_data_args(text_dir), "--model.max_new_tokens", "1", "--generate.prompts_file", str(tmp_path / "p.txt"),
              "--generate.batch_size", "4", "--generate.output", str(tmp_path / "g.jsonl"),
              "--generate.scorer", "tests.cli.test_prompts:zero_unless_optimizer", "--generate.keep_min_score", "0"])
    assert info.value.code == 2
    assert "generate.scorer='tests.cli.test_prompts:zero_unless_optimizer' raised KeyError" in capsys.readouterr().err
    lines = [json.loads(line) for line in (tmp_path / "g.jsonl").read_text().splitlines()]
    assert [(r["index"], r.get("score")) for r in lines] == [(0, 0.0), (1, None), (2, 0.0)]  # one prefill: one step
    assert [json.loads(line)["index"] for line in (tmp_path / "g.kept.jsonl").read_text().splitlines()] == [0, 2]
    assert not list(tmp_path.glob("*.partial"))


def test_a_partial_file_left_by_a_kill_is_not_emptied_by_the_next_run(tmp_path, text_dir, cache_dir, capsys):
    """A leftover .partial (its lock free: the writer is gone) is refused in 3 lines or fewer, kept, and replaced with
    --generate.overwrite; the lock file a kill -9 left names the dead writer."""
    (tmp_path / "p.txt").write_text("the model\n")
    partial = tmp_path / "g.jsonl.partial"
    partial.write_text('{"index": 0, "sample": 0, "completion": "kept"}\n{"index": 1, "sample": 0, "completion": "too"}\n')
    (tmp_path / ".g.jsonl.lock").write_text("gpuopt predict (pid 4242 on node-7, since 2026-01-01 00:00:00)\n")
    args = ["predict", *_data_args(text_dir), "--model.max_new_tokens", "2", "--generate.prompts_file", str(tmp_path / "p.txt"),
            "--generate.output", str(tmp_path / "g.jsonl")]
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert (f"{partial} holds 2 completions of gpuopt predict (pid 4242 on node-7, since 2026-01-01 00:00:00), which ended "
            "before it wrote g.jsonl (killed: its lock is free), and this run would start by emptying it: keep them "
            f"(mv {partial} {tmp_path / 'g.killed.jsonl'};") in err.replace("\n", " ")  # kept beside it, not in the cwd
    assert "or give --generate.overwrite true to replace it." in err and len(err.strip().splitlines()) <= 3
    assert partial.read_text().count("\n") == 2 and not (tmp_path / "g.jsonl").exists()
    assert not (tmp_path / ".g.jsonl.lock").exists()  # a refused run lets go of the output and removes its lock file
    with pytest.warns(UserWarning, match="samples an untrained"):
        main([*args, "--generate.overwrite", "true"])
    assert not partial.exists() and len((tmp_path / "g.jsonl").read_text().splitlines()) == 1
    assert not (tmp_path / ".g.jsonl.lock").exists()


def test_an_empty_partial_left_behind_is_removed_quietly(tmp_path, text_dir, cache_dir, capsys):
    """A run stopped before any completion finished (a SIGTERM while the checkpoint loaded) left an empty .partial."""
    (tmp_path / "p.txt").write_text("the model\n")
    (tmp_path / "g.jsonl.partial").write_text("")
    with pytest.warns(UserWarning, match="samples an untrained"):
        main(["predict", *_data_args(text_dir), "--model.max_new_tokens", "2", "--generate.prompts_file",
              str(tmp_path / "p.txt"), "--generate.output", str(tmp_path / "g.jsonl")])
    assert "partial" not in capsys.readouterr().err
    assert len((tmp_path / "g.jsonl").read_text().splitlines()) == 1 and not list(tmp_path.glob("*.partial"))


def wait_at_second_completion(record, completion):
    """A scorer that, scoring the second completion (call 1 is the check), says so in a file and waits for a gate."""
    calls["n"] += 1
    if calls["n"] == 3:
        Path(os.environ["GPUOPT_TEST_STARTED"]).write_text("scoring the second completion\n")
        deadline = time.monotonic() + 240
        while not Path(os.environ["GPUOPT_TEST_GATE"]).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return 1


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file locks")
def test_a_second_predict_on_a_live_output_is_refused_with_its_pid_and_the_first_finishes(
        trained, tmp_path, text_dir, cache_dir, capsys):
    """Two real processes on one output: the second, even with --generate.overwrite, is refused naming the first's pid
    and touches nothing; the first then writes every completion."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"the model {i}\n" for i in range(6)))
    output, started, gate = tmp_path / "g.jsonl", tmp_path / "started", tmp_path / "gate"
    args = ["predict", *_data_args(text_dir), "--ckpt_path", str(trained), "--model.max_new_tokens", "2",
            "--generate.prompts_file", str(prompts), "--generate.batch_size", "1", "--generate.output", str(output)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "GPUOPT_TEST_STARTED": str(started),
           "GPUOPT_TEST_GATE": str(gate)}
    first = subprocess.Popen([sys.executable, "-m", "lightning_gpuopt", *args,
                              "--generate.scorer", "tests.cli.test_prompts:wait_at_second_completion"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not started.exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()[-4000:]
            time.sleep(0.1)
        partial = tmp_path / "g.jsonl.partial"
        before = partial.read_bytes()
        assert before.count(b"\n") == 1  # the first completion, written as it finished
        for extra in ([], ["--generate.overwrite", "true"]):
            with pytest.raises(SystemExit) as info:
                main([*args, *extra])
            assert info.value.code == 2
            err = capsys.readouterr().err
            assert f"{output} is being written by another gpuopt predict (pid {first.pid} on " in err
            assert f"or stop it (kill {first.pid}), or give this run another --generate.output" in err
            assert "overwriting never replaces a file a live run writes" in err
            assert "killed" not in err and len(err.strip().splitlines()) <= 3
            assert partial.read_bytes() == before and not output.exists()  # the live run's file, untouched
    finally:
        gate.write_text("")
        _, err = first.communicate(timeout=240)
    assert first.returncode == 0, err[-4000:]
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["index"] for r in lines] == list(range(6)) and all(r["score"] == 1 for r in lines)
    assert not list(tmp_path.glob("*.partial")) and not list(tmp_path.glob(".g.jsonl*"))


def test_predict_restores_no_checkpoint_callback(trained, tmp_path, text_dir, monkeypatch):
    """predict saves nothing: a ModelCheckpoint restored from the file only warned that its folder had moved."""
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*dirpath has changed")
        main(["predict", *_data_args(text_dir), "--ckpt_path", str(trained), "--data.prompts", "[the model]",
              "--model.max_new_tokens", "2"])


def sigterm_at_third_completion(record, completion):
    """A scorer that sends this process a SIGTERM while the third completion is scored (call 1 is the check)."""
    calls["n"] += 1
    if calls["n"] == 4:
        os.kill(os.getpid(), signal.SIGTERM)
    return 1


def test_sigterm_keeps_the_completions_that_finished(tmp_path, text_dir, cache_dir, caplog):
    calls["n"] = 0
    (tmp_path / "p.txt").write_text("the model\nthe optimizer lowers\nstep by step on the\n")
    with pytest.raises(SystemExit) as info, pytest.warns(UserWarning, match="samples an untrained"), caplog.at_level("INFO"):
        main(["predict", *_data_args(text_dir), "--model.max_new_tokens", "3", "--generate.prompts_file", str(tmp_path / "p.txt"),
              "--generate.samples_per_prompt", "2", "--generate.batch_size", "1", "--generate.output", str(tmp_path / "g.jsonl"),
              "--generate.scorer", "tests.cli.test_prompts:sigterm_at_third_completion"])
    assert info.value.code == 143
    lines = [json.loads(line) for line in (tmp_path / "g.jsonl").read_text().splitlines()]
    # batch of 1: in order; the completion being scored when the SIGTERM came is written and scored, then it stops
    assert [(r["index"], r["sample"]) for r in lines] == [(0, 0), (0, 1), (1, 0)]
    assert [json.loads(line)["sample"] for line in (tmp_path / "g.kept.jsonl").read_text().splitlines()] == [0, 1, 0]
    assert not list(tmp_path.glob("*.partial"))
    assert "gpuopt predict: stopped early: 3 of 6 completions" in caplog.text
    assert calls["n"] == 4  # nothing scored after the SIGTERM's step
    handler = signal.getsignal(signal.SIGTERM)
    assert type(getattr(handler, "__self__", None)).__name__ != "_StopPredictOnSigterm"  # its handler is put back


class SigtermAtFirstPredictBatch(Callback):
    """Sends this process a SIGTERM as the first prediction batch starts (a scheduler stopping the job)."""

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_before_any_completion_writes_nothing(tmp_path, text_dir, cache_dir, monkeypatch):
    """Lightning's predict loop never read its SIGTERM flag: the job ran on through every prompt. It now stops at once."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.txt").write_text("the model\n")
    with pytest.raises(SystemExit) as info, pytest.warns(UserWarning, match="samples an untrained"):
        main(["predict", *_data_args(text_dir), "--model.max_new_tokens", "2", "--generate.prompts_file", str(tmp_path / "p.txt"),
              "--generate.output", str(tmp_path / "g.jsonl"),
              "--trainer.callbacks+=tests.cli.test_prompts.SigtermAtFirstPredictBatch"])
    assert info.value.code == 143
    assert not list(tmp_path.glob("g.jsonl*"))
    assert not list(tmp_path.rglob("*.ckpt"))  # no checkpoint of the predicting state (it would replace a run's last.ckpt)


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
