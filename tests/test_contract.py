"""The contract every exported callback and plugin keeps, with modules written the way others write them.

Each piece is run against every module shape of ``tests/_module_shapes.py`` (nanoGPT's forward,
Hugging Face-style dict batches and outputs, Hugging Face Llama with padded ``attention_mask`` batches and
a step that reads ``loss.item()``, litgpt's, litgpt's fed by an ``IterableDataset`` with its own
``collate_fn``, manual optimisation with two optimizers, a LightningModule without ``forward``), its
data given as the module's own loader or through a datamodule, and checked for: construction with
defaults, two fits in a row with the same instance, a checkpoint that loads with ``weights_only=True``
and a ``state_dict`` round trip, and the value the piece claims (FLOPs per token, skipped bad steps,
bf16 autocast, float8 layers, restored global flags, an atomic checkpoint file). The same module shapes
also train through ``gpuopt fit --model <class path>`` with the default stack:
``tests/cli/test_named_classes.py::test_contract_shapes_through_gpuopt``.
"""

from __future__ import annotations

import math
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import lightning_gpuopt.callbacks as callbacks_pkg
import lightning_gpuopt.checkpoint as checkpoint_pkg
import lightning_gpuopt.precision as precision_pkg
from tests._module_shapes import (
    MORE_SHAPES,
    SHAPES,
    T,
    LitGPTModule,
    LoaderData,
    NoForwardModule,
    hand_flops_per_token,
    iterable_loader,
    shape_loader,
)
from lightning_gpuopt.callbacks import CUDASettings, ExactResume, MFUMonitor, NonFiniteGuard, SigtermCheckpoint
from lightning_gpuopt.checkpoint import AtomicCheckpointIO
from lightning_gpuopt.precision import BF16Precision, Float8Precision

pytestmark = pytest.mark.filterwarnings(
    "ignore:Float8Precision. the model is not compiled",
    "ignore:.*does not have many workers.*",
    "ignore:.*has no bf16 peak FLOP/s.*",
    "ignore:.*is not resumable.*",
)

SHAPE_CLASSES = {
    **SHAPES,
    "noforward": NoForwardModule,
    "hf-llama-mask": MORE_SHAPES["hf-llama-mask"],
    "two-optimizers": MORE_SHAPES["two-optimizers"],
    "iterable-collate": LitGPTModule,
}
B, STEPS = 2, 2  # batches per fit


def _loader(shape: str):
    if shape == "iterable-collate":
        return iterable_loader(B)
    return shape_loader({"noforward": "litgpt", "two-optimizers": "litgpt"}.get(shape, shape), B)


def _real_tokens(shape: str) -> int:
    """Tokens the first STEPS batches of the shape's loader hold, padding left out (the masked shapes pad)."""
    batches = [batch for batch, _ in zip(_loader(shape), range(STEPS))]
    return sum(int(b["attention_mask"].sum()) if isinstance(b, dict) and "attention_mask" in b else B * T for b in batches)


def _fresh(shape: str) -> pl.LightningModule:
    torch.manual_seed(0)
    return SHAPE_CLASSES[shape]()


class _Poison(pl.Callback):
    """Makes every gradient NaN in the first batch: the bad batch NonFiniteGuard must skip, and count once
    however many optimizers see it."""

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == 0:
            for p in pl_module.parameters():
                if p.grad is not None:
                    p.grad.view(-1)[0] = float("nan")


class _Seen(pl.Callback):
    def __init__(self):
        self.dtypes, self.param_dtypes = set(), set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        def record(module, args, out):
            self.dtypes.add(out.dtype)

        self.handles = [m.register_forward_hook(record) for m in pl_module.modules() if isinstance(m, nn.Linear)][:1]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for h in self.handles:
            h.remove()
        self.param_dtypes |= {p.dtype for p in pl_module.parameters()}


# name -> what a piece warns in these fits, and why: the modules' own loaders restart an epoch from its
# first sample; _Poison makes one step's gradients NaN; the fits have no ModelCheckpoint; nothing is compiled.
EXPECTED_WARNINGS = {
    "ExactResume": "the data order of .* is not resumed exactly",
    "NonFiniteGuard": "NonFiniteGuard: skipped non-finite gradients",
    "SigtermCheckpoint": "the Trainer has no ModelCheckpoint, so a SIGTERM saves nothing",
    "Float8Precision": "Float8Precision: the model is not compiled",  # these modules are not compiled
}

# name -> (make the piece, is it a plugin)
PIECES = {
    "MFUMonitor": (lambda: MFUMonitor(log_every_n_steps=1, warmup_steps=0, peak_flops=1e12), False),
    "NonFiniteGuard": (lambda: NonFiniteGuard(), False),
    "ExactResume": (lambda: ExactResume(), False),
    "SigtermCheckpoint": (lambda: SigtermCheckpoint(), False),  # saves on SIGTERM only: tests/callbacks/test_sigterm_checkpoint.py
    "CUDASettings": (lambda: CUDASettings(), False),
    "BF16Precision": (lambda: BF16Precision(), True),
    "Float8Precision": (lambda: Float8Precision(emulate=True, module_filter=["lm_head"]), True),
    "AtomicCheckpointIO": (lambda: AtomicCheckpointIO(), True),
}
# Exported, but not a piece to run here: exceptions, and AutoBatchSize, which needs a loader it can
# resize (a datamodule's) and max_micro_batch_size on CPU: its contract over the same module shapes is
# tests/callbacks/auto_batch/test_contracts.py. AtomicModelParallelStrategy is a strategy (tests/checkpoint).
# The progress bars are Lightning's, drawn the same; their resume: tests/callbacks/test_progress_bar.py.
# DevicePrecision is the base BF16Precision and Float8Precision run here on (a plugin on it: tests/precision/test_guide.py).
NOT_PIECES = {"NonFiniteError", "NonFiniteCheckpointError", "AutoBatchSize", "AtomicModelParallelStrategy",
              "ResumedRichProgressBar", "ResumedTQDMProgressBar", "DevicePrecision"}


def test_every_export_is_covered():
    exported = set(callbacks_pkg.__all__) | set(precision_pkg.__all__) | set(checkpoint_pkg.__all__)
    assert exported == set(PIECES) | NOT_PIECES


def _fit(piece, is_plugin, shape, tmp_path, extra=(), datamodule=False):
    module = _fresh(shape)
    steps = STEPS * getattr(module, "steps_per_batch", 1)  # two manual optimizers: two global steps a batch
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
        callbacks=[*([] if is_plugin else [piece]), *extra], plugins=[piece] if is_plugin else None,
    )
    data = dict(datamodule=LoaderData("litgpt", B)) if datamodule else dict(train_dataloaders=_loader(shape))
    trainer.fit(module, **data)
    assert trainer.global_step == steps
    return trainer, module


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(SHAPE_CLASSES))
@pytest.mark.parametrize("name", sorted(PIECES))
def test_contract(name, shape, tmp_path):
    make, is_plugin = PIECES[name]
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision())
    piece = make()  # constructible with the documented defaults
    extra = {"NonFiniteGuard": [_Poison()], "BF16Precision": [_Seen()], "Float8Precision": [_Seen()]}.get(name, [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, module = _fit(piece, is_plugin, shape, tmp_path, extra, datamodule=shape == "litgpt")
    ours = {str(w.message) for w in caught if "lightning_gpuopt" in w.filename}
    assert all(re.search(EXPECTED_WARNINGS.get(name, "^$"), m) for m in ours), ours  # each warns only what it says below

    # the value each one claims
    if name == "MFUMonitor":
        per_token = piece.history[-1]["perf/tflops_per_device"] * 1e12 / piece.history[-1]["perf/tokens_per_sec_per_device"]
        assert per_token == pytest.approx(hand_flops_per_token(module), rel=0.03)
        assert piece.total_tokens == _real_tokens(shape)  # padding left out (hf-* shapes pad every other row)
    elif name == "NonFiniteGuard":
        assert piece.skipped_steps == 1
        assert all(torch.isfinite(v).all() for v in module.state_dict().values() if v.is_floating_point())
    elif name == "BF16Precision":
        assert extra[0].dtypes == {torch.bfloat16} and extra[0].param_dtypes == {torch.float32}
    elif name == "Float8Precision":
        from torchao.float8.float8_linear import Float8Linear

        converted = [n for n, _, r in piece.conversion_report if r is None]
        assert converted and sum(isinstance(m, Float8Linear) for m in module.modules()) == len(converted)
    elif name == "CUDASettings":
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision()) == flags

    # a checkpoint with the piece's state loads with weights_only=True; the state round-trips
    path = tmp_path / "a.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, map_location="cpu", weights_only=True)
    assert saved["global_step"] == trainer.global_step
    if name == "AtomicCheckpointIO":
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("a.ckpt")) == ["a.ckpt"]  # no partial file left
    if not is_plugin:
        state = piece.state_dict()
        assert any(type(piece).__name__ in key for key in saved["callbacks"]) or state == {}
        again = make()
        again.load_state_dict(state)
        assert again.state_dict() == state

    # a second fit with the same instance
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, module = _fit(piece, is_plugin, shape, tmp_path / "second", [type(e)() for e in extra])
    ours = {str(w.message) for w in caught if "lightning_gpuopt" in w.filename}
    assert all(re.search(EXPECTED_WARNINGS.get(name, "^$"), m) for m in ours), ours
    assert all(math.isfinite(float(v.float().sum())) for v in module.state_dict().values() if v.is_floating_point())
    if name == "NonFiniteGuard":
        assert piece.skipped_steps == 2  # "skipped so far" by this callback: both fits' bad steps
    if name == "MFUMonitor":
        assert piece.total_tokens == _real_tokens(shape)  # not carried over from the first fit


@pytest.mark.parametrize("name", sorted(PIECES))
def test_each_piece_builds_from_yaml_through_the_gpuopt_cli(name, tmp_path, text_dir):
    """`gpuopt fit --config` with the piece named in YAML builds it into the Trainer (nothing runs)."""
    from lightning_gpuopt.cli.main import GPTCLI
    from lightning_gpuopt.data import TextDataModule
    from lightning_gpuopt.model import GPTModule

    _, is_plugin = PIECES[name]
    package = {"AtomicCheckpointIO": "checkpoint"}.get(name, "precision") if is_plugin else "callbacks"
    group = "plugins" if is_plugin else "callbacks"
    config = tmp_path / "piece.yaml"
    config.write_text(
        f"trainer:\n  max_steps: 1\n  default_root_dir: {tmp_path}\n"
        f"  {group}:\n    - class_path: lightning_gpuopt.{package}.{name}\n"
        f"data:\n  source: {text_dir}\n  vocab_size: 300\n  block_size: 32\n"
        + ("  # emulated float8 on the CPU\n" if name == "Float8Precision" else "")
    )
    args = ["--config", str(config)]
    if name == "Float8Precision":
        args += ["--trainer.plugins.init_args.emulate", "true"]
    before = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    cli = GPTCLI(GPTModule, TextDataModule, run=False, args=args)
    trainer = cli.trainer
    found = [trainer.precision_plugin, trainer.strategy.checkpoint_io] if is_plugin else trainer.callbacks
    pieces = [p for p in found if type(p).__name__ == name]
    assert len(pieces) == 1  # ExactResume and SigtermCheckpoint, which gpuopt always adds, are not doubled
    for cb in trainer.callbacks:  # undo what CUDASettings applied at construction (no fit ran to tear it down)
        if isinstance(cb, CUDASettings):
            cb._restore()
    assert (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()) == before
