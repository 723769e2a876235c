import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ThroughputMonitor

from lightning_gpuopt import GPT, GPTModule, TextDataModule
from tests.conftest import WIKITEXT2


def _trainer(**kw) -> pl.Trainer:
    args = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return pl.Trainer(**{**args, **kw})


def _data(source, cache_dir, **kw) -> TextDataModule:
    args = dict(source=str(source), block_size=64, batch_size=16, vocab_size=1024, num_workers=0, cache_dir=str(cache_dir))
    return TextDataModule(**{**args, **kw})


@pytest.mark.skipif(not WIKITEXT2.is_dir(), reason=f"WikiText-2 not found at {WIKITEXT2}")
def test_short_fit_on_wikitext2_lowers_loss(cache_dir):
    """Train on WikiText-2 valid.txt (real English); validation loss must fall well below its start."""
    pl.seed_everything(0)
    data = _data(WIKITEXT2 / "valid.txt", cache_dir)
    model = GPTModule(preset="tiny", vocab_size=data.vocab_size, block_size=64, learning_rate=3e-3, warmup_steps=20)
    start = _trainer(limit_val_batches=20).validate(model, datamodule=data, verbose=False)[0]["val/loss"]
    trainer = _trainer(max_steps=200, limit_val_batches=20, val_check_interval=200)
    trainer.fit(model, datamodule=data)
    end = trainer.callback_metrics["val/loss"].item()
    assert start == pytest.approx(torch.log(torch.tensor(1024.0)).item(), abs=0.3)  # ~uniform at init
    assert end < start - 1.5, (start, end)
    assert trainer.callback_metrics["val/ppl"].item() == pytest.approx(torch.exp(torch.tensor(end)).item(), rel=1e-4)


def test_val_perplexity_is_token_weighted_over_the_split(text_dir, cache_dir):
    data = _data(text_dir, cache_dir, vocab_size=300, batch_size=3)
    model = GPTModule(preset="tiny", vocab_size=300, block_size=64, warmup_steps=1)
    result = _trainer().validate(model, datamodule=data, verbose=False)[0]
    model.eval()
    losses, counts = [], []
    with torch.no_grad():
        for x, y in data.val_dataloader():
            losses.append(model.model.loss(model.model(x), y) * y.numel())
            counts.append(y.numel())
    mean = torch.stack(losses).sum() / sum(counts)
    assert result["val/loss"] == pytest.approx(mean.item(), rel=1e-5)
    assert result["val/ppl"] == pytest.approx(torch.exp(mean).item(), rel=1e-4)


def test_a_validation_window_without_targets_weighs_nothing():
    """A fine-tuning corpus's window may hold a prompt alone (every target -1): its loss is NaN, and the split's
    loss is that of the windows with targets, not NaN."""
    torch.manual_seed(0)
    model = GPTModule(preset="tiny", vocab_size=64, block_size=16, warmup_steps=1)
    x = torch.randint(0, 64, (4, 16))
    y = torch.randint(0, 64, (4, 16))
    y[:, :5] = -1  # a prompt
    batches = [(x[:2], torch.full((2, 16), -1)), (x[2:], y[2:])]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*nan", category=UserWarning)  # torchmetrics' "Encountered nan values"
        result = _trainer().validate(model, dataloaders=torch.utils.data.DataLoader(batches, batch_size=None), verbose=False)[0]
    model.eval()
    with torch.no_grad():
        expected = model.model.loss(model.model(x[2:]), y[2:])
    assert result["val/loss"] == pytest.approx(expected.item(), rel=1e-5)
    with pytest.warns(UserWarning, match=r"val/loss is NaN: no val window holds a target .*Raise data.val_fraction"):
        result = _trainer().validate(model, dataloaders=torch.utils.data.DataLoader(batches[:1], batch_size=None), verbose=False)[0]
    assert math.isnan(result["val/loss"])


def test_optimizer_and_schedule_follow_the_run(text_dir, cache_dir):
    data = _data(text_dir, cache_dir, vocab_size=300)
    model = GPTModule(preset="tiny", vocab_size=300, block_size=64, learning_rate=1e-3, warmup_steps=4, min_lr_ratio=0.1)
    trainer = _trainer(max_steps=12, limit_val_batches=0)
    trainer.fit(model, datamodule=data)
    opt = trainer.optimizers[0]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4)  # the cosine floor after 12 of 12 steps


def test_warmup_longer_than_run_warns(text_dir, cache_dir):
    data = _data(text_dir, cache_dir, vocab_size=300)
    model = GPTModule(preset="tiny", vocab_size=300, block_size=64, warmup_steps=50)
    with pytest.warns(UserWarning, match="warmup_steps=50 is longer than the run"):
        _trainer(max_steps=3, limit_val_batches=0).fit(model, datamodule=data)


def test_throughput_monitor_reads_flops_per_batch(text_dir, cache_dir):
    data = _data(text_dir, cache_dir, vocab_size=300)
    model = GPTModule(preset="tiny", vocab_size=300, block_size=64, warmup_steps=1)
    monitor = ThroughputMonitor(batch_size_fn=lambda b: b[0].size(0), length_fn=lambda b: b[0].numel(), window_size=2)
    _trainer(max_steps=3, limit_val_batches=0, callbacks=[monitor], log_every_n_steps=1).fit(model, datamodule=data)
    assert model.flops_per_batch == model.flops_per_token(64) * 16 * 64
    assert model.flops_per_token(64) == GPT(model.config).flops_per_token(64)


def test_module_argument_errors():
    with pytest.raises(ValueError, match="n_embd=90 is not divisible by n_head=4"):
        GPTModule(preset="tiny", n_embd=90)
    with pytest.raises(ValueError, match="learning_rate must be > 0"):
        GPTModule(learning_rate=0)
    with pytest.raises(ValueError, match="compile_mode='max-autotune' has no effect: also set compile=True"):
        GPTModule(compile_mode="max-autotune")


@pytest.mark.parametrize("scope", ["block", "model"])
def test_configure_model_is_idempotent_and_compiles_in_place(scope):
    module = GPTModule(preset="tiny", compile=True, compile_mode="default", compile_scope=scope)
    module.configure_model()
    model = module.model
    module.configure_model()
    assert module.model is model
    if scope == "block":  # each block on its own; the model itself runs eagerly between them
        assert model._compiled_call_impl is None
        assert all(block._compiled_call_impl is not None for block in model.transformer.h)
    else:
        assert model._compiled_call_impl is not None
    assert model.compile_loss
    # in-place compile keeps the plain model's state-dict keys (checkpoints load without prefixes)
    assert list(model.state_dict()) == list(GPT(module.config).state_dict())


def test_checkpoint_round_trip_and_predict(tmp_path, text_dir, cache_dir):
    data = _data(text_dir, cache_dir, vocab_size=300, prompts=["the model", "loss"], samples_per_prompt=3)
    model = GPTModule(preset="tiny", vocab_size=300, block_size=64, max_new_tokens=5, temperature=0, warmup_steps=1)
    trainer = _trainer(max_steps=2, limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=data)
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    restored = GPTModule.load_from_checkpoint(tmp_path / "m.ckpt", weights_only=True)
    for (k, a), (_, b) in zip(model.state_dict().items(), restored.state_dict().items()):
        assert torch.equal(a, b), k
    out = _trainer().predict(restored, datamodule=data)
    assert [tuple(o.shape) for o in out] == [(3, len(data.encode(p)) + 5) for p in ("the model", "loss")]
    assert torch.equal(out[0][0], out[0][1])  # greedy: every sample of a prompt is the same
    assert data.decode(out[0][0]).startswith("the model")


def test_flash_attn_on_a_device_without_it_stops_in_setup_before_the_model_is_built(text_dir, cache_dir):
    module = GPTModule(preset="tiny", vocab_size=300, block_size=32)
    module.config.attention = "flash-attn"  # as GPTModule(attention="flash-attn") with the package installed
    data = TextDataModule(source=str(text_dir), block_size=32, batch_size=4, vocab_size=300, num_workers=0, cache_dir=str(cache_dir))
    trainer = pl.Trainer(accelerator="cpu", precision="bf16-mixed", max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"compute capability 8.0 or newer .*this run's device is cpu: use GPTModule\(attention='sdpa'\)"):
        trainer.fit(module, datamodule=data)
    assert module.model is None and trainer.global_step == 0
class _GatheredWeights(pl.Callback):
    """Records what FSDP2 hands each probed layer in the forward: the weight's class and its element dtype."""

    LAYERS = ("transformer.ln_f", "transformer.h.0.ln_1", "transformer.h.0.mlp.c_fc")

    def __init__(self) -> None:
        self.seen: dict[str, tuple[str, torch.dtype]] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        for name in self.LAYERS:
            def record(module, args, name=name):
                weight = module.weight
                self.seen.setdefault(name, (type(weight).__name__, getattr(weight, "_data", weight).dtype))

            pl_module.model.get_submodule(name).register_forward_pre_hook(record)


@pytest.mark.parametrize(
    ("recipe", "linear"),
    [("tensorwise", ("Float8TrainingTensor", torch.float8_e4m3fn)), ("rowwise", ("Parameter", torch.bfloat16))],
)
def test_float8_under_fsdp2_gathers_weights_in_float8_or_bf16_never_fp32(fsdp2_trainer, recipe, linear):
    from tests.precision._helpers import tiny_gpt_module, token_loader

    from lightning_gpuopt.precision import Float8Precision

    probe = _GatheredWeights()
    convert_all = Float8Precision(recipe=recipe, emulate=True, module_filter=lambda module, fqn: "lm_head" not in fqn)
    trainer = fsdp2_trainer(plugins=[convert_all], max_steps=1, callbacks=[probe])
    with pytest.warns(UserWarning, match="Float8Precision: the model is not compiled"):  # uncompiled here on purpose
        trainer.fit(tiny_gpt_module(), token_loader(n_seq=8, batch_size=4))
    assert probe.seen == {  # what the all-gather carried: 1 byte per float8 weight (tensorwise), else 2
        "transformer.ln_f": ("Parameter", torch.bfloat16),  # the root's: embedding, tied head, final norm
        "transformer.h.0.ln_1": ("Parameter", torch.bfloat16),
        "transformer.h.0.mlp.c_fc": linear,
    }


def test_predict_says_when_a_prompt_is_longer_than_the_context():
    module = GPTModule(preset="tiny", vocab_size=64, block_size=16, max_new_tokens=2, temperature=0)
    module.configure_model()
    with pytest.warns(UserWarning, match=r"A prompt of 20 tokens and max_new_tokens=2 do not fit in the model's context "
                                         r"\(block_size=16\): generation sees only its last 14 tokens"):
        out = module.predict_step(torch.zeros(1, 20, dtype=torch.long), 0)
    assert out.shape == (1, 16)
    module.hparams.max_new_tokens = 16
    with pytest.raises(ValueError, match=r"max_new_tokens=16 does not fit in the model's context of block_size=16 tokens"):
        module.predict_step(torch.zeros(1, 2, dtype=torch.long), 0)


def test_the_llama_style_gpt_trains_under_fsdp2_with_float8(fsdp2_trainer):
    """llama-8b's layout in miniature (untied head: the token embedding sharded on its own), float8 emulated."""
    from torch.distributed.fsdp import FSDPModule

    Float8Linear = pytest.importorskip("torchao.float8.float8_linear").Float8Linear

    from lightning_gpuopt.precision import Float8Precision
    from tests.precision._helpers import LossRecorder, tiny_gpt_module, token_loader

    plugin = Float8Precision(recipe="tensorwise", emulate=True, module_filter=["lm_head"])
    losses = LossRecorder()
    trainer = fsdp2_trainer(plugins=[plugin], max_steps=3, callbacks=[losses])
    module = tiny_gpt_module(preset="llama-tiny")
    module.config.tie_embeddings = False  # as llama-8b and llama-70b
    with pytest.warns(UserWarning, match="Float8Precision: the model is not compiled"):
        trainer.fit(module, token_loader(n_seq=12, batch_size=4))
    model = module.model
    assert isinstance(model.transformer.wte, FSDPModule) and isinstance(model.transformer.h[1], FSDPModule)
    assert isinstance(model.transformer.h[0].attn.k_proj, Float8Linear) and isinstance(model.transformer.h[0].mlp.gate_proj, Float8Linear)
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert len(losses.losses) == 3 and all(math.isfinite(x) for x in losses.losses)


def test_predict_step_runs_a_generation_job_of_mixed_lengths(caplog):
    """A GenerationJob through trainer.predict: every row handed over as it finishes, greedy rows as GPT.generate's
    alone, the batch size from the device (a CPU: a fixed number of rows, said)."""
    from torch.utils.data import DataLoader

    from lightning_gpuopt.generation.batched import GenerationJob, Request

    module = GPTModule(preset="tiny", vocab_size=64, block_size=32, max_new_tokens=5, temperature=0)
    requests = [Request(list(range(1, n + 1)), 5, key=n) for n in (1, 7, 3, 12)]
    done = []
    job = GenerationJob(requests, on_finished=done.append)
    with caplog.at_level("INFO"):
        out = _trainer().predict(module, dataloaders=DataLoader([job], batch_size=None, collate_fn=lambda j: j))
    assert out == [{"completions": 4, "tokens": 20}]
    assert "Generation batch: 4 rows (cpu: no device memory to size the batch from). (GenerationJob(batch_size=...) sets another.)" in caplog.text
    for d in done:
        prompt = torch.tensor([list(range(1, d.key + 1))])
        assert d.tokens == module.model.generate(prompt, 5, temperature=0)[0, d.key:].tolist()


def _gpt_checkpoint(path, **config) -> GPT:
    from lightning_gpuopt.model import GPTConfig

    gpt = GPT(GPTConfig.from_name("tiny", **config))
    hparams = {"preset": "tiny", **config}
    torch.save({"hyper_parameters": hparams, "state_dict": {f"model.{k}": v for k, v in gpt.state_dict().items()}}, path)
    return gpt


def test_init_from_starts_from_the_checkpoints_weights(tmp_path):
    torch.manual_seed(1)
    saved = _gpt_checkpoint(tmp_path / "base.ckpt", vocab_size=64, block_size=32)
    torch.manual_seed(2)  # another initialisation: the weights must come from the file
    module = GPTModule(preset="tiny", vocab_size=64, block_size=32, init_from=str(tmp_path / "base.ckpt"))
    module.configure_model()
    for (k, a), (_, b) in zip(saved.state_dict().items(), module.model.state_dict().items()):
        assert torch.equal(a, b), k


def test_init_from_another_architecture_is_refused(tmp_path):
    from lightning_gpuopt.model.checkpoint import CheckpointError

    _gpt_checkpoint(tmp_path / "base.ckpt", vocab_size=64, block_size=32, n_layer=3)
    module = GPTModule(preset="tiny", vocab_size=64, block_size=32, init_from=str(tmp_path / "base.ckpt"))
    with pytest.raises(CheckpointError, match=r"do not fit the model's architecture .*'transformer.h.2.* is in the file and not in the model"):
        module.configure_model()
