"""`choose_strategy`: DDP when the model trains on one GPU, else FSDP2 (``ModelParallelStrategy``), with activation
checkpointing and then tensor parallelism within a node when FSDP2 alone does not fit or does not scale; a plan that
fits no layout is refused (``PlanDoesNotFit``).

The memory estimate and the arithmetic of the tensor-parallel size are in ``docs/parallel.md``.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch import nn

from lightning_gpuopt.model.config import GPTConfig
from lightning_gpuopt.model.tensor_parallel import check_tensor_parallel
from lightning_gpuopt.strategies.checkpointing import (
    AC_COST, AC_ORDER, AC_WORDS, MODE_VALUE, apply_checkpointing, checkpointing_mode, stored_elements,
)
from lightning_gpuopt.perf.activations import measure_activation_bytes, measure_step_activation_bytes
from lightning_gpuopt.perf.device import DeviceFacts, read_device
from lightning_gpuopt.option_checks import check_int, check_number
from lightning_gpuopt.perf.units import GB
from lightning_gpuopt.option_checks import from_command_line
from lightning_gpuopt.checkpoint.model_parallel import AtomicModelParallelStrategy

__all__ = [
    "AUTO_STRATEGY", "NETWORK_BANDWIDTH", "MemoryEstimate", "PlanDoesNotFit", "choose_strategy", "estimate_memory",
    "estimate_module_memory",
]

AUTO_STRATEGY = "gpuopt-auto"  # the trainer.strategy value the gpuopt CLI resolves with choose_strategy
_STATE_BYTES_PER_PARAM = 16  # fp32 weights, gradients and AdamW's two moments
# Bytes/s per GPU between nodes: one 400 Gb/s InfiniBand or RoCE link per GPU (eight per node, as DGX/HGX H100).
NETWORK_BANDWIDTH = 50e9

# The share of the peak a well-tuned run reaches (MFUMonitor's figure on H100s is 35-50%): the compute time
# FSDP2's communication hides behind. Lower would hide more, so this errs towards adding tensor parallelism.
_ASSUMED_MFU = 0.4
_POWERS_OF_TWO = (1, 2, 4, 8, 16, 32, 64)


class MemoryEstimate(dict):
    """Bytes on one device: ``params``, ``model_state``, ``activations``, ``logits`` (a dict); ``figures`` says
    where the numbers came from, for the message of :func:`choose_strategy`."""

    figures: str = "16 B per parameter (fp32 weights+grads+AdamW), the block's activations per token per layer"

    @property
    def total(self) -> float:
        return self["model_state"] + self["activations"] + self["logits"]


def estimate_memory(config: GPTConfig, micro_batch: int, block_size: int,
                    precision: str = "bf16-mixed") -> MemoryEstimate:
    """Training memory of ``config`` on one device without sharding (``docs/parallel.md``), e.g.
    ``estimate_memory(GPTConfig.from_name("1.5b"), micro_batch=8, block_size=1024)["model_state"]`` ~25 GB.

    Args:
        micro_batch: Sequences per micro-batch on a data-parallel rank (one device, or a tensor-parallel group).
        block_size: Tokens per sequence.
        precision: The Trainer's precision string; ``32``/``64`` activations count double.
    """
    params = config.num_params()
    tokens = micro_batch * block_size
    act_bytes = 4 if str(precision).startswith(("32", "64")) else 2
    activations = (
        tokens * stored_elements(config, 1, config.activation_checkpointing, config.activation_elements()) * act_bytes
    )
    est = MemoryEstimate(
        params=params,
        model_state=_STATE_BYTES_PER_PARAM * params,
        activations=activations,
        logits=tokens * config.padded_vocab_size * 10,
    )
    kind = "16-bit" if act_bytes == 2 else "32-bit"
    est.figures = (f"block formula ({config.mlp} MLP): 16 B per parameter (fp32 weights+grads+AdamW), {act_bytes} x "
                   f"({config.activation_formula()}) B per token per layer ({kind} activations, precision {precision})")
    return est


def _config_of(model: Any) -> Optional[GPTConfig]:
    if isinstance(model, GPTConfig):
        return model
    config = getattr(model, "config", None)
    return config if isinstance(config, GPTConfig) else None


_TRUE_DTYPES = {"16-true": torch.float16, "bf16-true": torch.bfloat16, "32-true": torch.float32,
                "64-true": torch.float64}


def estimate_module_memory(
    module: nn.Module,
    micro_batch: int,
    block_size: int,
    precision: str = "bf16-mixed",
    activation_bytes: Optional[float] = None,
    batch: Any = None,
) -> MemoryEstimate:
    """Training memory of any module on one device without sharding (``docs/parallel.md``).

    Args:
        module: A LightningModule or ``nn.Module`` with its parameters built (meta tensors are fine).
        activation_bytes: Activation bytes of one micro-batch on one device, if known; else the module's
            ``activation_bytes(micro_batch, block_size, precision)``, else measured.
        batch: A training batch (real or meta tensors): activations are measured over ``training_step(batch)``,
            scaled to ``micro_batch`` samples; ``None`` measures ``forward(input_ids)``.
    """
    name = type(module).__name__
    unique = {id(p): p for p in module.parameters()}.values()
    if not unique:
        raise ValueError(
            f"choose_strategy: {name} has no parameters yet (built in configure_model?): build them first, e.g. "
            "`with torch.device('meta'): module.configure_model()`, and pass the module."
        )
    forced = _TRUE_DTYPES.get(str(precision))
    params = sum(p.numel() for p in unique)
    state, dtypes = 0, set()
    for p in unique:
        dtype = forced or p.dtype
        dtypes.add(str(dtype).replace("torch.", ""))
        size = torch.empty((), dtype=dtype).element_size()
        state += p.numel() * size * (4 if p.requires_grad else 1)
    figures = (
        f"{name}'s parameters ({'/'.join(sorted(dtypes))}; 4 x itemsize B each when trainable: weights+grads+AdamW)"
    )
    own = getattr(module, "activation_bytes", None)
    if activation_bytes is not None:
        activations, logits = float(activation_bytes), 0.0
        figures += ", activation_bytes= as given"
    elif callable(own):
        activations, logits = float(own(micro_batch, block_size, precision)), 0.0
        figures += f", activations from {name}.activation_bytes()"
    elif batch is not None:
        samples = _batch_shape(batch)[0]
        try:
            measured, reads = measure_step_activation_bytes(module, batch, precision)
        except Exception as err:
            raise ValueError(
                f"choose_strategy could not estimate the activations of {name} (training_step(batch) on meta tensors "
                f"failed: {err}): pass choose_strategy(activation_bytes=...) (bytes of one micro-batch on one device) "
                "or give the module an `activation_bytes(micro_batch, block_size, precision)` method."
            ) from err
        activations, logits = (float(v) * micro_batch / samples for v in (measured.saved, measured.logits))
        answered = f"; {reads} host read(s) answered with 1" if reads else ""
        figures += (
            f", activations measured (tensors training_step(batch) saves for backward, on meta tensors, "
            f"{samples} sample(s) scaled to {micro_batch}{answered})"
        )
    else:
        ids = torch.zeros(micro_batch, block_size, dtype=torch.long, device="meta")
        try:
            measured = measure_activation_bytes(module, ids, precision)
        except Exception as err:
            raise ValueError(
                f"choose_strategy could not estimate the activations of {name} (forward(input_ids) on meta tensors "
                f"failed: {err}): pass choose_strategy(batch=...) (a training batch, measured over training_step), "
                "activation_bytes=... (bytes of one micro-batch on one device) "
                "or give the module an `activation_bytes(micro_batch, block_size, precision)` method."
            ) from err
        activations, logits = float(measured.saved), float(measured.logits)
        figures += ", activations measured (tensors forward(input_ids) saves for backward, on meta tensors)"
    est = MemoryEstimate(params=params, model_state=state, activations=activations, logits=logits)
    est.figures = figures
    return est


def _batch_shape(batch: Any) -> tuple[int, int]:
    """Samples and tokens per sample of a batch: the first and last dimensions of its first tensor."""
    values = (
        [batch] if isinstance(batch, torch.Tensor) else list(batch.values()) if isinstance(batch, dict) else list(batch)
    )
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0]), int(value.shape[-1])
    raise ValueError("choose_strategy(batch=...) holds no tensor with a batch dimension: give a batch as the loader "
                     "yields it.")


def _block_size_of(model: Any) -> Optional[int]:
    for holder in (getattr(model, "config", None), getattr(model, "hparams", None)):
        for key in ("block_size", "max_seq_len", "max_position_embeddings", "n_positions"):
            value = getattr(holder, key, None) if holder is not None else None
            if value is None and isinstance(holder, dict):
                value = holder.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _check_devices(devices: Any, devices_per_node: Any, headroom: float) -> int:
    """Check the device counts and the headroom; the devices of one node."""
    check_int("choose_strategy", "devices", devices, minimum=1)
    check_number("choose_strategy", "headroom", headroom, low=0, high=1, low_open=True)
    per_node = devices if devices_per_node is None else devices_per_node
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1 or devices % per_node:
        raise ValueError(
            f"choose_strategy(devices_per_node={devices_per_node!r}) must be a positive integer dividing "
            f"devices={devices} (the devices of one node; every node has as many)."
        )
    return per_node


def _memory_of(facts: DeviceFacts) -> float:
    if facts.total_memory is None:
        raise ValueError(  # the fix as the user gives it: the gpuopt command's options, or the function's arguments
            f"trainer.strategy=gpuopt-auto plans for a GPU, and this machine has none ({facts.describe()}): name the "
            "GPU to plan for, --auto_strategy.device 'H100 SXM' (or --auto_strategy.device_memory_gb 80), with "
            "--auto_strategy.print_plan true to see the plan without training; or name a strategy, "
            "--trainer.strategy auto."
            if from_command_line()
            else f"choose_strategy cannot read a GPU's memory on {facts.describe()} (no CUDA): pass "
            "device_memory= (bytes) or device= (e.g. perf.device.REFERENCE_DEVICES['H100 SXM'])."
        )
    return float(facts.total_memory)


def _estimate(model: Any, config: Optional[GPTConfig], micro_batch: int, block_size: Optional[int], precision: str,
              activation_bytes: Optional[float], batch: Any) -> tuple[MemoryEstimate, int]:
    """The memory estimate of one full replica, and the sequence length it is for."""
    if config is not None:
        block_size = block_size or config.block_size
        est = estimate_memory(config, micro_batch, block_size, precision)
        if activation_bytes is not None:
            est["activations"], est["logits"] = float(activation_bytes), 0.0
            est.figures += "; activation_bytes= as given"
        return est, block_size
    block_size = block_size or _block_size_of(model) or (_batch_shape(batch)[1] if batch is not None else None)
    if block_size is None:
        raise ValueError(
            f"choose_strategy cannot tell the sequence length of {type(model).__name__}: pass block_size= "
            "(tokens per sequence)."
        )
    return estimate_module_memory(model, micro_batch, block_size, precision, activation_bytes, batch), block_size


def choose_strategy(
    model,
    devices: int,
    device_memory: Optional[float] = None,
    precision: str = "bf16-mixed",
    micro_batch: int = 8,
    block_size: Optional[int] = None,
    headroom: float = 0.85,
    activation_bytes: Optional[float] = None,
    device: Optional[DeviceFacts] = None,
    batch: Any = None,
    devices_per_node: Optional[int] = None,
    network_bandwidth: float = NETWORK_BANDWIDTH,
) -> tuple[Union[Strategy, str], str]:
    """Pick DDP when the whole training state plus activations fits on one device, else FSDP2, with activation
    checkpointing, then tensor parallelism within a node, when FSDP2 alone does not fit or does not scale
    (``docs/parallel.md``).

    Example::

        strategy, reason = choose_strategy(GPTConfig.from_name("1.5b"), devices=8, device_memory=16e9)
        trainer = Trainer(devices=8, strategy=strategy)   # in YAML: trainer.strategy: gpuopt-auto

    Args:
        model: A ``GPTConfig``, ``GPT`` or ``GPTModule`` (estimated by the config's formulas), or any other
            ``nn.Module``/LightningModule (estimated from its parameters and measured activations).
        devices, devices_per_node: Devices of the run, all nodes together, and of one node (``None``: one node).
        device_memory: Bytes per device; ``None`` takes those of ``device``, the GPU to plan for
            (``REFERENCE_DEVICES["V100"]``, ...; ``None`` reads this machine's).
        precision, micro_batch, block_size: The Trainer's precision, sequences per device per micro-batch,
            tokens per sequence (``None``: the model's).
        headroom: Fraction of ``device_memory`` the estimate may use.
        activation_bytes: Activation bytes of one micro-batch on one device, replacing the estimate's.
        batch: A training batch of a module not ours: activations are measured over ``training_step(batch)``.
        network_bandwidth: Bytes/s per GPU between nodes, for whether FSDP2's all-gathers hide behind compute.

    Returns:
        ``(strategy, reason)``: ``"auto"`` (one device), a ``DDPStrategy`` or an ``AtomicModelParallelStrategy``
        (FSDP2, with tensor parallelism when ``tp > 1``), and a few short lines: the decision first, then why, the
        model and the budget. Activation checkpointing is tried before tensor parallelism (none, ``"selective"``,
        ``"full"``), and the mode chosen is set on ``model``'s config (and a ``GPTModule``'s hyper-parameters).

    Raises:
        PlanDoesNotFit: No layout fits; the message starts with "Does not fit" and names the smallest device count
            (in whole nodes) or micro-batch that fits.
    """
    config = _config_of(model)
    if config is None and not isinstance(model, nn.Module):
        raise ValueError(
            "choose_strategy needs a model: a GPTConfig, or any nn.Module / LightningModule, got "
            f"{type(model).__name__}."
        )
    per_node = _check_devices(devices, devices_per_node, headroom)
    check_number("choose_strategy", "device_memory", device_memory, low=0, low_open=True, optional=True,
                 hint=" (bytes per device)")
    facts = device
    if device_memory is None:
        facts = device if device is not None else read_device()
        device_memory = _memory_of(facts)
    est, block_size = _estimate(model, config, micro_batch, block_size, precision, activation_bytes, batch)
    budget = headroom * device_memory
    where = f"{facts.name if facts is not None and facts.name != 'cpu' else 'GPU'} ({device_memory / GB:.1f} GB)"
    numbers = (
        f"model: {est['params'] / 1e6:,.0f}M params"
        + (f", vocabulary {config.vocab_size:,}" if config is not None else "")
        + f", micro-batch {micro_batch} x {block_size:,} tokens; {est['model_state'] / GB:.1f} GB weights+grads+AdamW, "
        f"{est['activations'] / GB:.1f} GB activations + {est['logits'] / GB:.1f} GB logits for a full replica"
        f"\nbudget: {budget / GB:.1f} GB per device ({headroom:.0%} of {where}); figures: {est.figures}"
    )
    if est.total <= budget:
        if devices == 1:
            return "auto", f"One device: the model fits ({est.total / GB:.1f} GB).\n{numbers}."
        return DDPStrategy(), (f"DDP over {devices} devices: a full replica fits on each ({est.total / GB:.1f} GB)."
                               f"\n{numbers}.")
    if config is None:
        return _plan_own_module(model, est, devices, budget, numbers)
    peak = (facts.peak_tflops("bf16") or facts.peak_tflops("fp16")) if facts is not None else None  # fp16 where no bf16
    plan = _ShardingPlan(config, est, devices, per_node, micro_batch, block_size, precision, budget,
                         activation_bytes is not None)
    chosen = plan.choose(None if peak is None else peak * 1e12, network_bandwidth)
    if chosen is None:
        raise PlanDoesNotFit(plan.refusal(where) + f"\n{numbers.splitlines()[0]}.")  # three lines: what, why, the model
    tp, ac, why = chosen
    configured = checkpointing_mode(config.activation_checkpointing)
    apply_checkpointing(model, config, ac)
    sets = f"; sets model.activation_checkpointing={MODE_VALUE[ac]}" if ac != configured else ""
    if devices == 1:
        return "auto", (f"One device with {AC_WORDS[ac]}: {plan.bytes(tp, ac=ac) / GB:.1f} GB{sets}.\nwhy: {why}\n"
                        f"{numbers}.")
    name = "FSDP2" if tp == 1 else f"FSDP2 + tensor parallel {tp}"
    decision = (f"{name} (ModelParallelStrategy, {devices // tp} data-parallel x {tp} tensor-parallel) with "
                f"{AC_WORDS[ac]}: {plan.bytes(tp, ac=ac) / GB:.1f} GB per device{sets}.")
    strategy = AtomicModelParallelStrategy(data_parallel_size=devices // tp, tensor_parallel_size=tp)
    return strategy, f"{decision}\nwhy: {why}\n{numbers}."


class PlanDoesNotFit(ValueError):
    """No layout fits the devices planned for: the message starts with "Does not fit" and names the smallest device
    count, or the setting, that fits."""


def _plan_own_module(model: Any, est: MemoryEstimate, devices: int, budget: float,
                     numbers: str) -> tuple[Strategy, str]:
    """FSDP2 for a module not ours (no checkpointing the planner can set): it fits sharded, or is refused."""
    name = type(model).__name__
    sharded = est["model_state"] / devices + est["activations"] + est["logits"]
    if devices == 1 or sharded > budget:
        room = budget - est["activations"] - est["logits"]
        least = f"train on at least {math.ceil(est['model_state'] / room)} devices, or " if room > 0 else ""
        raise PlanDoesNotFit(
            f"Does not fit: {name} needs {(est.total if devices == 1 else sharded) / GB:.1f} GB per device on "
            f"{devices} device{'s' if devices > 1 else ''}, over the {budget / GB:.1f} GB budget: {least}lower the "
            f"micro-batch or add activation checkpointing to {name}.\n{numbers.splitlines()[0]}."
        )
    return AtomicModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1), (
        f"FSDP2 over {devices} devices (ModelParallelStrategy): {sharded / GB:.1f} GB per device.\n"
        f"why: a full replica needs {est.total / GB:.1f} GB. {name}.configure_model must apply "
        "torch.distributed.fsdp.fully_shard (as Lightning's ModelParallelStrategy requires), e.g. to each block and "
        f"then the whole model.\n{numbers}."
    )


class _ShardingPlan:
    """Per-device memory of FSDP2 over ``devices / tp`` ranks with tensor parallel ``tp`` and a checkpointing mode, and
    the choice of both: checkpointing is tried before tensor parallelism."""

    def __init__(self, config: GPTConfig, est: MemoryEstimate, devices: int, per_node: int, micro_batch: int,
                 block_size: int, precision: str, budget: float, activations_given: bool) -> None:
        self.config, self.est, self.devices, self.per_node = config, est, devices, per_node
        self.micro_batch, self.block_size, self.precision, self.budget = micro_batch, block_size, precision, budget
        self.activations_given = activations_given
        in_node = [t for t in _POWERS_OF_TWO if t <= per_node and per_node % t == 0]
        self.sizes = [t for t in in_node if self._splits(t)]
        # sizes the model's heads or vocabulary do not divide
        self.unsplit = [t for t in in_node if t not in self.sizes]
        configured = checkpointing_mode(config.activation_checkpointing)
        self.modes = (configured,) if activations_given else AC_ORDER[AC_ORDER.index(configured):]

    def _splits(self, tp: int) -> bool:
        try:
            check_tensor_parallel(self.config, tp)
        except ValueError:
            return False
        return True

    def bytes(self, tp: int, micro_batch: Optional[int] = None, ac: Any = None) -> float:
        """Bytes per device at ``micro_batch`` sequences per data-parallel rank (``None``: the planned one) and
        checkpointing ``ac`` (``None``: the config's)."""
        scale = (micro_batch or self.micro_batch) / self.micro_batch
        state = self.est["model_state"] / self.devices  # FSDP2 and TP together split it over every device
        if self.activations_given:
            return state + scale * (self.est["activations"] + self.est["logits"]) / tp
        tokens = (micro_batch or self.micro_batch) * self.block_size
        act_bytes = 4 if str(self.precision).startswith(("32", "64")) else 2
        mode = self.config.activation_checkpointing if ac is None else ac
        act = tokens * stored_elements(self.config, tp, mode, self.config.activation_elements()) * act_bytes
        return state + act + scale * self.est["logits"] / tp  # vocabulary-parallel loss: V / tp logits

    def most_sequences(self, tp: int, ac: Any = None) -> int:
        """The largest micro-batch (sequences per data-parallel rank) that fits the budget."""
        fixed = self.est["model_state"] / self.devices
        per_sequence = (self.bytes(tp, ac=ac) - fixed) / self.micro_batch
        return max(0, int((self.budget - fixed) // per_sequence)) if per_sequence > 0 else 0

    def choose(self, peak_flops: Optional[float], network_bandwidth: float) -> Optional[tuple[int, Any, str]]:
        """``(tp, checkpointing, why)``: the first layout that fits and scales, trying checkpointing (none, selective,
        full) before each larger tensor-parallel size; ``None`` when none fits."""
        nodes = self.devices // self.per_node
        needed = None
        if nodes > 1 and peak_flops is not None:
            param_bytes = 4 if str(self.precision).startswith(("32", "64")) else 2
            moved = 2 * param_bytes + 4  # per parameter and micro-batch: two all-gathers, a float32 reduce-scatter
            needed = moved * peak_flops * _ASSUMED_MFU / (6 * network_bandwidth)
        layouts = [(t, ac) for t in self.sizes for ac in self.modes]
        fitting = [(t, ac) for t, ac in layouts if self.bytes(t, ac=ac) <= self.budget]
        scaling = [
            (t, ac) for t, ac in fitting if needed is None or self.most_sequences(t, ac) * self.block_size >= needed
        ]
        if not fitting:
            return None
        tp, ac = (scaling or fitting)[0]
        # over the budget: the most checkpointed layout of each smaller size, and the lighter modes at the chosen one
        before = layouts[:layouts.index((tp, ac))]
        tried = [(t, a) for t, a in before if t == tp or a == self.modes[-1]]
        why = ("over the budget: "
               + ", ".join(f"{self._name(t, a)} {self.bytes(t, ac=a) / GB:.1f} GB" for t, a in tried)
               + "; " if tried else "") + (
            f"{self._name(tp, ac)} fits ({AC_COST[ac]}, up to {self.most_sequences(tp, ac)} x {self.block_size:,} "
            "tokens per micro-batch)")
        if ac != "full" and tp == 1 and not tried:
            why += ", so no more checkpointing and no tensor parallelism"
        refusal = self.config.tensor_parallel_refusal()
        if refusal is not None and tp == 1 and fitting[0] != (1, self.modes[0]):
            why += f"; tensor parallelism cannot split this model: {refusal}"
        elif self.unsplit and tp == self.sizes[-1] and (tried or (scaling or fitting) is not scaling):
            why += "; " + self._unsplit_reason()
        if needed is not None:
            why += (f".\nnetwork: across {nodes} nodes FSDP2's all-gathers hide behind compute from {needed:,.0f} "
                    f"tokens per micro-batch on a data-parallel rank ({moved} B per parameter over "
                    f"{network_bandwidth / 1e9:.0f} GB/s per GPU, against {_ASSUMED_MFU:.0%} of "
                    f"{peak_flops / 1e12:,.1f} TFLOP/s)")
            if not scaling:
                why += ": no layout within a node reaches that, so the first that fits is used"
            elif self.micro_batch * self.block_size < needed:
                why += f": raise the micro-batch to {math.ceil(needed / self.block_size)} sequences to reach that"
        elif nodes > 1:
            why += f".\nnetwork: across {nodes} nodes, not weighed (this GPU's peak FLOP/s is unknown)"
        return tp, ac, why + "."

    @staticmethod
    def _name(tp: int, ac: Any) -> str:
        return (
            ("FSDP2" if tp == 1 else f"tensor parallel {tp}")
            + f" {'with ' + MODE_VALUE[ac] if ac else 'without'} checkpointing"
        )

    def refusal(self, where: str) -> str:
        """The message of a plan that fits no layout: the smallest device count, or the micro-batch, that fits."""
        best_tp, best_ac = min(((t, a) for t in self.sizes for a in self.modes),
                               key=lambda l: self.bytes(l[0], ac=l[1]))
        least = self._least_devices()
        state = self.est["model_state"] / self.devices
        fixes = [f"train on at least {least} devices" if least else "train on more devices"]
        most, layout = max(((self.most_sequences(t, a), (t, a)) for t in self.sizes for a in self.modes),
                           key=lambda m: m[0])
        if most >= 1:
            fixes.append(f"lower the micro-batch to {most} (data.batch_size; {self._name(*layout)})")
        line = (f"Does not fit on {self.devices} x {where}: " + ", or ".join(fixes) + ".\nwhy: "
                + (f"the model state alone needs {state / GB:.1f} GB per device over {self.devices}"
                   if state > self.budget else
                   f"the smallest layout, {self._name(best_tp, best_ac)}, needs "
                   f"{self.bytes(best_tp, ac=best_ac) / GB:.1f} GB "
                   f"per device at micro-batch {self.micro_batch} x {self.block_size:,} tokens")
                + f", over the {self.budget / GB:.1f} GB budget")
        if self.config.tensor_parallel_refusal() is None and self.unsplit:
            line += "; " + self._unsplit_reason()
        return line + "."

    def _least_devices(self) -> Optional[int]:
        """The smallest device count, in whole nodes of ``per_node``, at which a layout fits (``None``: over 8,192)."""
        for nodes in range(1, 8192 // self.per_node + 1):
            devices = nodes * self.per_node
            if devices <= self.devices:
                continue
            other = _ShardingPlan(self.config, self.est, devices, self.per_node, self.micro_batch, self.block_size,
                                  self.precision, self.budget, self.activations_given)
            if other.choose(None, NETWORK_BANDWIDTH) is not None:
                return devices
        return None

    def _unsplit_reason(self) -> str:
        """Why the tensor-parallel sizes above the largest considered were left out (their shares would be uneven)."""
        cfg, above = self.config, self.unsplit[0]
        parts = cfg.tensor_parallel_splits()
        bad = ", ".join(f"{k}={v}" for k, v in parts.items() if v % above)
        return f"tensor parallel {above} or more is not considered: it does not divide {bad}"
