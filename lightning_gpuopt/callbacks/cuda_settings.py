"""`CUDASettings`: TF32, cuDNN autotuning, SDPA kernels, expandable allocator segments; set early, undone after."""

from __future__ import annotations

import os
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_gpuopt.option_checks import check_choice, check_names, option
from lightning_gpuopt.precision.dtype import compute_dtype_name
from lightning_gpuopt.internals import (
    sdp_priority_order,
    set_allocator_settings,
    set_sdp_priority_order,
    set_sdpa_backends,
)
from lightning_gpuopt.perf.device import DeviceFacts, cuda_device_count, training_device
from lightning_gpuopt.perf.sdpa import SDPA_BACKENDS as _SDPA_BACKENDS
from lightning_gpuopt.perf.sdpa import SDPA_FLAGS as _SDPA_FLAGS
from lightning_gpuopt.perf.sdpa import attention_row, auto_sdpa_order, flash_skipped, set_sdpa_priority
from lightning_gpuopt.perf.tf32 import capture_tf32, restore_tf32, set_tf32

__all__ = ["CUDASettings", "plan_settings"]

_MATMUL_PRECISIONS = ("highest", "high", "medium")
_ALLOC_ENV_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # new name first (torch >= 2.9), then legacy


def _alloc_conf_var() -> str:
    """The allocator env var to edit: the one already set, else the legacy name every torch version reads."""
    return next((name for name in _ALLOC_ENV_VARS if name in os.environ), "PYTORCH_CUDA_ALLOC_CONF")


def _with_option(conf: str, key: str, value: str) -> str:
    options = [o for o in conf.split(",") if o.strip() and o.split(":")[0].strip() != key]
    return ",".join([*options, f"{key}:{value}"])


def _apply_allocator(expandable_segments: bool, cuda_initialized: bool) -> str:
    """Turn the allocator's expandable segments on or off; the settings-table status of doing so."""
    var = _alloc_conf_var()
    conf = _with_option(os.environ.get(var, ""), "expandable_segments", "True" if expandable_segments else "False")
    if cuda_initialized:
        try:
            # The whole configuration, so the variable's other options stay in force.
            set_allocator_settings(conf)
        except (RuntimeError, ValueError, AttributeError) as err:
            return f"not applied: CUDA was already initialised and the allocator refused ({err})"
        return "applied at runtime (CUDA already initialised): affects new memory segments"
    os.environ[var] = conf
    return f"applied via {var} before CUDA initialisation"


def _capture() -> dict[str, Any]:
    """The global state this callback may change."""
    return {
        "tf32": capture_tf32(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "sdpa_enabled": {
            name: getattr(torch.backends.cuda, f"{flag}_sdp_enabled")() for name, flag in _SDPA_FLAGS.items()
        },
        "sdpa_priority": sdp_priority_order(),
        "env": {name: os.environ.get(name) for name in _ALLOC_ENV_VARS},
    }


def _matmul_precision(tf32: Optional[bool], given: Optional[str]) -> Optional[str]:
    """``torch.set_float32_matmul_precision``'s value: as given, else ``high`` with TF32, ``highest`` without."""
    return given or {True: "high", False: "highest"}.get(tf32)


def plan_settings(
    facts: DeviceFacts,
    *,
    tf32: Optional[bool] = True,
    cudnn_benchmark: Optional[bool] = True,
    sdpa_backends: Union[None, Literal["auto"], list[str]] = "auto",
    expandable_segments: Optional[bool] = True,
    matmul_precision: Optional[str] = None,
) -> list[tuple[str, str, str]]:
    """What :class:`CUDASettings` with these options (as its own) does on the training device ``facts``: its
    ``(setting, value, status)`` rows, e.g. ``("tf32", "True", "applied, no effect: ...")`` on a V100."""
    done = "applied" if facts.is_cuda else "no effect: no CUDA device"
    rows = []
    if expandable_segments is not None:
        rows.append(("expandable_segments", str(expandable_segments), done))
    if tf32 is not None:
        no_tf32_cores = tf32 and facts.is_cuda and tuple(facts.capability or (0, 0)) < (8, 0)  # TF32 came with Ampere
        no_effect = ", no effect: TF32 tensor cores need compute capability >= 8.0" if no_tf32_cores else ""
        rows.append(("tf32", str(tf32), done + no_effect))
    precision = _matmul_precision(tf32, matmul_precision)
    if precision is not None:
        rows.append(("matmul_precision", precision, done))
    if cudnn_benchmark is not None:
        rows.append(("cudnn_benchmark", str(cudnn_benchmark), done))
    if sdpa_backends == "auto":
        rows.append(("sdpa_backends", "auto", auto_sdpa_order(facts)[1]))
    elif sdpa_backends is not None:
        skipped = (
            "; flash needs compute capability >= 8.0, so it is skipped on this GPU"
            if flash_skipped(facts, sdpa_backends)
            else ""
        )
        rows.append(("sdpa_backends", ",".join(sdpa_backends), done + skipped))
    return rows


def _cpu_line(rows: list[tuple[str, str, str]]) -> str:
    """The one line logged when training on a CPU, where none of the settings takes effect."""
    if not rows:
        return "CUDASettings: no CUDA device, nothing to set."
    would = ", ".join(f"{name}={value}" for name, value, _ in rows)
    return (
        f"CUDASettings: no CUDA device, nothing to set (on a GPU: {would}; "
        f"{option('CUDASettings', 'verbose', True)} shows the table)."
    )


class CUDASettings(Callback):
    """Turns on the fast CUDA defaults for transformer training, early enough to count, and restores them at teardown.

    Settings are applied when the callback is constructed (before the ``Trainer`` touches the device),
    the GPU-dependent ones at ``setup``; a table of what was set, and what could not be and why, is logged
    once. Without a CUDA device nothing is set. Details: ``docs/callbacks.md``.

    Example::

        trainer = Trainer(callbacks=[CUDASettings(sdpa_backends=["cudnn", "flash", "efficient"])])

    Args:
        tf32: Let fp32 matmuls and convolutions use TF32 tensor cores; ``None`` leaves them.
        cudnn_benchmark: Autotune cuDNN convolution algorithms; ``None`` leaves it.
        sdpa_backends: Attention kernels allowed, in priority order, from ``cudnn``, ``flash``,
            ``efficient``, ``math``; the others are disabled. ``"auto"`` puts cuDNN first on H100, H200
            and B200 with cuDNN >= 9.15 and disables nothing. ``None`` leaves them.
        expandable_segments: Use the caching allocator's expandable segments (less fragmentation);
            ``None`` leaves it.
        matmul_precision: ``torch.set_float32_matmul_precision`` value; ``None`` derives it from ``tf32``.
        verbose: Log the whole table also when training on a CPU.

    Note:
        Construct the callback before anything allocates CUDA memory: afterwards the allocator option
        only affects new memory segments. A ``Trainer(benchmark=...)`` given explicitly overrides
        ``cudnn_benchmark``.
    """

    def __init__(
        self,
        tf32: Optional[bool] = True,
        cudnn_benchmark: Optional[bool] = True,
        sdpa_backends: Union[None, Literal["auto"], list[str]] = "auto",
        expandable_segments: Optional[bool] = True,
        matmul_precision: Optional[str] = None,
        verbose: bool = False,
    ) -> None:
        if sdpa_backends is not None and sdpa_backends != "auto":
            if isinstance(sdpa_backends, str):
                sdpa_backends = [sdpa_backends]
            check_names("CUDASettings", "sdpa_backends", sdpa_backends, list(_SDPA_BACKENDS))
        check_choice("CUDASettings", "matmul_precision", matmul_precision, _MATMUL_PRECISIONS, optional=True)
        if matmul_precision == "highest" and tf32:
            raise ValueError("CUDASettings(tf32=True, matmul_precision='highest') contradict each other: drop one.")
        if matmul_precision in ("high", "medium") and tf32 is False:
            raise ValueError(
                f"CUDASettings(tf32=False, matmul_precision={matmul_precision!r}) contradict each other: "
                f"matmul_precision={matmul_precision!r} turns TF32 matmuls on. Drop one."
            )
        self.tf32 = tf32
        self.cudnn_benchmark = cudnn_benchmark
        self.sdpa_backends = list(sdpa_backends) if sdpa_backends not in (None, "auto") else sdpa_backends
        self.expandable_segments = expandable_segments
        self.matmul_precision = matmul_precision
        self.verbose = verbose
        self.report: list[tuple[str, str, str]] = []  # (setting, value, status)
        self._saved: Optional[dict[str, Any]] = None
        self._allocator_status: Optional[str] = None
        self._logged = False
        self._apply()

    def _options(self) -> dict[str, Any]:
        names = ("tf32", "cudnn_benchmark", "sdpa_backends", "expandable_segments", "matmul_precision")
        return {name: getattr(self, name) for name in names}

    def _apply(self) -> None:
        """Set what does not depend on the GPU, where there is one (counted without initialising CUDA)."""
        if self._saved is None and cuda_device_count() > 0:
            self._set()

    def _set(self) -> None:
        """Save the global state, then set the allocator option, TF32, cuDNN autotuning and an SDPA list."""
        self._saved = _capture()
        if self.expandable_segments is not None:  # first: nothing below may initialise CUDA before it
            # Whether this process already initialised CUDA decides how the allocator can still be told.
            # runtime state: has the allocator started?
            self._allocator_status = _apply_allocator(self.expandable_segments, torch.cuda.is_initialized())
        set_tf32(self.tf32, _matmul_precision(self.tf32, self.matmul_precision))
        if self.cudnn_benchmark is not None:
            torch.backends.cudnn.benchmark = self.cudnn_benchmark
        if isinstance(self.sdpa_backends, list):
            from torch.nn.attention import SDPBackend

            set_sdpa_backends([getattr(SDPBackend, _SDPA_BACKENDS[b]) for b in self.sdpa_backends])

    def _restore(self) -> None:
        saved, self._saved = self._saved, None
        if saved is None:
            return
        restore_tf32(saved["tf32"])
        torch.backends.cudnn.benchmark = saved["cudnn_benchmark"]
        for name, enabled in saved["sdpa_enabled"].items():
            getattr(torch.backends.cuda, f"enable_{_SDPA_FLAGS[name]}_sdp")(enabled)
        set_sdp_priority_order(saved["sdpa_priority"])
        for name, value in saved["env"].items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        # Only a process whose allocator exists (CUDA initialised) has a runtime setting to put back.
        if self.expandable_segments is not None and torch.cuda.is_initialized():
            conf = saved["env"][_alloc_conf_var()] or ""
            before = "expandable_segments:true" in conf.lower().replace(" ", "")
            try:
                set_allocator_settings(_with_option(conf, "expandable_segments", str(before)))
            except (RuntimeError, ValueError, AttributeError):
                pass

    def table(self) -> str:
        """What was set and with what result, as a text table."""
        width = max((len(r[0]) for r in self.report), default=7)
        vwidth = max((len(r[1]) for r in self.report), default=5)
        lines = [f"{'setting':<{width}}  {'value':<{vwidth}}  status"]
        lines += [f"{s:<{width}}  {v:<{vwidth}}  {st}" for s, v, st in self.report]
        return "\n".join(lines)

    def rows_for(self, facts: DeviceFacts) -> list[tuple[str, str, str]]:
        """The ``(setting, value, status)`` rows of these settings on the training device ``facts``, with how the
        allocator option was applied in this process. ``report`` is filled only at ``setup``; a caller without a
        Trainer (``gpuopt doctor``) reads the rows here."""
        rows = plan_settings(facts, **self._options())
        if not facts.is_cuda:
            return rows
        return [(n, v, (self._allocator_status or st) if n == "expandable_segments" else st) for n, v, st in rows]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._apply()  # after a previous fit restored the state
        device = trainer.strategy.root_device
        facts = training_device(trainer)  # also binds the precision plugin: the attention row reads its dtype
        rows = self.rows_for(facts)
        if facts.is_cuda:
            order = auto_sdpa_order(facts)[0] if self.sdpa_backends == "auto" else None
            if order is not None:
                set_sdpa_priority(order)
            rows.append(attention_row(pl_module, compute_dtype_name(trainer.precision_plugin), device))
        applied = self._saved is not None
        if applied and self.cudnn_benchmark is not None and torch.backends.cudnn.benchmark != self.cudnn_benchmark:
            rows = [r for r in rows if r[0] != "cudnn_benchmark"]
            rows.append(
                (
                    "cudnn_benchmark",
                    str(self.cudnn_benchmark),
                    f"overridden by {option('Trainer', 'benchmark')}: drop one of the two",
                )
            )
        self.report = rows
        if not self._logged:
            self._logged = True
            if facts.is_cuda or self.verbose:
                rank_zero_info(f"CUDASettings on {facts.describe()}:\n{self.table()}")
            else:
                rank_zero_info(_cpu_line(rows))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {}
