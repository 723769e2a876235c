"""Hugging Face folders in and out (model/hf.py), against tiny random models built by transformers itself."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="these tests compare with transformers (the dev extra)")
pytest.importorskip("safetensors", reason="Hugging Face folders hold safetensors")

from lightning_gpuopt.model import GPT, CheckpointError, GPTConfig, HFError, load_hf, save_hf  # noqa: E402
from lightning_gpuopt.model.hf import END_OF_TEXT_TOKENS  # noqa: E402

VOCAB = 300  # not a multiple of 64: the GPT pads it to 320

FAMILIES = {
    # GPT-2, head tied (as every released GPT-2)
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4),
    # Llama with grouped KV heads (4 query heads, 2 key/value heads), an untied head and a RoPE theta of its own
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    ),
    # Llama 3.1/3.2: RoPE scaled ("llama3"), here from an original context of 16 so that it changes most frequencies
    "llama3.1": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    ),
    # Qwen2 (Qwen2.5's shape): biases on q/k/v only, grouped KV heads, RoPE theta 1e6, the head tied
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
}


def hf_model(family: str, seed: int = 0):
    """A tiny random transformers model, every weight moved off its initial value (biases and norm gains too)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(params=sorted(FAMILIES))
def hf_folder(request, tmp_path):
    model = hf_model(request.param)
    model.save_pretrained(tmp_path / request.param)
    return model, tmp_path / request.param


def _logits(hf, ids):
    with torch.no_grad():
        return hf(ids).logits


def test_load_hf_gives_the_models_logits_and_pads_the_vocabulary_with_zeros(hf_folder):
    hf, folder = hf_folder
    ours = load_hf(folder)
    assert ours.config.vocab_size == VOCAB and ours.config.padded_vocab_size == 320
    assert ours.config.n_kv_head == (4 if ours.config.fused_qkv else 2)  # grouped KV heads for Llama and Qwen2
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = ours(ids)
    torch.testing.assert_close(logits[..., :VOCAB], _logits(hf, ids), atol=1e-4, rtol=0)
    assert torch.count_nonzero(ours.transformer.wte.weight[VOCAB:]) == 0
    assert torch.count_nonzero(ours.lm_head.weight[VOCAB:]) == 0


def test_greedy_generation_is_transformers_token_for_token(hf_folder):
    hf, folder = hf_folder
    ours = load_hf(folder)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt),
                         pad_token_id=0)
    assert ours.generate(prompt, max_new_tokens=12, temperature=0).tolist() == theirs.tolist()


def test_save_hf_is_loaded_by_transformers_and_the_round_trip_is_bit_identical(hf_folder, tmp_path):
    hf, folder = hf_folder
    ours = load_hf(folder)
    out = save_hf(ours, tmp_path / "out", tokenizer=_tokenizer_json())
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(hf)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_logits(back, ids), _logits(hf, ids), atol=1e-4, rtol=0)
    for name, tensor in hf.state_dict().items():  # transformers -> ours -> transformers: every real row, to the bit
        assert torch.equal(back.state_dict()[name], tensor), name
    again = load_hf(out)  # ours -> transformers -> ours
    for name, tensor in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 3


def _tokenizer_json() -> str:
    """A tokenizer whose end-of-text token is id 3 (enough for the export's generation_config)."""
    from tokenizers import Tokenizer, models

    vocab = {"a": 0, "b": 1, "c": 2, END_OF_TEXT_TOKENS[0]: 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tokenizer.add_special_tokens([END_OF_TEXT_TOKENS[0]])
    return tokenizer.to_str()


@pytest.mark.parametrize("preset, hf_class", [
    ("tiny", "GPT2LMHeadModel"), ("llama-tiny", "LlamaForCausalLM"), ("qwen2-tiny", "Qwen2ForCausalLM")])
def test_a_gpt_of_our_own_goes_to_transformers_and_back(tmp_path, preset, hf_class):
    torch.manual_seed(0)
    ours = GPT(GPTConfig.from_name(preset, vocab_size=300, tie_embeddings=preset != "llama-tiny")).eval()
    with torch.no_grad():  # biases and norm gains off their initial zeros and ones
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    with pytest.warns(UserWarning, match="no tokenizer.json"):
        out = save_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == hf_class
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(_logits(back, ids), ours(ids)[..., :300], atol=1e-4, rtol=0)
    again = load_hf(out)
    for name, tensor in again.state_dict().items():  # the padding rows were trimmed and come back as zeros
        rows = tensor[:300] if name in ("transformer.wte.weight", "lm_head.weight") else tensor
        assert torch.equal(rows, ours.state_dict()[name][: rows.size(0)]), name


def test_sharded_folders_load(tmp_path):
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    ids = torch.randint(0, VOCAB, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(load_hf(tmp_path / "sharded")(ids)[..., :VOCAB], _logits(hf, ids), atol=1e-4, rtol=0)


# --------------------------------------------------------------------------------------------- bad input
@pytest.fixture
def llama_folder(tmp_path):
    hf_model("llama").save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_a_pickle_only_folder_is_refused_without_unpickling(llama_folder):
    (llama_folder / "model.safetensors").rename(llama_folder / "pytorch_model.bin")
    with pytest.raises(HFError, match=r"only as pickles \(pytorch_model.bin\).*safetensors"):
        load_hf(llama_folder)


def test_an_unsupported_architecture_is_named(llama_folder):
    _edit_config(llama_folder, architectures=["MixtralForCausalLM"])
    with pytest.raises(HFError, match=r"MixtralForCausalLM.*supported are GPT2LMHeadModel, LlamaForCausalLM, "
                       "Qwen2ForCausalLM"):
        load_hf(llama_folder)


@pytest.mark.parametrize("changes, match", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 32.0}}, "RoPE scaling of type 'yarn'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0}}, "RoPE scaling of type 'llama3'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"head_dim": 32}, "head_dim=32.*hidden_size / num_attention_heads = 16"),
])
def test_an_unsupported_field_is_named(llama_folder, changes, match):
    _edit_config(llama_folder, **changes)
    with pytest.raises(HFError, match=match):
        load_hf(llama_folder)


def test_weights_that_do_not_match_the_config_are_refused_before_any_is_read(llama_folder, monkeypatch):
    _edit_config(llama_folder, vocab_size=256)
    import safetensors

    def no_reading(*args, **kwargs):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(safetensors.safe_open, "get_tensor", no_reading, raising=False)
    with pytest.raises(HFError, match=r"model.embed_tokens.weight \[300, 64\] in the folder, \[256, 64\] expected"):
        load_hf(llama_folder)


def test_an_unwritable_or_taken_output_is_refused_before_work(llama_folder, tmp_path):
    model = load_hf(llama_folder)
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(HFError, match="is not a folder"):
        save_hf(model, tmp_path / "a_file" / "out", tokenizer=_tokenizer_json())
    with pytest.raises(HFError, match="exists and is not an empty folder"):
        save_hf(model, llama_folder, tokenizer=_tokenizer_json())
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary folder left


def test_the_exported_folder_is_readable_by_others_as_save_pretrained_writes_it(llama_folder, tmp_path):
    """A temporary folder and safetensors' file are private (0700, 0600); a folder handed to a server run by another
    user must have the modes the umask gives, as transformers' save_pretrained leaves them."""
    old = os.umask(0o022)
    try:
        out = save_hf(load_hf(llama_folder), tmp_path / "out", tokenizer=_tokenizer_json())
    finally:
        os.umask(old)
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {
        name: oct(0o644) for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")}


def test_hf_names_are_refused_clearly_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(HFError, match=r"'hf:no-such-org/no-such-model' could not be downloaded.*HF_HUB_OFFLINE"):
        load_hf("hf:no-such-org/no-such-model")


def test_the_end_of_text_tokens_are_the_data_modules():
    from lightning_gpuopt.data.tokenizer import END_OF_TEXT_TOKENS as DATA_TOKENS

    assert END_OF_TEXT_TOKENS == DATA_TOKENS


def test_nonfinite_weights_are_refused(llama_folder):
    from safetensors.torch import load_file, save_file

    tensors = load_file(llama_folder / "model.safetensors")
    tensors["model.norm.weight"][3] = float("nan")
    save_file(tensors, llama_folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError,
                       match=r"'transformer.ln_f.weight' holds NaN/Inf.*\n.*\nTo read the file anyway: safetensors"):
        load_hf(llama_folder)


def test_permissions_are_checked_for_non_root(llama_folder, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(HFError, match="cannot be written"):
        save_hf(load_hf(llama_folder), locked / "out", tokenizer=_tokenizer_json())


def test_save_hf_gathers_an_fsdp2_checkpoint_folder_on_the_cpu(fsdp2_trainer, tmp_path):
    from lightning_gpuopt.checkpoint import AtomicModelParallelStrategy
    from tests.precision._helpers import tiny_gpt_module, token_loader

    torch.manual_seed(0)
    module = tiny_gpt_module(preset="llama-tiny", vocab_size=300)
    trainer = fsdp2_trainer(AtomicModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1), max_steps=1)
    trainer.fit(module, token_loader(n_seq=8, batch_size=4))
    trainer.save_checkpoint(tmp_path / "sharded.ckpt")
    assert (tmp_path / "sharded.ckpt").is_dir()
    full = {k: v.full_tensor() for k, v in module.model.state_dict().items()}
    out = save_hf(tmp_path / "sharded.ckpt", tmp_path / "out", tokenizer=_tokenizer_json())
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    down = back.state_dict()["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(down, full["transformer.h.1.mlp.c_proj.weight"])
    assert torch.equal(back.state_dict()["model.embed_tokens.weight"], full["transformer.wte.weight"][:300])


def test_gptmodule_from_a_folder_takes_its_architecture_and_refuses_other_sizes(llama_folder):
    from lightning_gpuopt.model import GPTModule

    module = GPTModule(init_from=str(llama_folder), vocab_size=280, block_size=32)  # the data's sizes: they fit
    assert module.hparams.architecture["n_kv_head"] == 2 and module.config.vocab_size == VOCAB
    assert module.config.block_size == 64 and module.config.rope_theta == 50000.0
    module.configure_model()
    torch.testing.assert_close(module.model.transformer.ln_f.weight, hf_model("llama").model.norm.weight)
    with pytest.raises(ValueError, match=r"GPTModule.n_layer=3 differ from the architecture given whole \(n_layer=2"):
        GPTModule(init_from=str(llama_folder), n_layer=3)


def test_save_hf_writes_bfloat16_weights_that_transformers_loads_as_such(llama_folder, tmp_path):
    ours = load_hf(llama_folder)
    out = save_hf(ours, tmp_path / "bf16", tokenizer=_tokenizer_json(), dtype=torch.bfloat16)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert back.dtype == torch.bfloat16
    assert torch.equal(back.model.norm.weight, ours.transformer.ln_f.weight.to(torch.bfloat16))
