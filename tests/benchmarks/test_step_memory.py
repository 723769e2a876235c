"""benchmarks/step_memory.py: every loss implementation trains the same tiny GPT step, and the table."""

from __future__ import annotations

import argparse

import pytest
import torch

from benchmarks import step_memory
from benchmarks.step_memory import _table, choose_impls, has_native_loss, measure_step

_TINY = argparse.Namespace(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=256, chunk_size=None)


@pytest.mark.parametrize("precision", ["32", "bf16"])
def test_every_loss_implementation_gives_the_same_loss(precision):
    # torch's native loss only where this torch has it (2.13+): default_impls() leaves it out elsewhere
    losses = {impl: measure_step(impl, 2, "cpu", precision, _TINY)["loss"] for impl in step_memory.default_impls()}
    assert len(losses) == (4 if has_native_loss() else 2)
    tol = 1e-4 if precision == "32" else 2e-2  # native-tuned runs its matmuls in bf16, native in float32
    for impl, loss in losses.items():
        assert loss == pytest.approx(losses["plain"], rel=tol), (impl, losses)


def test_the_table_gives_growth_time_ratios_and_the_bf16_excess():
    def row(precision, impl, mb, gb, s):
        return {"precision": precision, "impl": impl, "micro_batch": mb, "peak_bytes": gb * 1e9, "step_s": s}

    rows = [row("bf16", "plain", 4, 3.0, 2.0), row("bf16", "chunked", 4, 1.1, 2.2), row("bf16", "chunked", 16, 1.5, 8.0),
            row("32", "plain", 4, 2.5, 1.0), row("32", "chunked", 4, 1.0, 1.0), row("32", "chunked", 16, 1.4, 4.0)]
    table = _table(rows, [4, 16])
    assert "| bf16 | chunked | 1.10 | 1.50 | 0.40 | 2.20 | 1.10x |" in table
    assert "| 32 | plain | 2.50 | - | - | 1.00 | 1.00x |" in table
    assert "bf16 peaks +0.10 GB against float32" in table


def test_a_torch_without_linear_cross_entropy_leaves_the_native_losses_out_and_says_so(monkeypatch, capsys):
    monkeypatch.delattr(torch.nn.functional, "linear_cross_entropy", raising=False)  # as torch 2.11
    assert not has_native_loss()
    assert choose_impls(None) == ["plain", "chunked"]
    assert capsys.readouterr().err.count("has no F.linear_cross_entropy") == 1
    assert choose_impls("chunked,plain") == ["chunked", "plain"]
    with pytest.raises(ValueError, match="needs torch.nn.functional.linear_cross_entropy .* leave native-tuned out"):
        choose_impls("chunked,native-tuned")  # asked for by name: refused before any measurement
    with pytest.raises(RuntimeError, match="needs torch.nn.functional.linear_cross_entropy"):
        measure_step("native", 2, "cpu", "32", _TINY)
    with pytest.raises(ValueError, match="unknown names \\['fused'\\]"):
        choose_impls("plain,fused")
