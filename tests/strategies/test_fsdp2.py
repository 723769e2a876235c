"""shard_gpt: FSDP2 on every block and the root, in one real gloo process group on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from lightning_gpuopt.model import GPT, GPTConfig, shard_gpt

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


def _gpt() -> GPT:
    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=256))


def test_every_block_and_the_root_are_sharded_and_the_forward_is_unchanged(mesh):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    reference = _gpt()
    model = shard_gpt(copy.deepcopy(reference), mesh)
    assert isinstance(model, FSDPModule) and isinstance(model, GPT)
    assert all(isinstance(block, FSDPModule) for block in model.transformer.h)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied: one parameter
    idx = torch.randint(0, 256, (2, 16))
    assert torch.equal(model(idx), reference(idx))


def test_param_dtype_computes_in_bf16_and_keeps_fp32_weights_and_gradients(mesh):
    model = shard_gpt(_gpt(), mesh, param_dtype=torch.bfloat16)
    logits = model(torch.randint(0, 256, (2, 16)))
    assert logits.dtype == torch.bfloat16
    logits.float().sum().backward()
    assert all(p.dtype == torch.float32 for p in model.parameters())  # sharded master weights
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())  # reduced in fp32


def test_without_param_dtype_everything_stays_fp32(mesh):
    model = shard_gpt(_gpt(), mesh, reshard_after_forward=False)
    assert model(torch.randint(0, 256, (2, 16))).dtype == torch.float32


@pytest.mark.parametrize("tied", [True, False])
def test_the_llama_style_gpt_shards_and_computes_the_same(mesh, tied):
    """An untied token embedding is sharded on its own; the forward and the gradients are those of the plain model."""
    from torch.distributed.fsdp import FSDPModule

    reference = GPT(GPTConfig.from_name("llama-tiny", block_size=32, vocab_size=256, tie_embeddings=tied))
    model = shard_gpt(copy.deepcopy(reference), mesh)
    assert all(isinstance(block, FSDPModule) for block in model.transformer.h)
    assert isinstance(model.transformer.wte, FSDPModule) is not tied
    idx = torch.randint(0, 256, (2, 16))
    loss = model(idx, targets=idx)
    expected = reference(idx, targets=idx)
    assert torch.equal(loss, expected)
    loss.backward()
    expected.backward()
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(a.grad.full_tensor(), b.grad, msg=name)
