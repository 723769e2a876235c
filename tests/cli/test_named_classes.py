"""`gpuopt` with a LightningModule and data module of your own: which classes a command names, and a
module from a package of the user's trained with the default stack, stopped by SIGTERM and resumed exactly."""

from __future__ import annotations

import importlib.util
import signal
import sys
import textwrap

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gpuopt.callbacks import CUDASettings, ExactResume, MFUMonitor, NonFiniteGuard, SigtermCheckpoint
from lightning_gpuopt.checkpoint import AtomicCheckpointIO
from lightning_gpuopt.cli.main import main, make_cli
from lightning_gpuopt.cli.named_classes import NamedClasses, named_classes
from tests._module_shapes import SHAPES, T, NoForwardModule, hand_flops_per_token
from tests._paths import REPO

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers.*", "ignore:.*has no bf16 peak FLOP/s.*", "ignore:.*is not resumable.*",
    "ignore:.*smaller than the logging interval.*",
)

# A package of the user's: a module with dropout (so the RNG must resume too) and shuffled data.
USER_PACKAGE = '''
import lightning.pytorch as pl
import os, signal
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class CharLM(pl.LightningModule):
    def __init__(self, vocab: int = 64, width: int = 32, sigterm_at_step: int = -1):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Embedding(vocab, width), nn.Dropout(0.2), nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, vocab))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).flatten(0, 1), y.flatten())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.global_step == self.hparams.sigterm_at_step:
            os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends at the end of a job's time

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Chars(pl.LightningDataModule):
    def __init__(self, batch_size: int = 4, seq: int = 16):
        super().__init__()
        self.batch_size, self.seq = batch_size, seq

    def train_dataloader(self):
        data = torch.randint(0, 64, (40, self.seq + 1), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=self.batch_size, shuffle=True)
'''


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    package = tmp_path / "pkg" / "my_models"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(USER_PACKAGE)
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    monkeypatch.chdir(tmp_path)
    yield "my_models"
    sys.modules.pop("my_models", None)


def _quiet(root) -> list[str]:
    return ["--trainer.default_root_dir", str(root), "--trainer.accelerator", "cpu", "--trainer.devices", "1",
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false"]


def test_named_classes_reads_flags_configs_and_environment(tmp_path):
    assert named_classes(["fit", "--model.preset", "tiny"], {}) == NamedClasses()
    assert named_classes(["fit", "--model", "a.B", "--data=c.D"], {}) == NamedClasses("a.B", "c.D")
    assert named_classes(["fit", "--model.class_path=a.B", "--data.class_path", "c.D"], {}) == NamedClasses("a.B", "c.D")
    after = tmp_path / "after.yaml"
    after.write_text("model:\n  class_path: a.B\ndata: c.D\n")
    assert named_classes(["fit", "--config", str(after)], {}) == NamedClasses("a.B", "c.D")
    before = tmp_path / "before.yaml"  # a --config before the subcommand holds one mapping per subcommand
    before.write_text("fit:\n  model:\n    class_path: a.B\n")
    assert named_classes(["--config", str(before), "fit"], {}) == NamedClasses("a.B", None)
    recipe = REPO / "examples" / "configs" / "quickstart.yaml"
    assert named_classes(["fit", "--config", str(recipe)], {}) == NamedClasses()
    assert named_classes(["fit"], {"GPUOPT_FIT__MODEL__CLASS_PATH": "a.B", "GPUOPT_FIT__DATA": "c.D"}) == NamedClasses("a.B", "c.D")
    # TextDataModule is named to train a module of your own on it; with GPTModule it is the default and refused.
    assert named_classes(["fit", "--model", "a.B", "--data", "TextDataModule"], {}) == NamedClasses("a.B", "TextDataModule")
    for args in (["--model", "lightning_gpuopt.GPTModule"], ["--data.class_path", "lightning_gpuopt.data.TextDataModule"]):
        with pytest.raises(ValueError, match="gpuopt's default .* and takes its options directly: drop the class path"):
            named_classes(["fit", *args], {})


def test_user_module_trains_with_the_stack_survives_sigterm_and_resumes_exactly(user_package, tmp_path):
    """`gpuopt fit --model.class_path my_models.CharLM`: the default stack; a SIGTERM at step 3 saves last.ckpt
    and exits 143; `--ckpt_path last` continues to the same weights as a run that was never stopped."""
    common = ["fit", "--model.class_path", f"{user_package}.CharLM", "--data.class_path", f"{user_package}.Chars",
              "--trainer.max_steps", "7"]
    cli = make_cli([*common, *_quiet(tmp_path / "straight")])
    callbacks = [type(c) for c in cli.trainer.callbacks]
    for piece in (CUDASettings, MFUMonitor, NonFiniteGuard, ModelCheckpoint, ExactResume, SigtermCheckpoint):
        assert callbacks.count(piece) == 1, piece
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO) and cli.trainer.global_step == 7
    mfu = next(c for c in cli.trainer.callbacks if isinstance(c, MFUMonitor))
    assert mfu.total_tokens == 7 * 4 * 16

    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stopped:
            main([*common, "--model.sigterm_at_step", "3", *_quiet(tmp_path / "stopped")])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 128 + signal.SIGTERM
    last = tmp_path / "stopped" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 3
    main([*common, *_quiet(tmp_path / "stopped"), "--ckpt_path", "last"])

    straight = torch.load(tmp_path / "straight" / "checkpoints" / "last.ckpt", weights_only=True)
    resumed = torch.load(last, weights_only=True)
    assert resumed["global_step"] == straight["global_step"] == 7
    assert resumed["state_dict"].keys() == straight["state_dict"].keys()
    for name, value in straight["state_dict"].items():
        assert torch.equal(resumed["state_dict"][name], value), name


def test_user_module_print_config_and_own_loaders(user_package, tmp_path, capsys):
    """`--model X` alone: the module's own loaders (none here: Lightning says so); --print_config shows the class."""
    with pytest.raises(SystemExit) as printed:
        main(["fit", "--model", f"{user_package}.CharLM", "--model.width", "48", "--trainer.max_steps", "1", "--print_config"])
    assert printed.value.code == 0
    out = capsys.readouterr().out
    assert f"class_path: {user_package}.CharLM" in out and "width: 48" in out and "rebuild_loaders: true" in out
    assert "lightning_gpuopt.callbacks.MFUMonitor" in out


@pytest.mark.parametrize("shape", sorted({**SHAPES, "noforward": None}))
def test_contract_shapes_through_gpuopt(shape, tmp_path, monkeypatch):
    """Each module shape of tests/_module_shapes.py, named by class path, trains through `gpuopt fit` with the stack,
    MFUMonitor counting its FLOPs per token, and writes a last.ckpt that loads with weights_only=True."""
    monkeypatch.chdir(tmp_path)
    module = NoForwardModule if shape == "noforward" else SHAPES[shape]
    data_shape = "litgpt" if shape == "noforward" else shape
    cli = make_cli(["fit", "--model", f"tests._module_shapes.{module.__name__}", "--data", "tests._module_shapes.LoaderData",
                    "--data.shape", data_shape, "--data.batch_size", "2", "--trainer.max_steps", "2", *_quiet(tmp_path)])
    assert type(cli.model) is module and cli.trainer.global_step == 2
    mfu = next(c for c in cli.trainer.callbacks if isinstance(c, MFUMonitor))
    assert mfu.total_tokens == 2 * 2 * T
    assert mfu.total_flops / mfu.total_tokens == pytest.approx(hand_flops_per_token(cli.model), rel=0.03)
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 2 and "ExactResume" in str(list(saved["callbacks"]))


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="the hf-llama recipe needs transformers (pip install transformers)")
def test_hf_llama_recipe_trains_through_gpuopt(tmp_path, text_dir, cache_dir, monkeypatch):
    """examples/configs/hf-llama.yaml: a Hugging Face LlamaForCausalLM built locally, trained with the whole stack."""
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    monkeypatch.chdir(tmp_path)
    recipe = REPO / "examples" / "configs" / "hf-llama.yaml"
    cli = make_cli(["fit", "--config", str(recipe), "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0",
                    "--model.vocab_size", "300", "--model.block_size", "32", "--model.hidden_size", "64",
                    "--data.source", str(text_dir), "--data.vocab_size", "300", "--data.block_size", "32",
                    "--data.batch_size", "2", "--data.num_workers", "0", *_quiet(tmp_path)])
    sys.modules.pop("hf_llama", None)
    assert type(cli.model.model).__name__ == "LlamaForCausalLM" and cli.trainer.global_step == 2
    names = {type(c).__name__ for c in cli.trainer.callbacks}
    assert {"CUDASettings", "MFUMonitor", "NonFiniteGuard", "ModelCheckpoint", "ExactResume", "SigtermCheckpoint"} <= names
    mfu = next(c for c in cli.trainer.callbacks if isinstance(c, MFUMonitor))
    assert mfu.total_tokens == 2 * 2 * 32 and mfu.total_flops > 0
    assert 3.0 < float(cli.trainer.callback_metrics["train/loss"]) < 8.0  # about ln(300) = 5.7 at the start


def test_fit_help_says_near_the_top_that_the_model_can_be_a_class_of_ones_own(capsys):
    """The help is some 800 lines of options; what --model takes was nowhere in it."""
    from lightning_gpuopt.cli.main import main

    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    top = " ".join(capsys.readouterr().out.splitlines()[:10])
    assert top.startswith("usage: gpuopt fit [--config FILE] [--model CLASS] [--data CLASS]")
    assert "--model my_pkg.MyModule trains any LightningModule" in top and "--data my_pkg.MyData" in top
