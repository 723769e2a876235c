"""The step's elementwise options: a bf16 residual stream, and the loss inside a whole-model graph."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt.model import GPT, GPTConfig, GPTModule
from lightning_gpuopt.model.compiling import compile_gpt, loss_fits_graph


def _gpt(**kwargs) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=256, **kwargs))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (2, 16), generator=g)
    targets = torch.randint(0, 256, (2, 16), generator=g)
    targets[0, :3] = -1  # positions without a target count in neither
    return idx, targets


class GraphRecorder:
    """A torch.compile backend that keeps the FX graphs Dynamo hands it and runs each as traced."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs) -> object:
        self.graphs.append(gm)
        return gm.forward

    def calls(self) -> set[str]:
        return {getattr(n.target, "__name__", str(n.target)) for g in self.graphs for n in g.graph.nodes
                if n.op in ("call_function", "call_method")}


def _block_inputs(model: GPT) -> tuple[list[torch.dtype], list]:
    seen: list[torch.dtype] = []
    hooks = [b.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype)) for b in model.transformer.h]
    return seen, hooks


def test_bf16_residual_stream_is_bf16_between_blocks_and_its_loss_close_to_float32():
    idx, targets = _batch()
    results = {}
    for residual in (None, torch.bfloat16):
        model = _gpt()
        model.residual_dtype = residual
        seen, hooks = _block_inputs(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, targets=targets)
        loss.backward()
        for h in hooks:
            h.remove()
        results[residual] = (loss.detach().float(), model.transformer.wte.weight.grad.clone(), seen)
    (loss32, grad32, seen32), (loss16, grad16, seen16) = results[None], results[torch.bfloat16]
    assert seen32 == [torch.float32, torch.float32] and seen16 == [torch.bfloat16, torch.bfloat16]
    assert loss16 != loss32  # the option changed the arithmetic ...
    assert torch.allclose(loss16, loss32, rtol=5e-3)  # ... by bf16 rounding only
    assert torch.nn.functional.cosine_similarity(grad16.flatten(), grad32.flatten(), dim=0) > 0.99


def test_bf16_residual_stream_does_nothing_without_bf16_autocast():
    idx, targets = _batch()
    plain, model = _gpt(), _gpt()
    model.residual_dtype = torch.bfloat16
    seen, _ = _block_inputs(model)
    assert torch.equal(model(idx, targets=targets), plain(idx, targets=targets))
    assert seen == [torch.float32, torch.float32]


def _fit(precision: str, **module_kwargs) -> GPTModule:
    idx, targets = _batch()
    module = GPTModule(preset="tiny", vocab_size=256, block_size=32, warmup_steps=1, **module_kwargs)
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision=precision, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=DataLoader(TensorDataset(idx, targets), batch_size=2))
    return module


def test_gpt_module_residual_dtype_trains_under_bf16_and_warns_under_float32():
    module = _fit("bf16-mixed", residual_dtype="bfloat16")
    assert module.model.residual_dtype == torch.bfloat16
    assert torch.isfinite(module._last_train_loss)
    with pytest.warns(UserWarning, match="residual_dtype='bfloat16' changes nothing under fp32 precision"):
        _fit("32-true", residual_dtype="bfloat16")
    with pytest.raises(ValueError, match="residual_dtype"):
        GPTModule(residual_dtype="float16")


@pytest.mark.parametrize("residual", [None, torch.bfloat16])
def test_whole_model_graph_holds_the_loss_and_matches_eager(residual):
    """float32: against the eager chunked loss; bf16 residual under autocast: against the same code run eagerly."""
    idx, targets = _batch()
    eager, compiled = _gpt(), _gpt()
    for m in (eager, compiled):
        m.residual_dtype = residual
    eager.loss_in_graph = residual is not None
    backend = GraphRecorder()
    assert compile_gpt(compiled, "model", backend=backend) == ("model", None)
    assert compiled.loss_in_graph
    losses = []
    for m in (eager, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=residual is not None):
            loss = m(idx, targets=targets)
        loss.backward()
        losses.append(loss.detach())
    assert len(backend.graphs) == 1 and "cross_entropy" in backend.calls()  # one graph, the loss in it
    assert torch.allclose(losses[0], losses[1], rtol=1e-5)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6)


def test_an_explicit_chunked_loss_and_the_block_scope_keep_the_loss_out_of_the_graph():
    assert loss_fits_graph(_gpt()) and loss_fits_graph(_gpt(loss_impl="plain"))
    chunked = _gpt(loss_impl="chunked")
    backend = GraphRecorder()
    compile_gpt(chunked, "model", backend=backend)
    assert not chunked.loss_in_graph
    chunked.compile_loss = False  # the chunk kernel's own Inductor compile takes seconds and is not the point here
    idx, targets = _batch()
    chunked(idx, targets=targets)
    assert "cross_entropy" not in backend.calls()
    blocks = _gpt()
    compile_gpt(blocks, "block", backend=GraphRecorder())
    assert not blocks.loss_in_graph
