"""FLOPs of what training runs, for modules written the way nanoGPT, Hugging Face and litgpt write them."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lightning_gpuopt.perf.flops import forward_positions, measure_training_flops, training_step_flops
from tests._module_shapes import (
    SHAPES,
    EncoderLM,
    NanoGPTModule,
    T,
    encoder_flops_per_token,
    hand_flops_per_token,
    shape_loader,
)

B = 4


def _real_step_flops(module, batch) -> int:
    """FLOPs of a real training step and its backward (SDPA as plain matmuls, so attention is counted)."""
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter, pytest.warns(UserWarning, match="self.log") if isinstance(
        module, NanoGPTModule
    ) else _nothing():
        out = module.training_step(batch, 0)
        (out["loss"] if isinstance(out, dict) else out).backward()
    module.zero_grad(set_to_none=True)
    return counter.get_total_flops()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_training_step_flops_match_a_real_step_and_the_hand_count(shape):
    module = SHAPES[shape]()
    batch = next(iter(shape_loader(shape, batch_size=B)))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    counted = training_step_flops(module, batch) / (B * T)
    assert counted == pytest.approx(_real_step_flops(module, batch) / (B * T), rel=0.03)
    assert counted == pytest.approx(hand_flops_per_token(module), rel=0.03)
    # the module is left as it was: real weights, no gradients
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    assert all(p.grad is None and p.device.type == "cpu" for p in module.parameters())


def test_nanogpt_forward_without_targets_covers_one_position_and_counts_low():
    module = NanoGPTModule()
    x, _ = next(iter(shape_loader("nanogpt", batch_size=B)))
    flops, covered = forward_positions(module, x)
    assert covered == 1
    low = 1 - flops / (B * T) / hand_flops_per_token(module)
    assert 0.10 < low < 0.25  # what counting forward(input_ids) missed


def test_training_step_side_effects_are_undone():
    class Counting(NanoGPTModule):
        def __init__(self):
            super().__init__()
            self.steps, self.losses = 0, []

        def training_step(self, batch, batch_idx):
            torch.rand(1)  # a draw on the CPU generator
            self.steps += 1
            loss = super().training_step(batch, batch_idx)
            self.losses.append(loss)
            self.last = loss
            return loss

    module = Counting()
    losses = module.losses
    batch = next(iter(shape_loader("nanogpt")))
    rng = torch.get_rng_state()
    training_step_flops(module, batch)
    assert torch.equal(torch.get_rng_state(), rng)  # the run's random stream is where it was
    assert module.steps == 0 and module.losses == [] and module.losses is losses and not hasattr(module, "last")
    assert "log" not in module.__dict__


def test_a_step_that_reads_a_value_or_steps_manually_raises():
    class Reads(NanoGPTModule):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if loss.item() > 1e6:
                raise RuntimeError("diverged")
            return loss

    class Manual(NanoGPTModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    batch = next(iter(shape_loader("nanogpt")))
    with pytest.raises(Exception, match="meta"):
        training_step_flops(Reads(), batch)
    with pytest.raises(ValueError, match="automatic_optimization=False"):
        training_step_flops(Manual(), batch)


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
