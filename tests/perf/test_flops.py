"""FLOPs of what training runs, for modules written the way nanoGPT, Hugging Face and litgpt write them."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lightning_gpuopt.perf.flops import StepFlopCounter, count_step_flops, measure_training_flops
from tests._module_shapes import (
    MORE_SHAPES,
    SHAPES,
    EncoderLM,
    NanoGPTModule,
    T,
    encoder_flops_per_token,
    hand_flops_per_token,
    shape_loader,
)

B = 4
AUTOMATIC = {k: v for k, v in {**SHAPES, **MORE_SHAPES}.items() if k != "two-optimizers"}  # that one needs a Trainer


def _step(module, batch):
    def run():
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*self.log.*")  # no Trainer attached: logging is a no-op
            out = module.training_step(batch, 0)
        (out["loss"] if isinstance(out, dict) else out).backward()
        return out

    return run


def _math_kernel_flops(module, batch) -> int:
    """FLOPs of the same step with SDPA as plain matmuls (the math kernel), counted by torch's own table."""
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        _step(module, batch)()
    module.zero_grad(set_to_none=True)
    return counter.get_total_flops()


@pytest.mark.parametrize("shape", sorted(AUTOMATIC))
def test_a_real_step_is_counted_as_the_math_kernel_and_the_hand_count(shape):
    torch.manual_seed(0)
    module = AUTOMATIC[shape]()
    batch = next(iter(shape_loader(shape, batch_size=B)))
    if shape.startswith("hf-"):
        assert int(batch["attention_mask"].sum()) < batch["attention_mask"].numel()  # padded: a 4-D mask reaches SDPA
    _, flops = count_step_flops(_step(module, batch))  # whatever kernel runs (CPU flash here)
    module.zero_grad(set_to_none=True)
    assert flops / (B * T) == pytest.approx(hand_flops_per_token(module), rel=0.03)
    assert flops == _math_kernel_flops(module, batch)


@pytest.mark.parametrize("shape", sorted(AUTOMATIC))
def test_a_counted_step_computes_the_same_bits_as_an_uncounted_one(shape):
    # FlopCounterMode decomposed SiLU's backward (Llama's SwiGLU): the counted step's gradients differed in the last bits
    torch.manual_seed(0)
    module = AUTOMATIC[shape]()
    batch = next(iter(shape_loader(shape, batch_size=B)))
    plain = _step(module, batch)()
    plain_grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    counted, flops = count_step_flops(_step(module, batch))
    assert flops > 0
    loss = lambda out: out["loss"] if isinstance(out, dict) else out  # noqa: E731
    assert torch.equal(loss(plain), loss(counted))
    assert all(torch.equal(a, p.grad) for a, p in zip(plain_grads, module.parameters()))


def test_a_step_that_reads_a_value_is_counted_whole():
    class Reads(NanoGPTModule):  # nanoGPT's shape with `loss.item()` in the step: no meta tensors can run it
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.last = loss.item()
            return loss

    torch.manual_seed(0)
    module = Reads()
    batch = next(iter(shape_loader("nanogpt", batch_size=B)))
    loss, flops = count_step_flops(_step(module, batch))
    assert flops / (B * T) == hand_flops_per_token(module) and module.last == pytest.approx(float(loss))
    # counting touched nothing: the gradients are those of an uncounted step
    counted = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    _step(module, batch)()
    assert all(torch.equal(a, p.grad) for a, p in zip(counted, module.parameters()))


def test_a_compiled_module_is_counted_through_its_operators():
    torch.manual_seed(0)
    model = EncoderLM()
    compiled = torch.compile(model)
    x = torch.zeros(2, T, dtype=torch.long)
    _, flops = count_step_flops(lambda: compiled(x).sum().backward())
    assert flops / (2 * T) == encoder_flops_per_token()  # force_eager for the counted step: every matmul seen


def test_the_counter_refuses_to_nest_or_stop_unstarted():
    counter = StepFlopCounter()
    with pytest.raises(RuntimeError, match="before start"):
        counter.stop()
    counter.start()
    try:
        with pytest.raises(RuntimeError, match="twice"):
            counter.start()
        torch.ones(16, 16) @ torch.ones(16, 16)
    finally:
        assert counter.stop() == 2 * 16 ** 3 and not counter.running


def test_flops_of_a_foreign_model_match_a_hand_count():
    model = EncoderLM()
    flops = measure_training_flops(model, torch.zeros(2, T, dtype=torch.long))
    assert flops / (2 * T) == encoder_flops_per_token()
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())  # untouched


def test_flops_of_a_model_with_tied_embeddings():
    # GPT ties lm_head to the token embedding: one tensor under two names.
    from lightning_gpuopt.model import GPT, GPTConfig

    model = GPT(GPTConfig.from_name("tiny", vocab_size=512, block_size=T))
    assert model.lm_head.weight is model.transformer.wte.weight
    flops = measure_training_flops(model, torch.zeros(2, T, dtype=torch.long)) / (2 * T)
    # PaLM's 6N counts the biases and LayerNorm weights too, as if they were matmul weights.
    vectors = sum(p.numel() for p in model.parameters() if p.ndim == 1)
    assert flops == model.flops_per_token(T) - 6 * vectors


def _hf_models():
    """Tiny Hugging Face LlamaForCausalLM and GPT2LMHeadModel, built from local configs (no download)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
    V, D, H = 256, 64, 4
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=3 * D, num_hidden_layers=2, num_attention_heads=H,
        num_key_value_heads=H, max_position_embeddings=T, attn_implementation="sdpa"))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_embd=D, n_layer=2, n_head=H, n_positions=T, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa"))
    return {"llama": llama, "gpt2": gpt2}


def hf_batch(batch_size: int = B) -> dict:
    """``input_ids``, ``attention_mask`` (every other row ends in padding) and ``labels`` (-100 on padding)."""
    ids = torch.randint(0, 256, (batch_size, T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(batch_size, T, dtype=torch.long)
    mask[1::2, -T // 4:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hugging_face_models_with_an_attention_mask_match_the_hand_count(name):
    torch.manual_seed(0)
    model = _hf_models()[name]
    batch = hf_batch()
    weights = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"}
    hand = 6 * sum(weights.values()) + 12 * 2 * 64 * T  # PaLM: 6 per matmul weight, 12·L·d·T attention
    _, flops = count_step_flops(lambda: model(**batch).loss.backward())
    assert flops / (B * T) == pytest.approx(hand, rel=0.03)


def test_grouped_query_attention_counts_as_its_keys_repeated_to_every_query_head():
    """SDPA with 2 key/value heads for 8 query heads (``enable_gqa``) costs what it does with the keys repeated."""
    torch.manual_seed(0)
    q = torch.randn(2, 8, 32, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, 32, 16, requires_grad=True) for _ in range(2))

    def step(key, value, **gqa):
        counter = StepFlopCounter()
        counter.start()
        torch.nn.functional.scaled_dot_product_attention(q, key, value, is_causal=True, **gqa).sum().backward()
        return counter.stop()

    repeated = step(k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1))
    assert repeated == 3 * 2 * (2 * 2 * 8 * 32 * 32 * 16)  # forward Q K^T and P V, backward twice that
    assert step(k, v, enable_gqa=True) == repeated
