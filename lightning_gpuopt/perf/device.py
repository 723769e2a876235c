"""Device facts: what the training device is, read once per run, as one value every decision takes.

Each device decision is a plain function of a :class:`DeviceFacts`, so a test checks it for an H100,
a V100 or a CPU (:data:`REFERENCE_DEVICES`) on any machine.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Union, runtime_checkable

import torch

from lightning_gpuopt.perf.peaks import GPUPeaks, find_gpu
from lightning_gpuopt.perf.units import GiB

__all__ = ["DeviceBound", "DeviceFacts", "REFERENCE_DEVICES", "cuda_device_count", "read_device", "training_device"]


@dataclass(frozen=True)
class DeviceFacts:
    """The facts about one training device that decisions in this package read.

    Example::

        facts = read_device(torch.device("cuda", 0))
        facts.bf16, facts.fp8, facts.peak_tflops("bf16")  # True, True, 989.4 on an H100 SXM
        REFERENCE_DEVICES["V100"].bf16  # False: the fp16 fallback applies there
    """

    type: str  # "cuda", "cpu" (or another torch device type)
    name: str  # what the driver reports ("NVIDIA H100 80GB HBM3"); "cpu" on a CPU
    capability: Optional[tuple[int, int]] = None  # CUDA compute capability, None off CUDA
    total_memory: Optional[int] = None  # bytes; None off CUDA (host memory is not the limit the decisions need)
    cudnn_version: Optional[int] = None  # torch.backends.cudnn.version() (91500 for 9.15), None without cuDNN
    index: Optional[int] = None

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"

    @property
    def bf16(self) -> bool:
        """Native bfloat16 matmuls: every CPU torch runs on, CUDA from compute capability 8.0 (A100)."""
        return self._capability_at_least(8, 0) if self.is_cuda else self.type == "cpu"

    @property
    def fp8(self) -> bool:
        """Float8 tensor cores (``torch._scaled_mm``): compute capability 8.9 (L4, L40, H100) or newer."""
        return self._capability_at_least(8, 9)

    @property
    def flash_attention(self) -> bool:
        """The Flash kernels (SDPA's and the ``flash-attn`` package's): compute capability 8.0 or newer."""
        return self._capability_at_least(8, 0)

    @property
    def fused_adamw(self) -> bool:
        """``AdamW(fused=True)`` is the faster kernel here: on CUDA (the CPU kernel is no faster)."""
        return self.is_cuda

    @property
    def peaks(self) -> Optional[GPUPeaks]:
        """The datasheet row of this GPU (:mod:`~lightning_gpuopt.perf.peaks`), ``None`` for a CPU or unknown GPU."""
        return find_gpu(self.name) if self.is_cuda else None

    def peak_tflops(self, dtype: str) -> Optional[float]:
        """Dense peak TFLOP/s for ``dtype`` (``"bf16"``, ``"fp8"``, ...), ``None`` when unknown."""
        peaks = self.peaks
        return None if peaks is None else getattr(peaks, dtype, None)

    def describe(self) -> str:
        """One line: ``"cuda:0 NVIDIA H100 80GB HBM3 (compute capability 9.0, 79.1 GiB)"``."""
        where = self.type if self.index is None else f"{self.type}:{self.index}"
        if not self.is_cuda:
            return where
        cap = "?" if self.capability is None else f"{self.capability[0]}.{self.capability[1]}"
        mem = "" if self.total_memory is None else f", {self.total_memory / GiB:.1f} GiB"
        return f"{where} {self.name} (compute capability {cap}{mem})"

    def _capability_at_least(self, major: int, minor: int) -> bool:
        return self.is_cuda and self.capability is not None and tuple(self.capability) >= (major, minor)


# The facts of common training devices, as ``read_device`` reports them there: for tests, and for
# ``gpuopt doctor`` to say on one machine what another would do.
REFERENCE_DEVICES: dict[str, DeviceFacts] = {
    "H100 SXM": DeviceFacts("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 80 * GiB, 91500, 0),
    "H200": DeviceFacts("cuda", "NVIDIA H200", (9, 0), 141 * GiB, 91500, 0),
    "A100": DeviceFacts("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), 80 * GiB, 90100, 0),
    "L4": DeviceFacts("cuda", "NVIDIA L4", (8, 9), 24 * GiB, 90100, 0),
    "V100": DeviceFacts("cuda", "Tesla V100-SXM2-16GB", (7, 0), 16 * GiB, 90100, 0),
    "T4": DeviceFacts("cuda", "Tesla T4", (7, 5), 16 * GiB, 90100, 0),
    "cpu": DeviceFacts("cpu", "cpu"),
}


def cuda_device_count() -> int:
    """Visible CUDA devices, without initialising CUDA (NVML), so a later fork can still use the GPU."""
    from lightning.fabric.accelerators.cuda import num_cuda_devices

    return num_cuda_devices()


def read_device(device: Union[torch.device, str, None] = None) -> DeviceFacts:
    """Read the facts of ``device`` from the driver (the one place that does).

    Args:
        device: A torch device; ``None`` means the one a Trainer with ``accelerator="auto"`` picks.
    """
    if device is None:
        device = "cuda" if cuda_device_count() > 0 else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        return DeviceFacts(device.type, device.type, index=device.index)
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return DeviceFacts(
        type="cuda",
        name=props.name,
        capability=(props.major, props.minor),
        total_memory=int(props.total_memory),
        cudnn_version=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        index=index,
    )


@runtime_checkable
class DeviceBound(Protocol):
    """A precision plugin that decides from the training device, told it once per run by :func:`training_device`
    (``strategy``: the run's, ``None`` when bound by hand); ``DevicePrecision`` implements it."""

    def bind(self, device: torch.device, facts: DeviceFacts, strategy: Any = None) -> None: ...


# strategy -> (its root device, that device's facts): one entry per Trainer, gone with it.
_KEPT: "weakref.WeakKeyDictionary[Any, tuple[torch.device, DeviceFacts]]" = weakref.WeakKeyDictionary()


def training_device(trainer: Any) -> DeviceFacts:
    """The facts of the device ``trainer`` trains on, read once per run and kept for every decision in it.

    The first call binds the Trainer's precision plugin (if :class:`DeviceBound`) to them, so whoever asks
    first (a callback's ``setup``, at the latest the plugin's own ``configure_model``) reads this device's dtype.
    """
    strategy = trainer.strategy
    device = strategy.root_device
    kept = _KEPT.get(strategy)
    if kept is None or kept[0] != device:  # a launcher may move a process to its own GPU after the Trainer is built
        kept = _KEPT[strategy] = (device, read_device(device))
        plugin = strategy.precision_plugin
        if isinstance(plugin, DeviceBound):
            plugin.bind(device, kept[1], strategy)
    return kept[1]
