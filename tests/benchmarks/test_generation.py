"""benchmarks.generation runs every configuration and reports consistent numbers (tiny size, CPU)."""

import json

from benchmarks.generation import CONFIGS, main


def test_generation_benchmark_reports_every_configuration(tmp_path):
    report = main(["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--vocab-size", "300", "--block-size", "32",
                   "--prompts", "4", "--prompt-len", "4", "--new-tokens", "4", "--batch-size", "4", "--repeats", "1",
                   "--out", str(tmp_path)])
    rows = {r["config"]: r for r in report["results"]}
    assert list(rows) == list(CONFIGS)
    assert all(r["tokens_per_sec"] > 0 for r in rows.values())
    assert rows["seq-fp32"]["speedup"] == 1.0 and rows["batched-bf16"]["batch"] == 4
    assert rows["batched-bf16"]["dtype"] == "bf16" and not rows["seq-fp32-nocache"]["kv_cache"]
    assert json.loads((tmp_path / "generation.json").read_text())["results"] == report["results"]
    assert "| `batched-bf16` | 4 | bf16 | yes |" in (tmp_path / "generation.md").read_text()


def test_results_go_to_the_current_folder_not_over_the_recorded_ones(tmp_path, monkeypatch):
    from tests._paths import REPO

    recorded = (REPO / "benchmarks/results/cpu/generation.json").read_bytes()
    monkeypatch.chdir(tmp_path)
    main(["--n-layer", "1", "--n-embd", "16", "--n-head", "1", "--vocab-size", "64", "--block-size", "16",
          "--prompts", "2", "--prompt-len", "2", "--new-tokens", "2", "--batch-size", "2", "--repeats", "1"])
    assert sorted(p.name for p in (tmp_path / "benchmark-results" / "cpu").iterdir()) == ["generation.json", "generation.md"]
    assert (REPO / "benchmarks/results/cpu/generation.json").read_bytes() == recorded
    written = json.loads((tmp_path / "benchmark-results/cpu/generation.json").read_text())
    assert written["machine"]["cores"] >= 1 and written["machine"]["cpu"]  # a figure says the machine it ran on
    assert f"{written['machine']['cores']} cores" in (tmp_path / "benchmark-results/cpu/generation.md").read_text()
