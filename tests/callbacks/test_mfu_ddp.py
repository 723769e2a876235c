"""MFUMonitor in a real 2-process DDP run on CPU (gloo): global tokens/s are world size x per device."""

import json
import os
import subprocess
import sys

import pytest

from tests._paths import SCRIPTS

SCRIPT = SCRIPTS / "ddp_mfu.py"


def test_world_size_scaling_in_two_process_ddp(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for res in results:
        assert res["world_size"] == 2
        assert len(res["history"]) == 2  # steps 2-3 and 4-5 after one warm-up step
        for m in res["history"]:
            per_device = m["perf/tokens_per_sec_per_device"]
            assert m["perf/tokens_per_sec"] == pytest.approx(2 * per_device, rel=1e-12)
            # tokens per step per device = 2 x 32; step time from the same window
            assert per_device == pytest.approx(2 * 32 / (m["perf/step_time_ms"] / 1000), rel=1e-9)
            assert m["perf/tflops_per_device"] * 1e12 == pytest.approx(res["flops_per_token"] * per_device, rel=1e-9)
            assert m["perf/mfu"] == pytest.approx(m["perf/tflops_per_device"] * 1e12 / 1e12, rel=1e-9)
