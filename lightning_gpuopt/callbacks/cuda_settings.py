"""`CUDASettings`: TF32, cuDNN autotuning, SDPA backends and the expandable-segments allocator, set early and undone after."""

from __future__ import annotations

import os
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_gpuopt.perf.sdpa import SDPA_BACKENDS as _SDPA_BACKENDS
from lightning_gpuopt.perf.sdpa import SDPA_FLAGS as _SDPA_FLAGS
from lightning_gpuopt.perf.sdpa import apply_auto_sdpa_order, attention_kernel, attention_row  # attention_kernel re-exported
from lightning_gpuopt.protocols import bind_precision_plugin

__all__ = ["CUDASettings", "attention_kernel"]

_MATMUL_PRECISIONS = ("highest", "high", "medium")
_ALLOC_ENV_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # new name first (torch >= 2.9), then legacy


def _alloc_conf_var() -> str:
    """The allocator env var to edit: the one already set, else the legacy name every torch version reads."""
    return next((name for name in _ALLOC_ENV_VARS if name in os.environ), "PYTORCH_CUDA_ALLOC_CONF")


def _with_option(conf: str, key: str, value: str) -> str:
    """``conf`` (``"a:1,b:2"``) with ``key`` set to ``value``, other options kept."""
    options = [o for o in conf.split(",") if o.strip() and o.split(":")[0].strip() != key]
    return ",".join([*options, f"{key}:{value}"])


def _set_allocator_settings(conf: str) -> None:
    """Update the CUDA caching allocator's configuration at runtime (``conf`` as in ``PYTORCH_CUDA_ALLOC_CONF``)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings  # older torch (deprecated in newer ones)
    setter(conf)


def _capture() -> dict[str, Any]:
    """The global state this callback may change."""
    return {
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "sdpa_enabled": {name: getattr(torch._C, f"_get_{flag}_sdp_enabled")() for name, flag in _SDPA_FLAGS.items()},
        "sdpa_priority": list(torch._C._get_sdp_priority_order()),
        "env": {name: os.environ.get(name) for name in _ALLOC_ENV_VARS},
    }


class CUDASettings(Callback):
    """Turns on the fast CUDA defaults for transformer training, early enough to count, and restores them at teardown.

    The settings are applied when the callback is constructed (before the ``Trainer`` sets up the
    device, so the allocator option lands before the first CUDA allocation and Lightning's TF32 hint
    sees TF32 on) and again at ``setup`` if a previous ``fit`` restored them. A table of what was set,
    and what could not be and why, is logged once at ``setup`` (rank zero). At ``teardown`` the
    previous global state is restored, so notebooks and test suites are left as they were.

    Example::

        trainer = Trainer(callbacks=[CUDASettings(sdpa_backends=["cudnn", "flash", "efficient"])])

    .. code-block:: yaml

        trainer:
          callbacks:
            - class_path: lightning_gpuopt.callbacks.CUDASettings
              init_args: {tf32: true, sdpa_backends: [flash, efficient, math], expandable_segments: true}

    Args:
        tf32: Let fp32 matmuls and convolutions use TF32 tensor cores (``allow_tf32`` flags);
            ``None`` leaves them.
        cudnn_benchmark: Autotune cuDNN convolution algorithms (``torch.backends.cudnn.benchmark``);
            ``None`` leaves it.
        sdpa_backends: Scaled-dot-product-attention kernels allowed, in priority order, from
            ``cudnn``, ``flash``, ``efficient``, ``math``; the others are disabled. ``"auto"`` (the
            default) puts cuDNN attention first on GPUs of compute capability 9.x and 10.x (H100,
            H200, B200: its forward is ~25% faster than FlashAttention-2 at head dim 64, FA3 paper)
            with cuDNN 9.15 or newer, and leaves PyTorch's order elsewhere, disabling nothing.
            ``None`` leaves them.
        expandable_segments: Use the caching allocator's expandable segments (less fragmentation,
            fewer out-of-memory errors with varying shapes); ``None`` leaves it.
        matmul_precision: ``torch.set_float32_matmul_precision`` value (``highest``, ``high``,
            ``medium``); ``None`` derives it from ``tf32`` (``high`` when on, ``highest`` when off).

    Note:
        With CUDA not yet initialised, the allocator option goes into ``PYTORCH_CUDA_ALLOC_CONF``
        (or ``PYTORCH_ALLOC_CONF`` if that is set), keeping its other options; afterwards it is set
        at runtime with the variable's other options, which affects new memory segments.
        Construct the callback before anything allocates CUDA memory. A ``Trainer(benchmark=...)``
        given explicitly overrides ``cudnn_benchmark``.
    """

    def __init__(
        self,
        tf32: Optional[bool] = True,
        cudnn_benchmark: Optional[bool] = True,
        sdpa_backends: Union[None, Literal["auto"], list[str]] = "auto",
        expandable_segments: Optional[bool] = True,
        matmul_precision: Optional[str] = None,
    ) -> None:
        if sdpa_backends is not None and sdpa_backends != "auto":
            if isinstance(sdpa_backends, str):
                sdpa_backends = [sdpa_backends]
            unknown = [b for b in sdpa_backends if b not in _SDPA_BACKENDS]
            if unknown or not sdpa_backends or len(set(sdpa_backends)) != len(sdpa_backends):
                raise ValueError(
                    f"CUDASettings.sdpa_backends must be a non-empty list of distinct names from {list(_SDPA_BACKENDS)}, "
                    f"got {sdpa_backends!r}."
                )
        if matmul_precision is not None and matmul_precision not in _MATMUL_PRECISIONS:
            raise ValueError(f"CUDASettings.matmul_precision must be one of {_MATMUL_PRECISIONS} or None, got {matmul_precision!r}.")
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
        self.report: list[tuple[str, str, str]] = []  # (setting, value, status)
        self._saved: Optional[dict[str, Any]] = None
        self._logged = False
        self._apply()

    def _apply(self) -> None:
        if self._saved is not None:  # already applied and not yet restored
            return
        self._saved = _capture()
        cuda = torch.cuda.is_available()
        no_cuda = "set, no effect: no CUDA device"
        rows = []
        if self.expandable_segments is not None:  # first: nothing below may initialise CUDA before it
            rows.append(("expandable_segments", str(self.expandable_segments), self._apply_allocator(cuda)))
        if self.tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32 = self.tf32
            torch.backends.cudnn.allow_tf32 = self.tf32
            rows.append(("tf32", str(self.tf32), "applied" if cuda else no_cuda))
        precision = self.matmul_precision or ({True: "high", False: "highest"}.get(self.tf32))
        if precision is not None:
            torch.set_float32_matmul_precision(precision)
            rows.append(("matmul_precision", precision, "applied" if cuda else no_cuda))
        if self.cudnn_benchmark is not None:
            torch.backends.cudnn.benchmark = self.cudnn_benchmark
            rows.append(("cudnn_benchmark", str(self.cudnn_benchmark), "applied" if cuda else no_cuda))
        if isinstance(self.sdpa_backends, list):
            from torch.nn.attention import SDPBackend, _sdpa_kernel

            _sdpa_kernel([getattr(SDPBackend, _SDPA_BACKENDS[b]) for b in self.sdpa_backends], set_priority=True)
            # The GPU's capability (flash needs >= 8.0) is read at setup, on the training device: reading
            # it here would initialise CUDA in the process that builds the Trainer (fatal for fork launches).
            rows.append(("sdpa_backends", ",".join(self.sdpa_backends), "applied" if cuda else no_cuda))
        self.report = rows

    def _apply_allocator(self, cuda: bool) -> str:
        value = "True" if self.expandable_segments else "False"
        var = _alloc_conf_var()
        conf = _with_option(os.environ.get(var, ""), "expandable_segments", value)
        if torch.cuda.is_initialized():
            try:
                # The whole configuration, so the variable's other options stay in force.
                _set_allocator_settings(conf)
            except (RuntimeError, ValueError, AttributeError) as err:
                return f"not applied: CUDA was already initialised and the allocator refused ({err})"
            return "applied at runtime (CUDA already initialised): affects new memory segments"
        os.environ[var] = conf
        return f"applied via {var} before CUDA initialisation" if cuda else f"{var} set, no effect: no CUDA device"

    def _restore(self) -> None:
        saved, self._saved = self._saved, None
        if saved is None:
            return
        torch.backends.cuda.matmul.allow_tf32 = saved["tf32_matmul"]
        torch.backends.cudnn.allow_tf32 = saved["tf32_cudnn"]
        torch.set_float32_matmul_precision(saved["matmul_precision"])
        torch.backends.cuda.matmul.allow_tf32 = saved["tf32_matmul"]  # set_float32_matmul_precision also touches it
        torch.backends.cudnn.benchmark = saved["cudnn_benchmark"]
        for name, enabled in saved["sdpa_enabled"].items():
            getattr(torch._C, f"_set_sdp_use_{_SDPA_FLAGS[name]}")(enabled)
        torch._C._set_sdp_priority_order(saved["sdpa_priority"])
        for name, value in saved["env"].items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if self.expandable_segments is not None and torch.cuda.is_initialized():
            conf = saved["env"][_alloc_conf_var()] or ""
            before = "expandable_segments:true" in conf.lower().replace(" ", "")
            try:
                _set_allocator_settings(_with_option(conf, "expandable_segments", str(before)))
            except (RuntimeError, ValueError, AttributeError):
                pass

    def table(self) -> str:
        """What was set and with what result, as a text table."""
        width = max((len(r[0]) for r in self.report), default=7)
        vwidth = max((len(r[1]) for r in self.report), default=5)
        lines = [f"{'setting':<{width}}  {'value':<{vwidth}}  status"]
        lines += [f"{s:<{width}}  {v:<{vwidth}}  {st}" for s, v, st in self.report]
        return "\n".join(lines)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._apply()  # after a previous fit restored the state
        device = trainer.strategy.root_device
        bind_precision_plugin(trainer)  # the attention row reads the plugin's dtype for this device
        if self.sdpa_backends == "auto":
            self.report = [r for r in self.report if r[0] != "sdpa_backends"] + [apply_auto_sdpa_order(device)]
        if device.type == "cuda":
            self.report = [r for r in self.report if r[0] != "attention_kernel"] + [attention_row(pl_module, trainer.precision_plugin, device)]
        if isinstance(self.sdpa_backends, list) and "flash" in self.sdpa_backends and device.type == "cuda":
            if torch.cuda.get_device_capability(device)[0] < 8:
                self.report = [
                    (name, value, status + "; flash needs compute capability >= 8.0, so it is skipped on this GPU")
                    if name == "sdpa_backends" else (name, value, status)
                    for name, value, status in self.report
                ]
        if self.cudnn_benchmark is not None and torch.backends.cudnn.benchmark != self.cudnn_benchmark:
            self.report = [r for r in self.report if r[0] != "cudnn_benchmark"]
            self.report.append(
                ("cudnn_benchmark", str(self.cudnn_benchmark), "overridden by Trainer(benchmark=...): drop one of the two")
            )
        if not self._logged:
            self._logged = True
            header = "CUDASettings:" if torch.cuda.is_available() else "CUDASettings (no CUDA device: nothing takes effect):"
            rank_zero_info(f"{header}\n{self.table()}")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {}
