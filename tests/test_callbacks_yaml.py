"""Both callbacks are configurable from YAML (jsonargparse, as the gpuopt / Lightning CLI uses)."""

import yaml
from jsonargparse import ArgumentParser

from lightning_gpuopt.callbacks import CUDASettings, MFUMonitor

CONFIG = """
cuda:
  tf32: true
  cudnn_benchmark: true
  sdpa_backends: [flash, efficient, math]
  expandable_segments: true
  matmul_precision: medium
mfu:
  log_every_n_steps: 10
  warmup_steps: 2
  peak_flops: 989.4e12
  dtype: bf16
  measure_peak: false
"""


def test_yaml_config_builds_both_callbacks():
    parser = ArgumentParser()
    parser.add_class_arguments(CUDASettings, "cuda")
    parser.add_class_arguments(MFUMonitor, "mfu")
    cfg = parser.parse_object(yaml.safe_load(CONFIG))
    init = parser.instantiate_classes(cfg)
    cuda, mfu = init.cuda, init.mfu
    assert isinstance(cuda, CUDASettings) and cuda.sdpa_backends == ["flash", "efficient", "math"]
    assert cuda.matmul_precision == "medium" and cuda.tf32 is True
    assert isinstance(mfu, MFUMonitor) and mfu.peak_flops == 989.4e12 and mfu.log_every_n_steps == 10
    cuda._restore()
