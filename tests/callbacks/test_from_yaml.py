"""The callbacks are configurable from YAML (jsonargparse, as the gpuopt / Lightning CLI uses), and every
shipped recipe builds the stack."""


import pytest
import yaml
from jsonargparse import ArgumentParser
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.precision import Precision

from lightning_gpuopt.callbacks import CUDASettings, MFUMonitor, NonFiniteGuard
from lightning_gpuopt.precision import BF16Precision
from tests._paths import REPO

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


CONFIGS = sorted((REPO / "examples" / "configs").glob("*.yaml"))


def _stack_parser() -> ArgumentParser:
    parser = ArgumentParser()
    parser.add_argument("--callbacks", type=list[Callback])
    parser.add_argument("--plugins", type=list[Precision])
    return parser


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_recipe_builds_the_stack(config):
    """Each shipped recipe's plugins and callbacks are real objects with the recipe's values."""
    trainer = yaml.safe_load(config.read_text())["trainer"]
    parser = _stack_parser()
    plugins = trainer.get("plugins", [])  # the quickstart, hf-llama and rft leave the precision to the stack (float32 on a CPU)
    init = parser.instantiate_classes(parser.parse_object({"callbacks": trainer["callbacks"], "plugins": plugins}))
    try:
        assert [type(p) for p in init.plugins] == ([] if config.stem in ("quickstart", "hf-llama", "rft") else [BF16Precision])
        by_type = {type(c): c for c in init.callbacks}
        assert {CUDASettings, MFUMonitor, NonFiniteGuard, ModelCheckpoint} <= set(by_type)
        checkpoint = by_type[ModelCheckpoint]
        assert checkpoint.save_last is True and checkpoint.save_top_k == 0
        assert checkpoint._every_n_train_steps >= 100 and checkpoint._every_n_epochs == 0  # never at validation
        assert by_type[NonFiniteGuard].policy == "skip"
    finally:
        by_type[CUDASettings]._restore()


def test_default_stack_builds():
    from lightning_gpuopt.cli.defaults import CHECKPOINT_EVERY_N_STEPS, default_stack

    stack = default_stack("cuda")  # on a GPU; on a CPU there is no precision plugin
    parser = _stack_parser()
    init = parser.instantiate_classes(
        parser.parse_object({"callbacks": stack["trainer.callbacks"], "plugins": stack["trainer.plugins"]})
    )
    types = [type(c) for c in init.callbacks]
    assert types == [CUDASettings, MFUMonitor, NonFiniteGuard, ModelCheckpoint]
    assert init.callbacks[-1]._every_n_train_steps == CHECKPOINT_EVERY_N_STEPS
    assert [type(p) for p in init.plugins] == [BF16Precision]
    init.callbacks[0]._restore()
