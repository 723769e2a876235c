"""The Qwen2 family (``arch="qwen2"``), added through the config's capabilities alone: Llama's layout with a bias on
the query, key and value projections, against transformers' ``Qwen2ForCausalLM``; the Qwen2.5-0.5B preset's count;
and the package's paths on ``qwen2-tiny``: training, a resumed fit, generation with the KV cache, tensor
parallelism and its plan."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gpuopt.model import GPT, GPTConfig, GPTModule, load_gpt
from lightning_gpuopt.model.tensor_parallel import check_tensor_parallel, parallelize_gpt
from lightning_gpuopt.strategies.choose import choose_strategy
from tests.precision._helpers import token_loader

QWEN = dict(block_size=32, vocab_size=128)


def test_qwen2_tiny_has_biases_on_q_k_v_only():
    config = GPTConfig.from_name("qwen2-tiny", **QWEN)
    model = GPT(config)
    biased = sorted({name.split(".", 3)[-1] for name, _ in model.named_parameters() if name.endswith(".bias")})
    assert biased == ["attn.k_proj.bias", "attn.q_proj.bias", "attn.v_proj.bias"]
    assert (config.positions, config.norm, config.mlp, config.rope_theta, config.norm_eps) == (
        "rotary", "rmsnorm", "swiglu", 1e6, 1e-6)
    assert model.transformer.h[0].attn.k_proj.bias.shape == (32,) and config.ffn_size == 160
    assert model.lm_head.weight is model.transformer.wte.weight
    assert config.num_params() == model.num_params() == 119_360 - (512 - 128) * 64


def test_qwen2_0_5b_is_qwen2_5_0_5b():
    """Qwen2.5-0.5B's 494,032,768 parameters (its model card: 0.49B; 0.36B without embeddings), tied head."""
    config = GPTConfig.from_name("qwen2-0.5b")
    with torch.device("meta"):
        model = GPT(config)
    assert model.num_params() == config.num_params() == 494_032_768
    assert model.num_params(non_embedding=True) == 494_032_768 - 151_936 * 896
    assert (config.padded_vocab_size, config.head_size, config.n_kv_head, config.ffn_size) == (151_936, 64, 2, 4864)


def test_qwen2_flops_per_token_is_what_the_flop_counter_counts():
    """The q/k/v biases are additions, not matmul weights: N stays the Linear weights, exactly what is counted."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = GPT(GPTConfig.from_name("qwen2-tiny", **QWEN))
    x = torch.randint(0, 128, (2, 32))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    assert counter.get_total_flops() == model.flops_per_token(32) * x.numel()


def test_qwen2_logits_are_transformers_qwen2_logits():
    """Our weights copied by the config's hf_names into transformers' Qwen2ForCausalLM: the same logits, so the bias is
    added to q/k/v before the rotation, as Qwen2 does."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = GPTConfig.from_name("qwen2-tiny", **QWEN)
    ours = GPT(config).eval()
    with torch.no_grad():  # biases of zero would hide where they are added
        for block in ours.transformer.h:
            for layer in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
                layer.bias.normal_(0, 0.5)
    hf_config = transformers.Qwen2Config(
        vocab_size=config.vocab_size, hidden_size=config.n_embd, intermediate_size=config.ffn_size,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head, num_key_value_heads=config.n_kv_head,
        max_position_embeddings=config.block_size, rms_norm_eps=config.norm_eps, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
    )
    theirs = transformers.Qwen2ForCausalLM(hf_config).eval()
    state = ours.state_dict()
    names = config.hf_names(state)
    missing, unexpected = theirs.load_state_dict({names[k]: v for k, v in state.items()}, strict=False)
    assert not missing and not unexpected and not any(config.hf_transposed(k) for k in state)
    idx = torch.randint(0, config.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), theirs(idx).logits, atol=2e-5, rtol=1e-4)


def test_qwen2_trains_resumes_and_loads_into_a_plain_gpt(tmp_path):
    """GPTModule(preset="qwen2-tiny"): the loss falls over a fit, a fit resumed from last.ckpt goes on from its step,
    and load_gpt rebuilds the same model from the saved hyper-parameters."""
    torch.manual_seed(0)
    module = GPTModule(preset="qwen2-tiny", vocab_size=256, block_size=32, warmup_steps=0, learning_rate=3e-3)

    def trainer(steps: int) -> pl.Trainer:
        saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
        return pl.Trainer(max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=tmp_path, callbacks=[saves])

    first = trainer(4)
    first.fit(module, train_dataloaders=token_loader(n_seq=16, batch_size=4))
    losses = [first.callback_metrics["train/loss"].item()]
    resumed = GPTModule(preset="qwen2-tiny", vocab_size=256, block_size=32, warmup_steps=0, learning_rate=3e-3)
    second = trainer(6)
    last = tmp_path / "ckpt" / "last.ckpt"
    second.fit(resumed, train_dataloaders=token_loader(n_seq=16, batch_size=4), ckpt_path=last)
    assert second.global_step == 6 and resumed.model.transformer.h[0].attn.q_proj.bias.abs().sum() > 0
    losses.append(second.callback_metrics["train/loss"].item())
    assert losses[1] < losses[0]
    gpt = load_gpt(last)
    assert (gpt.config.arch, gpt.config.qkv_bias, gpt.config.rope_theta) == ("qwen2", True, 1e6)
    idx = torch.randint(0, 256, (2, 16))
    resumed.model.eval()
    with torch.no_grad():
        assert torch.equal(gpt(idx), resumed.model(idx))


def test_qwen2_generates_the_same_tokens_with_and_without_the_cache():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("qwen2-tiny", **QWEN)).eval()
    prompt = torch.randint(0, 128, (2, 5))
    cached = model.generate(prompt, max_new_tokens=12, temperature=0)
    assert torch.equal(cached, model.generate(prompt, max_new_tokens=12, temperature=0, use_cache=False))
    assert cached.shape == (2, 17) and torch.equal(cached[:, :5], prompt)


def test_qwen2_is_split_by_the_tensor_parallel_plan(mesh):
    """The plan's styles on a one-rank mesh, the q/k/v biases split with their rows: the same loss and gradients."""
    whole = GPT(GPTConfig.from_name("qwen2-tiny", block_size=16, vocab_size=256))
    split = parallelize_gpt(copy.deepcopy(whole), mesh)
    assert type(split.transformer.h[0].attn.q_proj.bias).__name__ == "DTensor"
    idx = torch.randint(0, 256, (2, 16))
    loss, expected = split(idx, targets=idx), whole(idx, targets=idx)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    for (name, a), b in zip(split.named_parameters(), whole.parameters()):
        torch.testing.assert_close(a.grad.full_tensor(), b.grad, msg=name)


def test_qwen2_0_5b_tensor_parallel_plan_names_its_head_counts():
    """14 query and 2 key/value heads: tensor parallel 2 splits them, 4 does not, and choose_strategy says so."""
    config = GPTConfig.from_name("qwen2-0.5b")
    check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match=r"not divide n_head=14, n_kv_head=2.*Choose tensor_parallel_size from \[1, 2"):
        check_tensor_parallel(config, 4)
    strategy, reason = choose_strategy(config, devices=8, device_memory=20e9, micro_batch=4, block_size=4096)
    assert strategy._tensor_parallel_size == 2 and strategy._data_parallel_size == 4, reason
    assert "tensor parallel 4 or more is not considered: it does not divide n_head=14, n_kv_head=2" in reason
    assert "block formula (swiglu MLP)" in reason
