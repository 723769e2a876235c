"""The Hugging Face families the GPT reads and writes: each ``transformers`` class's ``config.json`` fields as
``GPTConfig`` fields and back, and the names and layout of its weights (``docs/huggingface.md``). A new family is
one entry of :data:`HF_FAMILIES`; reading and writing folders is ``model/hf.py``'s."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from lightning_gpuopt.model.config import GPTConfig
from lightning_gpuopt.model.gpt import GPT

__all__ = ["HFError", "HF_FAMILIES", "HFFamily", "family_of", "weight_names"]


class HFError(ValueError):
    """A Hugging Face folder (or ``hf:NAME``) that cannot be read into a GPT, or a GPT that cannot be written as one."""


@dataclass(frozen=True)
class HFFamily:
    """One ``transformers`` class: its ``config.json`` fields as ``GPTConfig`` fields and back, and the names of the
    weights (``renames``: regular-expression substitutions from ours to its, applied in order)."""

    hf_class: str
    model_type: str
    to_config: Callable[[dict[str, Any], str], dict[str, Any]]
    to_hf: Callable[[GPTConfig], dict[str, Any]]
    renames: tuple[tuple[str, str], ...]
    conv1d: tuple[str, ...] = ()  # our names whose weight the family stores as in x out (GPT-2's Conv1D)


def _refuse(where: str, field: str, value: Any, supported: str) -> HFError:
    return HFError(f"{where}: config.json has {field}={value!r}, which the GPT does not support ({supported}).")


def _check_values(hf: dict[str, Any], where: str, allowed: dict[str, tuple[Any, ...]]) -> None:
    """Refuse a field whose value changes the computation in a way the GPT cannot follow (absent: the default)."""
    for name, values in allowed.items():
        if name in hf and hf[name] not in values:
            raise _refuse(where, name, hf[name], f"supported: {' or '.join(repr(v) for v in values)}")


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


def _rope_theta(hf: dict[str, Any], where: str) -> float:
    """RoPE's base from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling`` (4.x); scaled RoPE
    is refused: the GPT's rotary embedding has no scaling (``docs/huggingface.md``)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type")) or scaling.get("rope_type", scaling.get("type")) or "default"
    if kind != "default":
        raise HFError(
            f"{where}: config.json asks for RoPE scaling of type {kind!r} (as Llama 3.1 and 3.2 do), and the GPT's "
            "rotary embedding has no scaling: its logits would not be the model's. Use a model without rope_scaling "
            "(Llama 3 8B, Qwen2), or set rope_scaling to null in a copy of config.json if you accept the difference."
        )
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _llama_config(hf: dict[str, Any], where: str) -> dict[str, Any]:
    _check_values(hf, where, {"hidden_act": ("silu",), "pretraining_tp": (1,)})
    n_embd, n_head = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    if hf.get("head_dim") not in (None, n_embd // n_head):
        raise _refuse(where, "head_dim", hf["head_dim"], f"the GPT's head size is hidden_size / num_attention_heads = "
                      f"{n_embd // n_head}")
    if bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
        raise HFError(f"{where}: config.json has attention_bias={hf.get('attention_bias')!r} and "
                      f"mlp_bias={hf.get('mlp_bias')!r}; the GPT has biases in every linear layer or in none.")
    return dict(
        arch="llama", n_layer=hf.get("num_hidden_layers", 32), n_head=n_head,
        n_kv_head=hf.get("num_key_value_heads") or n_head, n_embd=n_embd,
        intermediate_size=hf.get("intermediate_size", 11008), block_size=hf.get("max_position_embeddings", 2048),
        vocab_size=hf.get("vocab_size", 32000), bias=bool(hf.get("attention_bias", False)),
        norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(hf, where),
        tie_embeddings=hf.get("tie_word_embeddings", False),
    )


def _gpt2_hf(c: GPTConfig) -> dict[str, Any]:
    return dict(
        n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, n_positions=c.block_size, n_ctx=c.block_size,
        vocab_size=c.vocab_size, n_inner=None, activation_function="gelu_new", layer_norm_epsilon=c.norm_eps,
        resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout, tie_word_embeddings=c.tie_embeddings,
    )


def _llama_hf(c: GPTConfig) -> dict[str, Any]:
    return dict(
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head,
        hidden_size=c.n_embd, intermediate_size=c.ffn_size, head_dim=c.head_size, hidden_act="silu",
        max_position_embeddings=c.block_size, vocab_size=c.vocab_size, rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta, rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        attention_bias=c.bias, mlp_bias=c.bias, attention_dropout=c.dropout, tie_word_embeddings=c.tie_embeddings,
    )


_LLAMA_RENAMES = (
    (r"^transformer\.wte\.", "model.embed_tokens."),
    (r"^transformer\.ln_f\.", "model.norm."),
    (r"^transformer\.h\.(\d+)\.ln_1\.", r"model.layers.\1.input_layernorm."),
    (r"^transformer\.h\.(\d+)\.ln_2\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^transformer\.h\.(\d+)\.attn\.c_proj\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^transformer\.h\.(\d+)\.attn\.", r"model.layers.\1.self_attn."),
    (r"^transformer\.h\.(\d+)\.mlp\.c_proj\.", r"model.layers.\1.mlp.down_proj."),
    (r"^transformer\.h\.(\d+)\.mlp\.", r"model.layers.\1.mlp."),
)

# The families load_hf reads and save_hf writes, by their transformers class (config.json's "architectures").
HF_FAMILIES: dict[str, HFFamily] = {
    "GPT2LMHeadModel": HFFamily(
        "GPT2LMHeadModel", "gpt2", _gpt2_config, _gpt2_hf, renames=(),  # nanoGPT's names are GPT-2's
        conv1d=("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"),
    ),
    "LlamaForCausalLM": HFFamily("LlamaForCausalLM", "llama", _llama_config, _llama_hf, renames=_LLAMA_RENAMES),
}


def family_of(config: GPTConfig) -> HFFamily:
    """The transformers family a GPT is written as (the one place export reads the architecture's name)."""
    return HF_FAMILIES["GPT2LMHeadModel" if config.arch == "gpt2" else "LlamaForCausalLM"]


def _hf_name(family: HFFamily, ours: str) -> str:
    for pattern, replacement in family.renames:
        if re.search(pattern, ours):
            return re.sub(pattern, replacement, ours)
    return ours


def weight_names(family: HFFamily, model: GPT) -> dict[str, str]:
    """Our state-dict name -> the family's, for every weight a folder holds (the head only when untied)."""
    names = [k for k in model.state_dict() if not (k == "lm_head.weight" and model.config.tie_embeddings)]
    return {k: _hf_name(family, k) for k in names}
