"""Package checkpoints: weights_only loading, load_gpt into a plain GPT, compiled keys, clear errors for broken
or foreign files."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gpuopt import GPT, GPTConfig, GPTModule, TextDataModule
from lightning_gpuopt.callbacks import MFUMonitor, NonFiniteGuard
from lightning_gpuopt.model.checkpoint import CheckpointError, gpt_state_dict, load_gpt
from lightning_gpuopt.checkpoint import AtomicCheckpointIO


def _fit(tmp_path, cache_dir, text_dir, max_steps=4, ckpt_path=None, **fit_kw):
    data = TextDataModule(source=str(text_dir), block_size=32, batch_size=4, vocab_size=300, num_workers=0, cache_dir=str(cache_dir))
    model = GPTModule(preset="tiny", vocab_size=300, block_size=32, warmup_steps=0)
    trainer = pl.Trainer(
        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=tmp_path, plugins=[AtomicCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True), NonFiniteGuard(), MFUMonitor(log_every_n_steps=2)],
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path, **fit_kw)
    return trainer, model


@pytest.fixture
def package_ckpt(tmp_path, cache_dir, text_dir):
    trainer, model = _fit(tmp_path, cache_dir, text_dir)
    return tmp_path / "ckpt" / "last.ckpt", model


def test_package_checkpoint_loads_weights_only_and_into_a_plain_gpt(package_ckpt, tmp_path, cache_dir, text_dir):
    path, module = package_ckpt
    raw = torch.load(path, weights_only=True)  # everything the package writes is weights_only-safe
    assert raw["global_step"] == 4 and raw["hyper_parameters"]["preset"] == "tiny"
    assert any("NonFiniteGuard" in k for k in raw["callbacks"])
    gpt = load_gpt(path)
    assert type(gpt) is GPT and not gpt.training and gpt.config.vocab_size == 300 and gpt.config.block_size == 32
    assert gpt.lm_head.weight is gpt.transformer.wte.weight  # still tied
    idx = torch.randint(0, 300, (2, 16))
    module.model.eval()
    with torch.no_grad():
        assert torch.equal(gpt(idx), module.model(idx))
    # Resuming through the Trainer with weights_only=True works as well.
    trainer, _ = _fit(tmp_path, cache_dir, text_dir, max_steps=6, ckpt_path=str(path), weights_only=True)
    assert trainer.global_step == 6


def test_compiled_keys_are_stripped():
    gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    compiled = torch.compile(gpt)  # an OptimizedModule wrapper: keys gain "_orig_mod."
    ckpt = {"state_dict": {f"model.{k}": v for k, v in compiled.state_dict().items()}}
    assert all("_orig_mod" in k for k in ckpt["state_dict"])
    assert gpt_state_dict(ckpt).keys() == gpt.state_dict().keys()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p, good: p.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2]), "truncated or corrupt"),
        (lambda p, good: p.write_text("model:\n  preset: tiny\n"), "not a PyTorch checkpoint"),
        (lambda p, good: p.write_bytes(b""), "is empty"),
        (lambda p, good: torch.save({"weights": torch.ones(2)}, p), "not a GPTModule checkpoint"),
        (lambda p, good: torch.save({"x": GPTConfig()}, p), "weights_only=False"),
        (lambda p, good: None, "does not exist"),
        (lambda p, good: p.mkdir(), "is a directory"),
    ],
    ids=["truncated", "foreign-text", "empty", "foreign-torch", "unsafe-pickle", "missing", "directory"],
)
def test_broken_or_foreign_files_give_clear_errors(tmp_path, make, match):
    good = tmp_path / "good.ckpt"
    ckpt = {"hyper_parameters": {"preset": "tiny"}, "state_dict": {f"model.{k}": v for k, v in GPT(GPTConfig.from_name("tiny")).state_dict().items()}}
    torch.save(ckpt, good)
    bad = tmp_path / "bad.ckpt"
    make(bad, good)
    with pytest.raises(CheckpointError, match=match):
        load_gpt(bad)
    assert isinstance(CheckpointError("x"), ValueError)


def test_a_sharded_checkpoint_folder_names_the_command_that_consolidates_it_and_that_command_works(tmp_path):
    """A distributed checkpoint as Lightning's ModelParallelStrategy writes it (the shards, and meta.pt with the
    hyper-parameters): the message's command makes a file load_gpt reads. torch's dcp_to_torch_save, which it named
    before, drops meta.pt, and its file was "not a GPTModule checkpoint"."""
    import subprocess
    import sys

    import torch.distributed.checkpoint as dcp

    gpt = GPT(GPTConfig.from_name("tiny"))
    folder = tmp_path / "last.ckpt"
    dcp.save({"state_dict": {f"model.{k}": v for k, v in gpt.state_dict().items()}}, checkpoint_id=folder, no_dist=True)
    torch.save({"hyper_parameters": {"preset": "tiny"}, "global_step": 3}, folder / "meta.pt")
    with pytest.raises(CheckpointError, match=r"is a directory .*`python -m lightning.fabric.utilities.consolidate_checkpoint") as info:
        load_gpt(folder)
    command = str(info.value).split("`")[1].split()
    subprocess.run([sys.executable, *command[1:]], check=True, capture_output=True)
    loaded = load_gpt(str(folder) + ".consolidated")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), gpt.state_dict().values()))


def test_missing_weights_are_named(tmp_path):
    state = {f"model.{k}": v for k, v in GPT(GPTConfig.from_name("tiny")).state_dict().items()}
    del state["model.transformer.h.1.mlp.c_fc.weight"]
    torch.save({"hyper_parameters": {"preset": "tiny"}, "state_dict": state}, tmp_path / "m.ckpt")
    with pytest.raises(CheckpointError, match=r"'transformer.h.1.mlp.c_fc.weight' is missing from the file"):
        load_gpt(tmp_path / "m.ckpt")


def test_a_llama_style_run_loads_into_a_plain_gpt(tmp_path):
    """GPTModule(preset="llama-tiny", n_kv_head=...) trains, saves, and load_gpt rebuilds the same model from the hparams."""
    from tests.precision._helpers import token_loader

    module = GPTModule(preset="llama-tiny", n_kv_head=1, vocab_size=256, block_size=32, warmup_steps=0)
    trainer = pl.Trainer(max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])
    trainer.fit(module, train_dataloaders=token_loader(n_seq=8, batch_size=4))
    gpt = load_gpt(tmp_path / "ckpt" / "last.ckpt")
    assert (gpt.config.arch, gpt.config.n_kv_head, gpt.config.rope_theta) == ("llama", 1, 10000.0)
    assert gpt.transformer.h[0].attn.k_proj.weight.shape == (16, 64)  # one key/value head of 16
    idx = torch.randint(0, 256, (2, 16))
    module.model.eval()
    with torch.no_grad():
        assert torch.equal(gpt(idx), module.model(idx))


_BAD_TENSOR = "transformer.h.1.mlp.c_proj.weight"


def _checkpoint_with(tmp_path, value: float, **arch):
    """A GPTModule checkpoint (tiny, vocabulary 64, block 32) with ``value`` in one weight of ``_BAD_TENSOR``."""
    torch.manual_seed(0)
    module = GPTModule(preset="tiny", vocab_size=64, block_size=32, **arch)
    module.configure_model()
    state = {f"model.{k}": v.clone() for k, v in module.model.state_dict().items()}
    state[f"model.{_BAD_TENSOR}"][0, 0] = value
    path = tmp_path / "bad.ckpt"
    torch.save({"pytorch-lightning_version": "2.6.6", "global_step": 3, "epoch": 0, "hyper_parameters": dict(module.hparams),
                "state_dict": state, "loops": {}, "optimizer_states": [], "lr_schedulers": []}, path)
    return path


def _loader():
    ids = torch.randint(0, 64, (4, 33))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=2)


def _trainer(**kw):
    return pl.Trainer(max_steps=4, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, **kw)


# Every door weights enter by, in Python: each refuses NaN/Inf weights with the same message.
_DOORS = {
    "init_from": lambda p: GPTModule(preset="tiny", vocab_size=64, block_size=32, init_from=str(p)).configure_model(),
    "load_gpt": lambda p: load_gpt(p),
    "fit-ckpt_path": lambda p: _trainer().fit(GPTModule(preset="tiny", vocab_size=64, block_size=32), _loader(), ckpt_path=p),
    "fit-ckpt_path-atomic-io": lambda p: _trainer(plugins=[AtomicCheckpointIO()]).fit(
        GPTModule(preset="tiny", vocab_size=64, block_size=32), _loader(), ckpt_path=p),
    "predict-ckpt_path": lambda p: _trainer().predict(GPTModule(preset="tiny", vocab_size=64, block_size=32), _loader(),
                                                       ckpt_path=p),
}


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("door", list(_DOORS))
def test_every_door_refuses_nonfinite_weights_naming_the_file_and_tensor(door, value, tmp_path):
    path = _checkpoint_with(tmp_path, value)
    with pytest.raises(CheckpointError) as info:
        _DOORS[door](path)
    lines = str(info.value).splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith(f"Weights of '{path}' refused: '") and "holds NaN/Inf (1 of " in lines[0]
    assert _BAD_TENSOR in lines[0] and lines[0].endswith("weight tensors do): the run that wrote them had diverged.")
    assert lines[1] == "Use an earlier checkpoint of that run, or start from other weights."
    assert lines[2].startswith("To read the file anyway: ")


def test_the_way_to_read_refused_weights_anyway_reads_them(tmp_path):
    path = _checkpoint_with(tmp_path, float("nan"))
    with pytest.raises(CheckpointError, match=r"To read the file anyway: load_gpt\(.*bad.ckpt', allow_nonfinite=True\)\.$"):
        load_gpt(path)
    gpt = load_gpt(path, allow_nonfinite=True)
    assert torch.isnan(gpt.state_dict()[_BAD_TENSOR][0, 0])
    with pytest.raises(CheckpointError, match=r"AtomicCheckpointIO\(allow_nonfinite=True\)\.$"):
        _DOORS["fit-ckpt_path-atomic-io"](path)
    io = AtomicCheckpointIO(allow_nonfinite=True)  # the option the message names: the weights are read
    assert torch.isnan(io.load_checkpoint(path)["state_dict"][f"model.{_BAD_TENSOR}"][0, 0])


@pytest.mark.parametrize("door", ["init_from", "load_gpt", "fit-ckpt_path"])
def test_every_door_refuses_weights_of_another_architecture_naming_the_tensor(door, tmp_path):
    path = _checkpoint_with(tmp_path, 0.0, n_embd=128)  # a wider model than the tiny one each door builds
    if door == "load_gpt":  # builds what the file describes: another architecture only through an override
        path_, call = path, lambda p: load_gpt(p, n_embd=64)
    else:
        path_, call = path, _DOORS[door]
    with pytest.raises(CheckpointError) as info:
        call(path_)
    lines = str(info.value).splitlines()
    assert len(lines) == 3
    assert "refused: they do not fit the model's architecture (arch=gpt2, n_layer=2, n_head=4, n_embd=64" in lines[0]
    assert "'transformer.wte.weight' is [64, 128] in the file and [64, 64] in the model" in lines[0]
    assert lines[1].startswith("Build the model with the file's architecture")
