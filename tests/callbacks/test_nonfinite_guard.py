"""NonFiniteGuard with a real Trainer on CPU: a tiny GPTModule whose loss goes NaN at chosen steps."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

from lightning_gpuopt import GPTModule
from lightning_gpuopt.callbacks import NonFiniteError, NonFiniteGuard
from lightning_gpuopt.model.checkpoint import load_gpt


class PoisonedGPT(GPTModule):
    """At the given global steps: multiplies the loss by NaN (``"nan"``), adds Inf to it (``"inf"``: the
    gradients stay finite), or leaves it finite and makes one weight's gradient NaN (``"grad"``)."""

    def __init__(self, bad_steps=(), mode="nan", **kw):
        super().__init__(**kw)
        self.bad_steps = set(bad_steps)
        self.mode = mode
        self._hooked = False

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.mode == "grad" and not self._hooked:
            bad = lambda grad: grad * math.nan if self.trainer.global_step in self.bad_steps else grad  # noqa: E731
            self.model.transformer.h[1].mlp.c_proj.weight.register_hook(bad)
            self._hooked = True
        elif self.mode != "grad" and self.trainer.global_step in self.bad_steps:
            loss = loss * math.nan if self.mode == "nan" else loss + math.inf
        return loss


class Snapshots(Callback):
    """Copies of the weights and AdamW state just before each optimizer step, and the LR after it."""

    def __init__(self):
        self.before, self.lrs, self.steps = {}, [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before[trainer.global_step] = {k: v.clone() for k, v in pl_module.state_dict().items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
        self.steps.append(trainer.global_step)


def _loader(n=64, vocab=256, T=32):
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (n, T + 1), generator=g)
    return DataLoader(list(zip(data[:, :-1], data[:, 1:])), batch_size=4)


def _model(**kw):
    return PoisonedGPT(preset="tiny", vocab_size=256, block_size=32, learning_rate=1e-2, warmup_steps=0, **kw)


def _trainer(tmp_path=None, callbacks=(), **kw):
    args = dict(
        max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
    )
    return pl.Trainer(callbacks=list(callbacks), **{**args, **kw})


def _equal(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_skipped_step_leaves_weights_bit_identical_and_training_goes_on():
    guard, snap = NonFiniteGuard(policy="skip", max_consecutive_skips=3), Snapshots()
    model = _model(bad_steps={2})
    trainer = _trainer(callbacks=[guard, snap])
    with pytest.warns(UserWarning, match=r"skipped non-finite loss at global step 2 .*param group\(s\) \[0, 1\]"):
        trainer.fit(model, _loader())
    assert guard.skipped_steps == 1 and guard.consecutive_skips == 0 and guard.scaler_skips == 0
    assert _equal(snap.before[2], snap.before[3])  # step 2 changed nothing
    assert not _equal(snap.before[1], snap.before[2]) and not _equal(snap.before[3], snap.before[4])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # global_step and the LR schedule advance on the skipped step as on any other.
    assert trainer.global_step == 6 and snap.steps == [1, 2, 3, 4, 5, 6]
    assert snap.lrs == sorted(snap.lrs, reverse=True) and len(set(snap.lrs)) == 6
    # AdamW's state did not count the skipped step.
    state = trainer.optimizers[0].state[next(iter(model.parameters()))]
    assert int(state["step"]) == 5
    assert "first 'model." in guard.last_report and "param group 0, weight_decay=0.1" in guard.last_report


def test_counter_stops_after_n_bad_steps_in_a_row():
    guard, snap = NonFiniteGuard(policy="skip", max_consecutive_skips=3), Snapshots()
    model = _model(bad_steps={1, 3, 4, 5, 6})  # 1 alone (reset by step 2), then 3, 4, 5 in a row
    trainer = _trainer(callbacks=[guard, snap], max_steps=10)
    with pytest.warns(UserWarning, match="skipped"), pytest.raises(NonFiniteError, match=r"after 3 non-finite steps in a row.*global step 5"):
        trainer.fit(model, _loader())
    assert guard.skipped_steps == 4 and guard.consecutive_skips == 3
    assert _equal(snap.before[3], snap.before[5])
    assert all(torch.equal(a, b) for a, b in zip(snap.before[5].values(), model.state_dict().values()))


def test_stop_policy_keeps_the_last_good_checkpoint(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=2, save_top_k=-1)
    model = _model(bad_steps={5})
    trainer = _trainer(tmp_path, callbacks=[NonFiniteGuard(policy="stop"), ckpt], enable_checkpointing=True, max_steps=10)
    with pytest.raises(NonFiniteError, match=r"non-finite loss at global step 5 .*param group\(s\) \[0, 1\]"):
        trainer.fit(model, _loader())
    last = tmp_path / "ckpt" / "last.ckpt"
    saved = torch.load(last, weights_only=True, map_location="cpu")
    assert saved["global_step"] == 4  # nothing written after the bad step
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    gpt = load_gpt(last)
    assert all(torch.isfinite(p).all() for p in gpt.parameters())
    assert torch.equal(gpt.lm_head.weight, saved["state_dict"]["model.lm_head.weight"])


def test_loss_only_nonfinite_with_finite_gradients_is_caught():
    guard, snap = NonFiniteGuard(policy="skip"), Snapshots()
    trainer = _trainer(callbacks=[guard, snap], max_steps=3)
    with pytest.warns(UserWarning, match="non-finite loss at global step 1 .*gradients are finite"):
        trainer.fit(_model(bad_steps={1}, mode="inf"), _loader())
    assert guard.skipped_steps == 1 and _equal(snap.before[1], snap.before[2])


def test_nonfinite_gradient_with_a_finite_loss_is_caught_and_named():
    guard, snap = NonFiniteGuard(policy="skip"), Snapshots()
    trainer = _trainer(callbacks=[guard, snap], max_steps=5)
    with pytest.warns(UserWarning, match=r"global step 2 .*'model\.transformer\.h\.1\.mlp\.c_proj\.weight'"):
        trainer.fit(_model(bad_steps={2}, mode="grad"), _loader())
    assert guard.skipped_steps == 1 and _equal(snap.before[2], snap.before[3])
    assert not _equal(snap.before[1], snap.before[2]) and not _equal(snap.before[3], snap.before[4])


def test_without_guard_the_nan_reaches_the_weights():
    """The poisoned module really corrupts an unguarded run (so the tests above can fail)."""
    model = _model(bad_steps={1})
    _trainer(max_steps=3).fit(model, _loader())
    assert not all(torch.isfinite(p).all() for p in model.parameters())


class _FP16CPU(MixedPrecision):
    """fp16 autocast with a GradScaler on CPU; a huge initial scale makes the fp16 gradients overflow."""

    def __init__(self, init_scale=2.0**16):
        super().__init__("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))


def test_fp16_grad_scaler_skips_are_reported_not_counted():
    guard, snap = NonFiniteGuard(policy="stop"), Snapshots()  # "stop" would raise if it counted them
    trainer = _trainer(callbacks=[guard, snap], max_steps=3, plugins=[_FP16CPU(init_scale=2.0**100)])
    with pytest.warns(UserWarning, match=r"GradScaler skips non-finite gradients at global step \d .*not counted") as said:
        trainer.fit(_model(), _loader())
    assert [str(w.message).split(" (epoch")[0][-1] for w in said if "GradScaler skips" in str(w.message)] == ["0", "1", "2"]
    assert guard.scaler_skips == 3 and guard.skipped_steps == 0
    assert _equal(snap.before[0], snap.before[2]) and _equal(snap.before[2], _model_state(trainer))
    assert trainer.precision_plugin.scaler.get_scale() == 2.0**97  # halved by the scaler on each of its skips


def _model_state(trainer):
    return trainer.lightning_module.state_dict()


def test_fp16_nonfinite_loss_counts_under_the_scaler():
    guard = NonFiniteGuard(policy="stop")
    trainer = _trainer(callbacks=[guard], max_steps=3, plugins=[_FP16CPU()])
    with pytest.raises(NonFiniteError, match="non-finite loss at global step 1"):
        trainer.fit(_model(bad_steps={1}), _loader())
    assert guard.skipped_steps == 1 and guard.scaler_skips == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(policy="ignore"), "policy must be 'skip' or 'stop'"),
        (dict(max_consecutive_skips=0), "max_consecutive_skips must be an integer >= 1"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NonFiniteGuard(**kwargs)


def test_state_dict_round_trip_is_weights_only_safe(tmp_path):
    guard = NonFiniteGuard()
    guard.skipped_steps, guard.scaler_skips, guard.consecutive_skips = 3, 2, 1
    torch.save(guard.state_dict(), tmp_path / "s.pt")
    other = NonFiniteGuard()
    other.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert (other.skipped_steps, other.scaler_skips, other.consecutive_skips) == (3, 2, 1)


def _two_optimizer_run(guard, bad_batches, fused=False, **kw):
    """TwoOptimizerModule (manual optimisation, two optimizers) whose loss is NaN on the given batches."""
    from tests._module_shapes import TwoOptimizerModule, shape_loader

    class Poisoned(TwoOptimizerModule):
        def training_step(self, batch, batch_idx):
            if batch_idx in bad_batches:
                batch = (batch[0], batch[1])
                self.model.lm_head.weight.data[0, 0] = math.nan  # every gradient goes NaN, in both optimizers
                try:
                    return super().training_step(batch, batch_idx)
                finally:
                    self.model.lm_head.weight.data[0, 0] = 0.0
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            first, second = super().configure_optimizers()
            if not fused:
                return first, second
            return (torch.optim.AdamW(first.param_groups[0]["params"], lr=1e-3, fused=True),
                    torch.optim.SGD(second.param_groups[0]["params"], lr=1e-2, fused=True))

    torch.manual_seed(0)
    module, snap = Poisoned(), Snapshots()
    trainer = _trainer(callbacks=[guard, snap], max_steps=8, **kw)
    trainer.fit(module, shape_loader("litgpt", batch_size=4))
    return trainer, module, snap


def test_two_manual_optimizers_count_one_bad_batch_once():
    guard = NonFiniteGuard(max_consecutive_skips=2, mode="step")
    with pytest.warns(UserWarning, match=r"skipped non-finite loss at global step 2 .*\(1/2 in a row\)"):
        trainer, _, snap = _two_optimizer_run(guard, bad_batches={1})
    # one bad batch: skipped once, not stopped as if two bad steps had come in a row; both optimizers skipped
    assert guard.skipped_steps == 1 and guard.consecutive_skips == 0 and trainer.global_step == 8
    changed = [k for k in snap.before[2] if not torch.equal(snap.before[2][k], snap.before[4][k])]
    assert changed == ["model.lm_head.weight"]  # only the poke of the test itself, undone after the step
    assert not torch.equal(snap.before[4]["model.h.0.attn.qkv.weight"], snap.before[6]["model.h.0.attn.qkv.weight"])


def test_two_manual_optimizers_count_bad_batches_in_a_row_and_deferred():
    guard = NonFiniteGuard(max_consecutive_skips=2, mode="step")
    with pytest.warns(UserWarning, match="1/2 in a row"), pytest.raises(NonFiniteError, match="after 2 non-finite steps in a row"):
        _two_optimizer_run(guard, bad_batches={1, 2})
    assert guard.skipped_steps == 2
    guard = NonFiniteGuard(max_consecutive_skips=2, mode="deferred")
    with pytest.warns(UserWarning, match=r"1 optimizer step\(s\) .* first at global step 2; 1 in a row now \(read at logging step 4\)"):
        trainer, _, _ = _two_optimizer_run(guard, bad_batches={1}, fused=True, log_every_n_steps=4)
    assert guard.skipped_steps == 1 and trainer.global_step == 8
