"""benchmarks.generation runs the three configurations on the same rows and reports consistent numbers (tiny size, CPU)."""

import json

import pytest
import torch

from benchmarks.generation import DEFAULT_CONFIGS as CONFIGS, _arguments, _workload, main, run_config


def test_generation_benchmark_reports_every_configuration(tmp_path):
    threads = torch.get_num_threads()
    report = main(["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--vocab-size", "300", "--block-size", "32",
                   "--prompts", "4", "--samples", "2", "--min-len", "2", "--max-len", "8", "--new-tokens", "8",
                   "--answer-len", "3", "--batch-size", "4", "--repeats", "1", "--threads", "1", "--out", str(tmp_path)])
    assert torch.get_num_threads() == threads  # put back
    rows = {r["config"]: r for r in report["results"]}
    assert list(rows) == list(CONFIGS) and report["rows"] == 8
    assert all(r["answer_tokens_per_sec"] > 0 and 0 < r["mean_answer_tokens"] <= 8 for r in rows.values())
    assert rows["sequential"]["speedup"] == 1.0 and rows["continuous"]["batch"] == 4 and rows["sequential"]["batch"] == 1
    assert json.loads((tmp_path / "generation.json").read_text())["results"] == report["results"]
    assert "| `continuous` | 4 |" in (tmp_path / "generation.md").read_text()


def test_an_out_folder_that_cannot_be_written_is_refused_before_the_runs(tmp_path, monkeypatch):
    import benchmarks.generation as generation

    monkeypatch.setattr(generation, "run_config", lambda *a, **k: pytest.fail("ran before --out was checked"))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match=r"--out='.*a-file/out' cannot be written \(Not a directory"):
        main(["--n-layer", "1", "--n-embd", "16", "--n-head", "1", "--vocab-size", "64", "--block-size", "16",
              "--prompts", "2", "--max-len", "4", "--new-tokens", "4", "--repeats", "1", "--out", str(tmp_path / "a-file" / "out")])


def test_configurations_answer_alike_and_answers_end_early():
    """Greedy, the three configurations give every row the same answer, cut at its end-of-text; the raised
    end-of-text logit ends answers before --new-tokens."""
    args = _arguments(["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--vocab-size", "300", "--block-size", "48",
                       "--prompts", "6", "--samples", "1", "--min-len", "2", "--max-len", "16", "--new-tokens", "24",
                       "--answer-len", "4", "--temperature", "1.0"])
    model, rows, _ = _workload(args, torch.device("cpu"))
    answers = {name: run_config(name, model, rows, 24, 4, 0.0, 50, None)[1] for name in CONFIGS}
    assert answers["sequential"] == answers["grouped"] == answers["continuous"]
    sampled = run_config("continuous", model, rows * 8, 24, 16, 1.0, 50, None)[1]
    assert sum(len(a) for a in sampled) / len(sampled) < 12  # most answers end well before 24 tokens


def test_results_go_to_the_current_folder_not_over_the_recorded_ones(tmp_path, monkeypatch):
    from tests._paths import REPO

    recorded = (REPO / "benchmarks/results/cpu/generation.json").read_bytes()
    monkeypatch.chdir(tmp_path)
    main(["--n-layer", "1", "--n-embd", "16", "--n-head", "1", "--vocab-size", "64", "--block-size", "16",
          "--prompts", "2", "--samples", "1", "--min-len", "2", "--max-len", "4", "--new-tokens", "2", "--batch-size", "2",
          "--repeats", "1", "--configs", "continuous"])
    assert sorted(p.name for p in (tmp_path / "benchmark-results" / "cpu").iterdir()) == ["generation.json", "generation.md"]
    assert (REPO / "benchmarks/results/cpu/generation.json").read_bytes() == recorded
    written = json.loads((tmp_path / "benchmark-results/cpu/generation.json").read_text())
    assert written["machine"]["cores"] >= 1 and written["machine"]["cpu"]  # a figure says the machine it ran on
    assert f"{written['machine']['cores']} cores" in (tmp_path / "benchmark-results/cpu/generation.md").read_text()


def test_transformers_generate_on_the_same_weights_answers_as_continuous_batching():
    """Greedy, without the end-of-text bias: transformers' batched generate (left-padded, mixed lengths) on the weights
    write_hf_folder exported gives every row the answer continuous batching gives."""
    pytest.importorskip("transformers", reason="the peer configuration needs transformers (the dev extra)")
    from benchmarks.generation import _EndsEarly, hf_peer

    args = _arguments(["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--vocab-size", "300", "--block-size", "48",
                       "--prompts", "6", "--samples", "1", "--min-len", "2", "--max-len", "16", "--new-tokens", "12"])
    model, rows, _ = _workload(args, torch.device("cpu"))
    plain = _EndsEarly(model.gpt, model.eot, 0.0)
    peer = hf_peer(plain)
    ours = run_config("continuous", plain, rows, 12, 4, 0.0, 50, None)[1]
    theirs = run_config("transformers", plain, rows, 12, 4, 0.0, 50, None, peer=peer)[1]
    assert theirs == ours and sum(map(len, ours)) > 6 * 6  # answers, not ended at once
