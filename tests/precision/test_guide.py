"""docs/precision.md's guide: its MXFP8 plugin, written on DevicePrecision in one file, trains as written."""

from __future__ import annotations

import importlib
import re
import sys

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_gpuopt.model import GPT, GPTConfig
from lightning_gpuopt.perf.device import REFERENCE_DEVICES, DeviceFacts
from tests._paths import REPO
from tests.precision._helpers import TINY, LossRecorder, ProbeGPT, plugin_trainer, token_loader

_mx = pytest.importorskip("torchao.prototype.moe_training.config", reason="torchao without MXFP8 training")
if not hasattr(_mx, "MXFP8TrainingOpConfig"):
    pytest.skip("torchao without MXFP8TrainingOpConfig (0.18 has it)", allow_module_level=True)
# torchao 0.18's MXFP8 training asserts two DTensor internals that torch 2.11 lacks ("install the latest torch nightly")
from torch.distributed.tensor import _dispatch, _ops  # noqa: E402

if not (hasattr(_ops, "scaled_mm_single_dim_strategy") and hasattr(_dispatch, "is_pinned_handler")):
    pytest.skip(f"torchao's MXFP8 training needs a newer torch than {torch.__version__} (2.13 has what it asks for)",
                allow_module_level=True)


def _guide_module(tmp_path, monkeypatch):
    text = (REPO / "docs" / "precision.md").read_text()
    guide = text[text.index("## Add a precision plugin in one file"):]
    code = re.search(r"```python\n(.*?)```", guide, re.S).group(1)
    (tmp_path / "mxfp8.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mxfp8", raising=False)
    return importlib.import_module("mxfp8")


class _BuiltInConfigureModel(ProbeGPT):
    def __init__(self):
        pl.LightningModule.__init__(self)
        self.model, self.seen = None, {}

    def configure_model(self):
        if self.model is None:
            self.model = GPT(GPTConfig(**TINY, bias=False))


def test_the_guides_mxfp8_plugin_trains_a_gpt(tmp_path, monkeypatch):
    mxfp8 = _guide_module(tmp_path, monkeypatch)
    torch.manual_seed(0)
    plugin, module, losses = mxfp8.MXFP8Precision(emulate=True), _BuiltInConfigureModel(), LossRecorder()
    plugin_trainer(plugin, max_steps=2, callbacks=[losses]).fit(module, train_dataloaders=token_loader(n_seq=16))
    converted = {n for n, m in module.named_modules() if isinstance(m, nn.Linear) and type(m.weight) is not nn.Parameter}
    linears = {n for n, m in module.named_modules() if isinstance(m, nn.Linear)}
    assert converted == linears - {"model.lm_head"} and converted  # built in configure_model, converted there
    assert plugin.device_facts == DeviceFacts("cpu", "cpu") and plugin.fp8 and plugin.compute_dtype == torch.bfloat16
    assert len(losses.losses) == 2 and all(torch.isfinite(torch.tensor(losses.losses)))
    with pytest.raises(RuntimeError, match=r"H100.*emulate=True"):  # the device check, at the run's binding
        mxfp8.MXFP8Precision().bind(torch.device("cpu"), REFERENCE_DEVICES["H100 SXM"])
