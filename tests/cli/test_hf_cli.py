"""`gpuopt fit --model.init_from <Hugging Face folder>` end to end (fine-tune, resume, predict, load_gpt) and
`gpuopt export` back to transformers, on a tiny Llama built by transformers, its tokenizer ending texts as Llama 3's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="these tests compare with transformers (the dev extra)")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from lightning_gpuopt import GPTModule, TextDataModule  # noqa: E402
from lightning_gpuopt.cli.main import GPTCLI, main  # noqa: E402
from lightning_gpuopt.data.sources import resolve_source  # noqa: E402
from lightning_gpuopt.model import load_gpt  # noqa: E402

EOT = "<|end_of_text|>"  # Llama 3's: not GPT-2's <|endoftext|>


def _llama_tokenizer(text_dir: Path) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((p.read_text() for p in sorted(text_dir.glob("*.txt"))), trainer=trainer)
    return tokenizer


@pytest.fixture
def llama_folder(tmp_path, text_dir):
    """A tiny random Llama (grouped KV heads, vocabulary 320: the tokenizer's ~300 fit) with its tokenizer.json."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    folder = tmp_path / "hf_llama"
    model.save_pretrained(folder)
    _llama_tokenizer(text_dir).save(str(folder / "tokenizer.json"))
    return model, folder


def _args(text_dir: Path, root: Path, *extra: str) -> list[str]:
    return [
        "--data.source", str(text_dir), "--data.block_size", "32", "--data.batch_size", "4", "--data.num_workers", "0",
        "--trainer.default_root_dir", str(root), "--model.warmup_steps", "1", "--trainer.accelerator", "cpu",
        "--trainer.devices", "1", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.limit_val_batches", "0",
        "--trainer.callbacks+=ModelCheckpoint",
        "--trainer.callbacks.dirpath", str(root / "ckpt"), "--trainer.callbacks.every_n_train_steps", "2",
        "--trainer.callbacks.save_top_k", "-1", *extra,
    ]


def _cli(args: list[str]) -> GPTCLI:
    return GPTCLI(GPTModule, TextDataModule, save_config_kwargs={"overwrite": True}, args=args)


def test_fine_tune_a_hugging_face_llama_resume_predict_and_export_it_back(llama_folder, tmp_path, text_dir, cache_dir,
                                                                          monkeypatch, capsys):
    hf, folder = llama_folder
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "run"
    cli = _cli(["fit", *_args(text_dir, root, "--trainer.max_steps", "2", "--model.learning_rate", "1e-4"),
                "--model.init_from", str(folder)])
    assert cli.model.config.arch == "llama" and cli.model.config.n_kv_head == 2 and cli.model.config.vocab_size == 320
    assert cli.datamodule.tokenizer_path == str(folder / "tokenizer.json")
    assert cli.datamodule.eot_id == cli.datamodule.tokenizer.token_to_id(EOT)
    trained = cli.model.model.state_dict()
    start = hf.state_dict()["model.layers.0.self_attn.k_proj.weight"]
    moved = (trained["transformer.h.0.attn.k_proj.weight"] - start).abs().max()
    assert 0 < moved < 5e-3  # started from the folder's weights (a fresh init is 0.02 away), and trained
    ckpt = root / "ckpt" / "epoch=0-step=2.ckpt"

    resumed = _cli(["fit", *_args(text_dir, root, "--trainer.max_steps", "4"), "--ckpt_path", str(ckpt)])
    assert resumed.trainer.global_step == 4 and resumed.model.config == cli.model.config  # the imported architecture

    gpt = load_gpt(root / "ckpt" / "epoch=0-step=4.ckpt")
    assert gpt.config.arch == "llama" and gpt.config.n_kv_head == 2 and gpt.config.vocab_size == 320

    predicted = _cli(["predict", *_args(text_dir, root), "--ckpt_path", str(root / "ckpt" / "epoch=0-step=4.ckpt"),
                      "--model.max_new_tokens", "3", "--model.temperature", "0", "--data.prompts", "[the model]"])
    samples = [s for batch in predicted.trainer.predict_loop.predictions for s in batch]
    prompt = predicted.datamodule.encode("the model")
    expected = gpt.generate(torch.tensor([prompt]), max_new_tokens=3, temperature=0)[0]
    assert torch.equal(samples[0], expected)

    out = tmp_path / "exported"
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(root / "ckpt" / "epoch=0-step=4.ckpt"), str(out)])
    assert exit_.value.code == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, gpt(ids)[..., :320], atol=1e-4, rtol=0)
    assert (out / "tokenizer.json").read_text() == predicted.datamodule.tokenizer.to_str()


def test_a_folder_without_tokenizer_needs_data_tokenizer(llama_folder, tmp_path, text_dir, cache_dir, monkeypatch):
    _, folder = llama_folder
    monkeypatch.chdir(tmp_path)
    tokenizer = tmp_path / "tokenizer.json"
    (folder / "tokenizer.json").rename(tokenizer)
    with pytest.raises(ValueError, match=r"has no tokenizer.json.*--data.tokenizer PATH/tokenizer.json"):
        _cli(["fit", *_args(text_dir, tmp_path / "run", "--trainer.max_steps", "1"), "--model.init_from", str(folder)])
    cli = _cli(["fit", *_args(text_dir, tmp_path / "run", "--trainer.max_steps", "1"), "--model.init_from", str(folder),
                "--data.tokenizer", str(tokenizer)])
    assert cli.trainer.global_step == 1


def test_a_folder_and_an_architecture_option_are_refused(llama_folder, tmp_path, text_dir, cache_dir, monkeypatch):
    _, folder = llama_folder
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"config.json sets the architecture, and this run asks model.n_layer=3"):
        _cli(["fit", *_args(text_dir, tmp_path / "run", "--trainer.max_steps", "1"), "--model.init_from", str(folder),
              "--model.n_layer", "3"])


def test_a_tokenizer_larger_than_the_folders_vocabulary_is_refused(llama_folder, tmp_path, text_dir, cache_dir,
                                                                   monkeypatch):
    _, folder = llama_folder
    monkeypatch.chdir(tmp_path)
    big = _llama_tokenizer(text_dir)
    big.add_tokens([f"extra{i}" for i in range(64)])  # past the model's 320 rows
    big.save(str(folder / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"tokenizer has \d+ tokens but the model's vocab_size is 320"):
        _cli(["fit", *_args(text_dir, tmp_path / "run", "--trainer.max_steps", "1"), "--model.init_from", str(folder)])


def test_export_refuses_an_unwritable_output_before_reading(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(tmp_path / "none.ckpt"), str(tmp_path / "a_file" / "out")])
    assert exit_.value.code == 2
    assert "a_file' is not a folder" in capsys.readouterr().err


def test_export_into_a_folder_another_writer_holds_is_refused_with_its_pid(tmp_path, capsys):
    from lightning_gpuopt.run import hold_output

    out = tmp_path / "out"
    with hold_output(out, "gpuopt export", "OUT_DIR"):  # a second open of the lock is refused as another process is
        with pytest.raises(SystemExit) as exit_:
            main(["export", str(tmp_path / "none.ckpt"), str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{out} is being written by another gpuopt export (pid " in err and "OUT_DIR" in err
    assert "lines" not in err and "overwriting" not in err  # a folder written whole; export has no overwrite
    assert not out.exists()


def test_export_removes_what_a_killed_export_left_beside_its_output(tmp_path, capsys):
    """A ``kill -9`` mid-export leaves its temporary folder (a whole model's weights, hidden); the next export into the
    same output holds its lock, so no live writer can own that folder: it is removed, and nothing else is."""
    torch.manual_seed(0)
    module = GPTModule(preset="tiny", vocab_size=64, block_size=32)
    module.configure_model()
    ckpt = tmp_path / "a.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, ckpt)
    out = tmp_path / "out"
    killed = tmp_path / ".out.export-k1ll3d"  # the name a killed export's temporary folder has
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"half")
    (tmp_path / ".out.notes").write_text("a file of the user's")
    with pytest.warns(UserWarning, match="no tokenizer"), pytest.raises(SystemExit) as exit_:
        main(["export", str(ckpt), str(out)])
    assert exit_.value.code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.notes", "a.ckpt", "out"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
