"""compile_gpt under FSDP2 (one real gloo process on the CPU): what torch.compile really captures."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_gpuopt.model import GPT, GPTConfig
from lightning_gpuopt.model.compiling import compile_gpt, compile_settings
from lightning_gpuopt.model.sharding import shard_gpt

needs_gloo = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


class CountingBackend:
    """A torch.compile backend that counts the graphs Dynamo hands it and runs each as traced."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs) -> object:
        self.graphs += 1
        return gm.forward


def _gpt(**kwargs) -> GPT:
    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=256, **kwargs))


@needs_gloo
@pytest.mark.parametrize("scope", ["block", "model"])
def test_fsdp2_with_activation_checkpointing_compiles_graphs_in_either_scope(mesh, scope):
    model = shard_gpt(_gpt(activation_checkpointing=True), mesh)
    backend = CountingBackend()
    if scope == "model":
        with pytest.warns(UserWarning, match="compile_scope='model' under FSDP2.*Compiling each block instead"):
            assert compile_gpt(model, scope, backend=backend) == ("block", None)
    else:
        assert compile_gpt(model, scope, backend=backend) == ("block", None)
    model(torch.randint(0, 256, (2, 16))).float().sum().backward()  # logits: the loss kernel stays eager
    assert backend.graphs > 0


def test_whole_model_scope_is_kept_without_fsdp2():
    assert compile_settings("model", "max-autotune", fsdp2=False) == ("model", "max-autotune", [])


@needs_gloo
def test_is_compiled_is_false_for_a_whole_model_compile_that_captures_nothing(mesh):
    from lightning_gpuopt.perf.compiled import is_compiled

    checkpointed = shard_gpt(_gpt(activation_checkpointing=True), mesh)
    backend = CountingBackend()
    checkpointed.compile(backend=backend)  # by hand, as a user's configure_model might
    checkpointed(torch.randint(0, 256, (2, 16))).float().sum().backward()
    assert backend.graphs == 0 and not is_compiled(checkpointed)
    checkpointed.compile_blocks(backend=backend)  # per block: each block's graph is captured
    assert is_compiled(checkpointed)
    plain = shard_gpt(_gpt(), mesh)
    plain.compile(backend=backend)  # no checkpointing: the block bodies compile between FSDP2's hooks
    plain(torch.randint(0, 256, (2, 16))).float().sum().backward()
    assert backend.graphs > 0 and is_compiled(plain)


@pytest.mark.parametrize(
    ("mode", "steered"), [("reduce-overhead", "default"), ("max-autotune", "max-autotune-no-cudagraphs")]
)
def test_under_fsdp2_cuda_graph_modes_are_steered_to_their_modes_without_cuda_graphs(mode, steered):
    scope, got, notes = compile_settings("block", mode, fsdp2=True)
    assert (scope, got) == ("block", steered)
    assert len(notes) == 1 and f"compile_mode={mode!r} under FSDP2" in notes[0] and f"{steered!r}" in notes[0]
    assert compile_settings("block", mode, fsdp2=False) == ("block", mode, [])  # one device, DDP: CUDA graphs stay


@pytest.mark.parametrize("mode", [None, "default", "max-autotune-no-cudagraphs"])
def test_modes_without_cuda_graphs_are_kept_under_fsdp2(mode):
    assert compile_settings("block", mode, fsdp2=True) == ("block", mode, [])
