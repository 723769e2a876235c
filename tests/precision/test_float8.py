"""Float8Precision in a Trainer on CPU (torchao's emulation): conversion, training, checkpoints, warnings and errors."""

from __future__ import annotations

import math
import sys

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_gpuopt.model import GPT, GPTConfig
from lightning_gpuopt.perf.device import REFERENCE_DEVICES
from lightning_gpuopt.precision import BF16Precision, Float8Precision
from lightning_gpuopt.precision.float8 import check_float8_device
from lightning_gpuopt.precision.float8_layers import (
    CONV1D_REASON,
    float8_config,
    format_conversion_table,
)
from tests.precision._helpers import (
    GPT2Like,
    LossRecorder,
    plugin_trainer,
    tiny_gpt_module,
    token_loader,
)

torchao_float8 = pytest.importorskip("torchao.float8")


from torchao.float8.float8_linear import Float8Linear  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:Float8Precision. the model is not compiled",
    "ignore:.*does not have many workers.*",
    "ignore:You defined a `validation_step`",
)


def test_float8_converts_gptmodule_in_configure_model_and_trains():
    plugin = Float8Precision(emulate=True, module_filter=["lm_head"])
    module = tiny_gpt_module()
    rec = LossRecorder()
    trainer = plugin_trainer(plugin, max_steps=6, callbacks=[rec])
    with pytest.warns(UserWarning, match="not compiled.*GPTModule\\(compile=True\\)"):
        trainer.fit(module, train_dataloaders=token_loader(n_seq=64))
    converted = [n for n, _, r in plugin.conversion_report if r is None]
    assert len(converted) == 8 and all(n.startswith("model.transformer.h.") for n in converted)
    assert dict((n, r) for n, _, r in plugin.conversion_report)["model.lm_head"] == "matches 'lm_head'"
    assert len(plugin.conversion_report) == 9  # no layer reported twice
    assert isinstance(module.model.transformer.h[0].attn.c_attn, Float8Linear)
    assert module.model.transformer.h[0].attn.c_attn.config.emulate
    assert all(math.isfinite(x) for x in rec.losses) and rec.losses[-1] < rec.losses[0]
    # Parameters stay fp32 and the tied head still shares the embedding.
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    assert module.model.lm_head.weight is module.model.transformer.wte.weight


def test_float8_warns_about_compile_once_and_not_for_compiled_models(recwarn):
    plugin = Float8Precision(emulate=True, module_filter=[])
    module = tiny_gpt_module()
    module.configure_model()
    plugin.convert_module(module)
    plugin.convert_module(module)
    assert sum("not compiled" in str(w.message) for w in recwarn.list) == 1

    compiled = tiny_gpt_module(compile=True)
    compiled.configure_model()  # compiles in place (lazily)
    recwarn.clear()
    Float8Precision(emulate=True, module_filter=[]).convert_module(compiled)
    assert not any("not compiled" in str(w.message) for w in recwarn.list)
    assert isinstance(compiled.model.transformer.h[0].mlp.c_fc, Float8Linear)


class EncoderClassifier(pl.LightningModule):
    """A module this package did not write: nn.TransformerEncoderLayer blocks built in __init__."""

    def __init__(self, d_model: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 256)

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self.head(self.encoder(self.embed(idx), is_causal=True, mask=nn.Transformer.generate_square_subsequent_mask(idx.size(1))))
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


@pytest.mark.parametrize("plugin_name", ["bf16", "fp8"])
def test_plugins_work_with_a_foreign_lightning_module(plugin_name):
    plugin = BF16Precision() if plugin_name == "bf16" else Float8Precision(recipe="rowwise", emulate=True, module_filter=[])
    module = EncoderClassifier()
    rec = LossRecorder()
    plugin_trainer(plugin, max_steps=12, callbacks=[rec]).fit(module, train_dataloaders=token_loader(n_seq=96))
    assert rec.losses[-1] < rec.losses[0] - 0.3
    if plugin_name == "fp8":
        decisions = {n: r for n, _, r in plugin.conversion_report}
        assert decisions["encoder.layers.0.linear1"] is None and decisions["head"] is None
        assert "MultiheadAttention" in decisions["encoder.layers.0.self_attn.out_proj"]
        assert isinstance(module.encoder.layers[1].linear2, Float8Linear) and isinstance(module.head, Float8Linear)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_every_recipe_trains_on_cpu(recipe):
    plugin = Float8Precision(recipe=recipe, emulate=True, module_filter=["lm_head"])
    rec = LossRecorder()
    plugin_trainer(plugin, max_steps=3, callbacks=[rec]).fit(tiny_gpt_module(), train_dataloaders=token_loader(n_seq=24))
    assert len(rec.losses) == 3 and all(math.isfinite(x) for x in rec.losses)


@pytest.mark.slow
def test_float8_loss_matches_bf16_after_200_steps():
    """Same data, seed and model: emulated float8 ends within 0.1 nats of bf16 (measured: 2.5614 vs 2.5627)."""
    final = {}
    for name, plugin in [("bf16", BF16Precision()), ("fp8", Float8Precision(emulate=True, module_filter=["lm_head"]))]:
        torch.manual_seed(0)
        rec = LossRecorder()
        module = tiny_gpt_module(n_head=2, n_embd=32, block_size=16, warmup_steps=20)
        loader = token_loader(seq_len=16, batch_size=4)
        plugin_trainer(plugin, max_steps=200, callbacks=[rec]).fit(module, train_dataloaders=loader)
        final[name] = sum(rec.losses[-20:]) / 20
    print(f"final loss bf16={final['bf16']:.4f} fp8={final['fp8']:.4f} gap={final['fp8'] - final['bf16']:+.4f}")
    assert final["bf16"] < 3.0  # learned much of the Markov chain (ln 256 = 5.55 at the start)
    assert abs(final["fp8"] - final["bf16"]) < 0.1


def test_float8_checkpoint_loads_into_plain_gpt_and_resumes(tmp_path):
    plugin = Float8Precision(emulate=True, module_filter=["lm_head"])
    module = tiny_gpt_module()
    trainer = plugin_trainer(plugin, max_steps=3)
    trainer.fit(module, train_dataloaders=token_loader(n_seq=32))
    path = tmp_path / "fp8.ckpt"
    trainer.save_checkpoint(path)

    checkpoint = torch.load(path, weights_only=True)  # plain tensors only: loads without torchao's globals
    state = checkpoint["state_dict"]
    reference = tiny_gpt_module()
    reference.configure_model()
    expected = reference.state_dict()
    assert list(state) == list(expected)
    assert {k: v.dtype for k, v in state.items()} == {k: v.dtype for k, v in expected.items()}
    assert all(type(v) is torch.Tensor for v in state.values())

    # 1) Inference in a plain GPT, fp32 and bf16.
    plain = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=256))
    plain.load_state_dict({k.removeprefix("model."): v for k, v in state.items()}, strict=True)
    for name, param in plain.state_dict().items():
        torch.testing.assert_close(param, module.model.state_dict()[name], rtol=0, atol=0)
    idx = torch.randint(0, 256, (2, 16))
    module.model.eval()
    with torch.no_grad():
        logits_plain = plain(idx)
        logits_bf16 = plain.to(torch.bfloat16)(idx)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits_fp8 = module.model(idx)
    assert logits_bf16.dtype == torch.bfloat16 and torch.isfinite(logits_bf16).all()
    # float8 rounding vs full precision: close, not equal
    assert (logits_plain - logits_fp8.float()).abs().mean() < 0.05 * logits_plain.abs().mean()

    # 2) Resume the float8 run.
    restored = {}

    class Capture(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            restored.update({k: v.clone() for k, v in pl_module.state_dict().items()})

    plugin2 = Float8Precision(emulate=True, module_filter=["lm_head"])
    module2 = tiny_gpt_module()
    trainer2 = plugin_trainer(plugin2, max_steps=5, callbacks=[Capture()])
    trainer2.fit(module2, train_dataloaders=token_loader(n_seq=32), ckpt_path=path)
    assert trainer2.global_step == 5
    assert isinstance(module2.model.transformer.h[0].mlp.c_fc, Float8Linear)
    for k, v in state.items():
        torch.testing.assert_close(restored[k], v, rtol=0, atol=0)


def test_float8_argument_errors():
    with pytest.raises(ValueError, match="Float8Precision.recipe must be 'tensorwise'.*got 'delayed'"):
        Float8Precision(recipe="delayed")
    with pytest.raises(ValueError, match="module_filter='lm_head'.*list of layer-name patterns"):
        Float8Precision(module_filter="lm_head")
    with pytest.raises(ValueError, match="expected 'auto', 'static', a list of strings, or a callable"):
        Float8Precision(module_filter=[1, 2])
    with pytest.raises(ValueError, match="needs the 'tensorwise' recipe"):
        float8_config("rowwise", fsdp_float8_all_gather=True)


@pytest.mark.parametrize("name", sorted(REFERENCE_DEVICES))
def test_float8_device_check_for_every_reference_device(name):
    facts = REFERENCE_DEVICES[name]
    if facts.is_cuda and not facts.fp8:
        with pytest.raises(RuntimeError, match="emulate=True"):
            check_float8_device(facts, emulate=False)
    elif not facts.is_cuda:
        with pytest.warns(UserWarning, match=r"Float8Precision on cpu: no float8 tensor cores.*emulate=True"):
            check_float8_device(facts, emulate=False)
    else:
        check_float8_device(facts, emulate=False)
    check_float8_device(facts, emulate=True)  # emulation: no error, no word, anywhere


def test_float8_without_torchao_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # makes `import torchao.float8` fail
    with pytest.raises(ImportError, match=r'pip install "lightning-gpuopt\[fp8\]"'):
        Float8Precision()


def test_float8_on_pre_sm89_gpu_names_emulate_and_bf16():
    with pytest.raises(RuntimeError, match=r"A100.* has 8\.0.*emulate=True.*BF16Precision"):
        check_float8_device(REFERENCE_DEVICES["A100"], emulate=False)
    check_float8_device(REFERENCE_DEVICES["A100"], emulate=True)  # emulation is allowed anywhere
    check_float8_device(REFERENCE_DEVICES["L4"], emulate=False)
    check_float8_device(REFERENCE_DEVICES["H100 SXM"], emulate=False)

    # The plugin runs the check when it is bound to the run's device, on its facts, before converting anything.
    with pytest.raises(RuntimeError, match="emulate=True"):
        Float8Precision().bind(torch.device("cuda", 0), REFERENCE_DEVICES["T4"])


def test_float8_with_per_block_compile_trains_like_uncompiled():
    """GPTModule(compile=True)'s default (each block compiled on its own) over Float8Linear layers."""
    losses = {}
    for compile_ in (False, True):
        torch.manual_seed(0)
        plugin = Float8Precision(emulate=True, module_filter=["lm_head"])
        module = tiny_gpt_module(compile=compile_)
        rec = LossRecorder()
        trainer = plugin_trainer(plugin, max_steps=3, callbacks=[rec])
        trainer.fit(module, train_dataloaders=token_loader(n_seq=32))
        losses[compile_] = rec.losses
        assert isinstance(module.model.transformer.h[0].attn.c_attn, Float8Linear)
    blocks = module.model.transformer.h
    assert all(b._compiled_call_impl is not None for b in blocks) and module.model.compile_loss
    assert list(module.model.state_dict()) == [k.removeprefix("model.") for k in module.state_dict() if k.startswith("model.")]
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=1e-3, atol=1e-3)


def test_float8_names_conv1d_layers_as_not_convertible_and_warns_once():
    plugin = Float8Precision(emulate=True)
    with pytest.warns(UserWarning, match="converted none") as record:
        trainer = plugin_trainer(plugin, max_steps=2)
        trainer.fit(GPT2Like(), train_dataloaders=token_loader(n_seq=8))
        trainer = plugin_trainer(plugin, max_steps=4)
        trainer.fit(GPT2Like(), train_dataloaders=token_loader(n_seq=8))
    messages = [str(w.message) for w in record if "converted none" in str(w.message)]
    assert len(messages) == 1
    # the largest layer is a Conv1D, named with its shape and the reason; the fix is named
    assert "c_fc (64x512), was skipped: Conv1D-style" in messages[0]
    assert "replace them with nn.Linear" in messages[0] and "BF16Precision" in messages[0]
    decisions = {n: (shape, r) for n, shape, r in plugin.conversion_report}
    assert decisions["c_fc"] == ("64x512", CONV1D_REASON) and decisions["c_proj"] == ("512x64", CONV1D_REASON)
    assert decisions["lm_head"][1] == "output layer"
    table = format_conversion_table(plugin.conversion_report, "tensorwise")
    assert "0 of 3 projection layers converted" in table and "c_fc" in table


def test_float8_auto_filter_on_a_tiny_model_warns_with_the_largest_layer_and_the_fix():
    plugin = Float8Precision(emulate=True)  # module_filter="auto": every layer of a tiny GPT is too small
    with pytest.warns(UserWarning, match=r"converted none of the 9 projection layers of GPTModule") as record:
        plugin_trainer(plugin, max_steps=1).fit(tiny_gpt_module(), train_dataloaders=token_loader(n_seq=8))
    (message,) = [str(w.message) for w in record if "converted none" in str(w.message)]
    assert "too small for tensorwise FP8" in message and "module_filter=['lm_head']" in message
    # the largest layer: lm_head (64 x 256, padded vocab) or an MLP projection (64 x 256), both 16384 weights
    assert "(64x256)" in message
