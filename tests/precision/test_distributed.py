"""BF16Precision and Float8Precision under DDP and ModelParallelStrategy (FSDP2), 2 CPU processes (gloo).

Each case runs ``_distributed_script.py`` in a subprocess (Lightning launches the second rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("_distributed_script.py")


def _run(plugin: str, strategy: str, tmp_path: Path) -> dict:
    out = tmp_path / "summary.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), plugin, strategy, str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.parametrize("plugin", ["bf16", "fp8"])
def test_plugins_on_two_cpu_processes(plugin, strategy, tmp_path):
    pytest.importorskip("torchao.float8")
    s = _run(plugin, strategy, tmp_path)
    assert s["world_size"] == 2
    assert s["compute_dtype"] == "torch.bfloat16" and s["autocast_device"] == "cpu"
    assert s["param_dtypes"] == ["torch.float32"]
    assert len(s["losses"]) == 8 and s["losses"][-1] < s["losses"][0]
    assert s["sharded"] == (strategy == "fsdp2")
    # FSDP2: the root and every block are their own FSDP module (per-block sharding), not the root alone.
    assert s["fsdp_modules"] == [strategy == "fsdp2"] * 3
    # Activation checkpointing (bf16-fsdp2): the backward recomputes every block, so block 0 runs twice a step.
    assert s["block_forward_calls"] == 8 * (2 if s["activation_checkpointing"] else 1)
    if strategy == "ddp":
        assert s["ranks_agree"]
    if plugin == "fp8":
        assert s["float8_layers"] == 8
        assert s["state_dict_keys"] == 29  # as the unconverted tiny GPTModule (test_float8.py checks names + dtypes)
        if strategy == "fsdp2":
            # tensorwise + FSDP2: weights all-gathered in float8, scales precomputed after every step
            assert s["float8_all_gather"] and s["float8_weights"] == 8
            assert s["precompute_calls"] == 8 and s["precomputed_scales"] == 8
        else:
            assert not s["float8_all_gather"] and s["precompute_calls"] == 0
