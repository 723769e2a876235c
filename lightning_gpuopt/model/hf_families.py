"""The Hugging Face families the GPT reads and writes: each ``transformers`` class's ``config.json`` fields as
``GPTConfig`` fields and back, and the capabilities a config needs to be written as that class
(``docs/huggingface.md``).
The weights' names and layout are the config's own mapping (``GPTConfig.hf_names``, ``hf_transposed``). A new family
is one entry of :data:`HF_FAMILIES`; reading and writing folders is ``model/hf.py``'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from lightning_gpuopt.model.config import GPTConfig
from lightning_gpuopt.model.gpt import GPT
from lightning_gpuopt.model.rope import LLAMA3_SCALING_KEYS

__all__ = ["HFError", "HF_FAMILIES", "HFFamily", "family_of", "transposed", "weight_names"]


class HFError(ValueError):
    """A Hugging Face folder (or ``hf:NAME``) that cannot be read into a GPT, or a GPT that cannot be written as one."""


@dataclass(frozen=True)
class HFFamily:
    """One ``transformers`` class: its ``config.json`` fields as ``GPTConfig`` fields (``to_config``) and back
    (``to_hf``), and ``writes``: whether a config's capabilities are that class's (the export's choice)."""

    hf_class: str
    model_type: str
    to_config: Callable[[dict[str, Any], str], dict[str, Any]]
    to_hf: Callable[[GPTConfig], dict[str, Any]]
    writes: Callable[[GPTConfig], bool]


def _refuse(where: str, field: str, value: Any, supported: str) -> HFError:
    return HFError(f"{where}: config.json has {field}={value!r}, which the GPT does not support ({supported}).")


def _check_values(hf: dict[str, Any], where: str, allowed: dict[str, tuple[Any, ...]]) -> None:
    """Refuse a field whose value changes the computation in a way the GPT cannot follow (absent: the default)."""
    for name, values in allowed.items():
        if name in hf and hf[name] not in values:
            raise _refuse(where, name, hf[name], f"supported: {' or '.join(repr(v) for v in values)}")


# ------------------------------------------------------------------------------------------------ GPT-2
def _gpt2_config(hf: dict[str, Any], where: str) -> dict[str, Any]:
    _check_values(hf, where, {
        "activation_function": ("gelu_new", "gelu_pytorch_tanh"),  # GELU with the tanh approximation, as ours
        "scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,), "add_cross_attention": (False,),
    })
    n_embd = hf.get("n_embd", 768)
    if hf.get("n_inner") not in (None, 4 * n_embd):
        raise _refuse(where, "n_inner", hf["n_inner"], f"the GPT-2 MLP is 4 * n_embd = {4 * n_embd} wide")
    return dict(
        arch="gpt2", n_layer=hf.get("n_layer", 12), n_head=hf.get("n_head", 12), n_embd=n_embd,
        block_size=hf.get("n_positions", 1024), vocab_size=hf.get("vocab_size", 50257), bias=True,
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), tie_embeddings=hf.get("tie_word_embeddings", True),
    )


def _gpt2_hf(c: GPTConfig) -> dict[str, Any]:
    return dict(
        n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, n_positions=c.block_size, n_ctx=c.block_size,
        vocab_size=c.vocab_size, n_inner=None, activation_function="gelu_new", layer_norm_epsilon=c.norm_eps,
        resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout, tie_word_embeddings=c.tie_embeddings,
    )


def _writes_gpt2(c: GPTConfig) -> bool:
    return (c.positions, c.norm, c.mlp, c.fused_qkv) == ("learned", "layernorm", "gelu", True) and all(
        (c.qkv_bias, c.attn_out_bias, c.mlp_bias, c.norm_bias)) and c.ffn_size == 4 * c.n_embd


# ------------------------------------------------------------------------------------------------ Llama and Qwen2
def _rope(hf: dict[str, Any], where: str, default: float) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` from ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (4.x): no scaling, or Llama 3.1's ``"llama3"``; any other kind is refused."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = params.get("rope_type", params.get("type")) or "default"
    theta = float(params.get("rope_theta", hf.get("rope_theta", default)))
    if kind == "default":
        return dict(rope_theta=theta)
    if kind != "llama3" or any(k not in params for k in LLAMA3_SCALING_KEYS):
        raise HFError(
            f"{where}: config.json asks for RoPE scaling of type {kind!r}, which the GPT's rotary embedding does not "
            f"have (it has Llama 3.1's 'llama3', with {', '.join(LLAMA3_SCALING_KEYS)}): its logits would not be the "
            "model's. Use a model without it, or one of Llama 3.1's scaling."
        )
    return dict(rope_theta=theta, rope_scaling={k: params[k] for k in LLAMA3_SCALING_KEYS})


def _rotary_config(hf: dict[str, Any], where: str, theta: float) -> dict[str, Any]:
    """The fields Llama and Qwen2 share (``hidden_act`` SiLU, a head size of ``hidden_size / num_attention_heads``)."""
    _check_values(hf, where, {"hidden_act": ("silu",), "pretraining_tp": (1,)})
    n_embd, n_head = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    if hf.get("head_dim") not in (None, n_embd // n_head):
        raise _refuse(where, "head_dim", hf["head_dim"], f"the GPT's head size is hidden_size / num_attention_heads = "
                      f"{n_embd // n_head}")
    return dict(
        n_layer=hf.get("num_hidden_layers", 32), n_head=n_head, n_kv_head=hf.get("num_key_value_heads") or n_head,
        n_embd=n_embd, intermediate_size=hf.get("intermediate_size", 11008),
        block_size=hf.get("max_position_embeddings", 2048), vocab_size=hf.get("vocab_size", 32000),
        norm_eps=hf.get("rms_norm_eps", 1e-6), **_rope(hf, where, theta),
    )


def _llama_config(hf: dict[str, Any], where: str) -> dict[str, Any]:
    attention_bias = bool(hf.get("attention_bias", False))
    return dict(arch="llama", **_rotary_config(hf, where, 10000.0), qkv_bias=attention_bias,
                attn_out_bias=attention_bias, mlp_bias=bool(hf.get("mlp_bias", False)),
                tie_embeddings=hf.get("tie_word_embeddings", False))


def _qwen2_config(hf: dict[str, Any], where: str) -> dict[str, Any]:
    if hf.get("use_sliding_window"):
        raise _refuse(where, "use_sliding_window", True, "every layer attends to its whole context")
    return dict(arch="qwen2", **_rotary_config(hf, where, 10000.0), qkv_bias=True, attn_out_bias=False,
                mlp_bias=False, tie_embeddings=hf.get("tie_word_embeddings", False))


def _rotary_hf(c: GPTConfig) -> dict[str, Any]:
    scaling = {"rope_type": "llama3", **c.rope_scaling} if c.rope_scaling else {"rope_type": "default"}
    return dict(
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head,
        hidden_size=c.n_embd, intermediate_size=c.ffn_size, head_dim=c.head_size, hidden_act="silu",
        max_position_embeddings=c.block_size, vocab_size=c.vocab_size, rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta, rope_parameters={**scaling, "rope_theta": c.rope_theta},
        attention_dropout=c.dropout, tie_word_embeddings=c.tie_embeddings,
    )


def _llama_hf(c: GPTConfig) -> dict[str, Any]:
    return dict(_rotary_hf(c), attention_bias=c.qkv_bias, mlp_bias=c.mlp_bias)


def _qwen2_hf(c: GPTConfig) -> dict[str, Any]:
    return dict(_rotary_hf(c), use_sliding_window=False, sliding_window=None, max_window_layers=c.n_layer)


def _rotary(c: GPTConfig) -> bool:
    return (c.positions, c.norm, c.mlp, c.fused_qkv) == ("rotary", "rmsnorm", "swiglu", False)


def _writes_llama(c: GPTConfig) -> bool:
    return _rotary(c) and c.qkv_bias == c.attn_out_bias  # Llama's attention_bias covers q, k, v and o together


def _writes_qwen2(c: GPTConfig) -> bool:  # Qwen2 has no RoPE scaling of Llama 3.1's kind
    return _rotary(c) and c.qkv_bias and not c.attn_out_bias and not c.mlp_bias and not c.rope_scaling


# The families load_hf reads and save_hf writes, by their transformers class (config.json's "architectures"); the
# export takes the first whose capabilities a config has.
HF_FAMILIES: dict[str, HFFamily] = {
    "GPT2LMHeadModel": HFFamily("GPT2LMHeadModel", "gpt2", _gpt2_config, _gpt2_hf, _writes_gpt2),
    "LlamaForCausalLM": HFFamily("LlamaForCausalLM", "llama", _llama_config, _llama_hf, _writes_llama),
    "Qwen2ForCausalLM": HFFamily("Qwen2ForCausalLM", "qwen2", _qwen2_config, _qwen2_hf, _writes_qwen2),
}


def family_of(config: GPTConfig) -> HFFamily:
    """The transformers class a GPT of ``config`` is written as: the first family whose capabilities it has."""
    family = next((f for f in HF_FAMILIES.values() if f.writes(config)), None)
    if family is None:
        raise HFError(
            f"No transformers class has this GPT's capabilities (positions={config.positions!r}, norm={config.norm!r}, "
            f"mlp={config.mlp!r}, fused_qkv={config.fused_qkv}, qkv_bias={config.qkv_bias}, attn_out_bias="
            f"{config.attn_out_bias}, mlp_bias={config.mlp_bias}): save_hf writes {', '.join(HF_FAMILIES)}."
        )
    return family


def weight_names(model: GPT) -> dict[str, str]:
    """Our state-dict name -> transformers', for every weight a folder holds (the head only when untied)."""
    keys = [k for k in model.state_dict() if not (k == "lm_head.weight" and model.config.tie_embeddings)]
    try:
        return model.config.hf_names(keys)
    except ValueError as err:
        raise HFError(f"The GPT cannot be written as a transformers model: {err}") from err


def transposed(config: GPTConfig, ours: str) -> bool:
    """Whether transformers stores our weight ``ours`` transposed (GPT-2's ``Conv1D``, in x out)."""
    return config.hf_transposed(ours)
