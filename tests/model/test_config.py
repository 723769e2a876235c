import warnings

import pytest
import torch

from lightning_gpuopt.model import GPT, PRESETS, GPTConfig
from lightning_gpuopt.model.config import check_attention_runs
from lightning_gpuopt.perf.device import REFERENCE_DEVICES
from tests._paths import REPO

# (n_layer, n_embd) of each GPT-2 family preset, from the papers, not from PRESETS itself.
SHAPES = {"124m": (12, 768), "175m": (12, 1024), "355m": (24, 1024), "774m": (36, 1280), "1.5b": (48, 1600)}


def _meta_gpt(config: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(config)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_preset_parameter_counts(name):
    L, d = SHAPES[name]
    config = GPTConfig.from_name(name, vocab_size=50257)
    model = _meta_gpt(config)
    # per block: qkv 3d^2+3d, proj d^2+d, mlp 8d^2+5d, two LayerNorms 4d; plus the final LayerNorm
    non_embedding = L * (12 * d * d + 13 * d) + 2 * d
    assert model.num_params(non_embedding=True) == non_embedding
    assert model.num_params() == non_embedding + 50304 * d + 1024 * d  # tied head counted once


def test_gpt2_small_matches_the_known_count():
    # nanoGPT reports 124.48M parameters (123.69M non-embedding plus wpe) for GPT-2 small, padded vocab
    assert _meta_gpt(GPTConfig.from_name("124m")).num_params() == 124_475_904


def test_tiny_preset_dims_are_multiples_of_16():
    c = GPTConfig.from_name("tiny")
    assert c.n_embd % 16 == 0 and c.head_size % 16 == 0 and c.padded_vocab_size % 16 == 0


def test_vocab_is_padded_to_multiple_of_64():
    assert GPTConfig(vocab_size=50257).padded_vocab_size == 50304
    assert GPTConfig(vocab_size=4096).padded_vocab_size == 4096
    assert GPTConfig(vocab_size=100, padding_multiple=16).padded_vocab_size == 112


def test_presets_are_all_valid():
    for name in PRESETS:
        assert GPTConfig.from_name(name).n_embd == PRESETS[name]["n_embd"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_embd=100, n_head=12), "n_embd=100 is not divisible by n_head=12"),
        (dict(n_layer=0), "GPTConfig.n_layer must be an integer >= 1, got 0"),
        (dict(n_head=-2), "n_head must be an integer >= 1, got -2"),
        (dict(block_size=1.5), "block_size must be an integer >= 1, got 1.5"),
        (dict(vocab_size=True), "vocab_size must be an integer >= 1, got True"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
        (dict(attention="xformers"), "GPTConfig.attention must be 'sdpa' or 'flash-attn', got 'xformers'"),
    ],
)
def test_config_validation_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_divisibility_error_suggests_heads():
    with pytest.raises(ValueError, match=r"choose n_head from \[1, 2, 4, 5, 10, 20, 25, 50\]"):
        GPTConfig(n_embd=100, n_head=3)


def test_from_name_errors():
    with pytest.raises(ValueError, match="Unknown GPT preset '7b'"):
        GPTConfig.from_name("7b")
    with pytest.raises(ValueError, match=r"Unknown GPTConfig field\(s\) \['n_embed'\]"):
        GPTConfig.from_name("tiny", n_embed=64)
    with pytest.raises(ValueError, match="padded_vocab_size"):
        GPTConfig.from_name("tiny", padded_vocab_size=64)


def test_readme_preset_table_is_what_the_code_computes():

    from lightning_gpuopt.model.summary import preset_table

    readme = (REPO / "README.md").read_text()
    table = readme.split("<!-- presets:start -->\n")[1].split("\n<!-- presets:end -->")[0]
    assert table == preset_table(), "regenerate with: python -m lightning_gpuopt.model.summary"


def flash_config() -> GPTConfig:
    """A tiny config asking for flash-attn, built without the package (the import is checked at construction)."""
    config = GPTConfig.from_name("tiny")
    config.attention = "flash-attn"
    return config


FLASH_DEVICES = {"H100 SXM", "H200", "A100", "L4"}  # compute capability 8.0 or newer


@pytest.mark.parametrize("device", sorted(REFERENCE_DEVICES))
def test_flash_attn_runs_on_ampere_or_newer_in_half_precision_only(device):
    facts = REFERENCE_DEVICES[device]
    for dtype in ("bf16", "fp16", "fp8", "fp32", "tf32"):
        check_attention_runs(GPTConfig.from_name("tiny"), facts, dtype)  # sdpa runs everywhere
        if device not in FLASH_DEVICES:
            with pytest.raises(ValueError, match=r"compute capability 8.0 or newer .*use GPTModule\(attention='sdpa'\)"):
                check_attention_runs(flash_config(), facts, dtype)
        elif dtype in ("fp32", "tf32"):
            with pytest.raises(ValueError, match=rf"computes in {dtype} .*use bf16 precision .*or GPTModule\(attention='sdpa'\)"):
                check_attention_runs(flash_config(), facts, dtype)
        else:
            check_attention_runs(flash_config(), facts, dtype)


def test_flash_attn_with_an_unknown_compute_dtype_warns():
    with pytest.warns(UserWarning, match="does not say its compute dtype"):
        check_attention_runs(flash_config(), REFERENCE_DEVICES["H100 SXM"], None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_attention_runs(flash_config(), REFERENCE_DEVICES["H100 SXM"], "bf16")


# ------------------------------------------------------------------------------ the architecture as capabilities
def test_each_family_names_its_capabilities_and_a_field_overrides_them():
    gpt2, llama = GPTConfig.from_name("tiny"), GPTConfig.from_name("llama-tiny")
    caps = ("positions", "norm", "mlp", "fused_qkv", "qkv_bias", "attn_out_bias", "mlp_bias", "norm_bias")
    assert [getattr(gpt2, c) for c in caps] == ["learned", "layernorm", "gelu", True, True, True, True, True]
    assert [getattr(llama, c) for c in caps] == ["rotary", "rmsnorm", "swiglu", False, False, False, False, False]
    assert (gpt2.rope_theta, gpt2.multiple_of, llama.rope_theta, llama.multiple_of) == (None, None, 10000.0, 16)
    # `bias` gives the biases not given one by one; RMSNorm has none to give
    mixed = GPTConfig(arch="llama", bias=True, mlp_bias=False)
    assert (mixed.qkv_bias, mixed.attn_out_bias, mixed.mlp_bias, mixed.norm_bias) == (True, True, False, False)
    assert GPTConfig(bias=False).norm_bias is False
    assert GPTConfig(intermediate_size=96, n_embd=64, n_head=4).ffn_size == 96  # a GELU MLP of another width
    with pytest.raises(ValueError, match="norm_bias=True: RMSNorm has no bias"):
        GPTConfig(arch="llama", norm_bias=True)
    with pytest.raises(ValueError, match="GPTConfig.mlp must be 'gelu', 'swiglu' or None, got 'relu'"):
        GPTConfig(mlp="relu")
    with pytest.raises(ValueError, match="GPTConfig.fused_qkv must be True or False, got 1"):
        GPTConfig(fused_qkv=1)
    with pytest.raises(ValueError, match="multiple_of needs mlp='swiglu'"):
        GPTConfig(multiple_of=64)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_config_counts_what_the_model_holds(name):
    """num_params and flops_per_token are the config's, without a model: the same as the model's parameters."""
    config = GPTConfig.from_name(name)
    model = _meta_gpt(config)
    assert config.num_params() == model.num_params()
    matmuls = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert config.flops_per_token(64) - config.flops_per_token(32) == 12 * config.n_layer * config.n_embd * 32
    keys = list(model.state_dict())
    names = config.hf_names(keys)
    assert list(names) == keys and len(set(names.values())) == len(keys)
    if config.positions == "learned":  # GPT-2: nanoGPT's count, every parameter but the position embedding
        assert config.flops_per_token(0) == 6 * (model.num_params() - config.block_size * config.n_embd)
        assert names["transformer.h.0.attn.c_attn.weight"] == "transformer.h.0.attn.c_attn.weight"
        assert config.hf_transposed("transformer.h.0.mlp.c_fc.weight") and not config.hf_transposed("lm_head.weight")
    else:
        assert config.flops_per_token(0) == 6 * matmuls
        assert names["transformer.h.1.attn.c_proj.weight"] == "model.layers.1.self_attn.o_proj.weight"
        assert names["transformer.h.0.ln_2.weight"] == "model.layers.0.post_attention_layernorm.weight"
        assert names["transformer.wte.weight"] == "model.embed_tokens.weight"


def test_capabilities_mix_across_families():
    """A GPT-2 config with rotary positions, separate grouped q/k/v and SwiGLU is built by the same code paths, and
    tensor parallelism plans it; a key transformers' GPT-2 does not have is refused by hf_names."""
    config = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=32, vocab_size=128,
                       positions="rotary", fused_qkv=False, mlp="swiglu", multiple_of=16)
    model = GPT(config)
    assert "wpe" not in model.transformer and model.transformer.h[0].attn.k_proj.weight.shape == (32, 64)
    assert model.transformer.h[0].attn.k_proj.bias is not None  # GPT-2's biases stay
    assert config.num_params() == model.num_params()
    assert model(torch.randint(0, 128, (2, 8))).shape == (2, 8, 128)
    assert config.tensor_parallel_refusal() is None
    assert config.tensor_parallel_plan() == {"attn": (("q_proj", "k_proj", "v_proj"), "c_proj"),
                                            "mlp": (("gate_proj", "up_proj"), "c_proj")}
    with pytest.raises(ValueError, match="'transformer.h.0.attn.q_proj.weight' has no counterpart in transformers'"):
        config.hf_names(model.state_dict())
    gelu = GPTConfig(n_layer=1, n_head=4, n_embd=64, positions="rotary", fused_qkv=False)
    assert gelu.tensor_parallel_plan()["mlp"] == (("c_fc",), "c_proj")
    with pytest.raises(ValueError, match="fused c_attn projection cannot be split"):
        GPTConfig().tensor_parallel_plan()


def test_the_activation_formula_is_the_one_computed():
    gpt2, llama = GPTConfig.from_name("1.5b"), GPTConfig.from_name("llama-8b")
    assert gpt2.activation_elements() == 17 * 1600  # Korthikanti et al.'s 34 h bytes in 16-bit
    assert gpt2.activation_formula() == "7 n_embd + 2 kv + 2 ffn"
    assert llama.activation_elements() == 9 * 4096 + 2 * 1024 + 4 * 14336
    assert llama.activation_formula() == "9 n_embd + 2 kv + 4 ffn"
