"""Dense peak FLOP/s of NVIDIA GPUs per dtype, and lookup from the name the driver reports.

Every number is the dense (no 2:4 sparsity), per-GPU peak at boost clock from the vendor's datasheet
(sparse figures halved), with its source; ``bf16``/``fp16``/``fp8`` accumulate in FP32, as training does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

import torch

__all__ = ["DTYPES", "GPU_PEAKS", "GPUPeaks", "dtype_name", "find_gpu", "measure_peak_flops", "peak_flops"]

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class GPUPeaks:
    """Dense per-GPU peak TFLOP/s of one GPU model; ``None`` where the GPU has no such unit."""

    name: str
    fp32: float
    tf32: Optional[float]
    bf16: Optional[float]
    fp16: Optional[float]
    fp8: Optional[float]
    source: str


# fmt: off
GPU_PEAKS: dict[str, GPUPeaks] = {p.name: p for p in (
    # Hopper. H100 datasheet (nvidia-h100-datasheet, "H100 SXM / H100 NVL" table):
    # https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
    # prints TF32 989 / BF16 1979 / FP8 3958 TFLOPS *with sparsity* for SXM -> dense 494.7 / 989.4 / 1978.9.
    GPUPeaks("H100 SXM", 66.9, 494.7, 989.4, 989.4, 1978.9,
             "NVIDIA H100 Tensor Core GPU datasheet (SXM column), sparse figures halved"),
    # H100 PCIe (80 GB): FP32 51.2, TF32 756*, BF16 1513*, FP8 3026* (* sparse).
    GPUPeaks("H100 PCIe", 51.2, 378.0, 756.0, 756.0, 1513.0,
             "NVIDIA H100 PCIe datasheet (nvidia-h100-pcie-datasheet), sparse figures halved"),
    # H100 NVL (94 GB, current single-GPU datasheet): FP32 60, TF32 835*, BF16 1671*, FP8 3341*.
    # The first NVL datasheet printed figures for the 2-GPU pair (e.g. BF16 3958*); we use per GPU.
    GPUPeaks("H100 NVL", 60.0, 417.5, 835.5, 835.5, 1670.5,
             "NVIDIA H100 datasheet, H100 NVL column (per GPU), sparse figures halved"),
    # H200: same GH100 compute as H100 SXM, more/faster HBM3e.
    # https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: TF32 989*, BF16 1979*, FP8 3958*)
    GPUPeaks("H200 SXM", 66.9, 494.7, 989.4, 989.4, 1978.9,
             "NVIDIA H200 product page / datasheet, H200 SXM column, sparse figures halved"),
    # H200 NVL: FP32 60, TF32 835*, BF16 1671*, FP8 3341* (same page, H200 NVL column).
    GPUPeaks("H200 NVL", 60.0, 417.5, 835.5, 835.5, 1670.5,
             "NVIDIA H200 product page / datasheet, H200 NVL column, sparse figures halved"),
    # Blackwell. HGX B200 (per GPU): TF32 2.2 PF*, FP16/BF16 4.5 PF*, FP8 9 PF*, FP32 75 TF.
    # https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200 spec table, 8-GPU totals / 8)
    GPUPeaks("B200", 75.0, 1100.0, 2250.0, 2250.0, 4500.0,
             "NVIDIA HGX B200 datasheet, per-GPU, sparse figures halved"),
    # Ampere. A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): FP32 19.5,
    # TF32 156, BF16/FP16 312 dense (624 sparse); same for 40/80 GB, SXM4 and PCIe. No FP8.
    GPUPeaks("A100", 19.5, 156.0, 312.0, 312.0, None,
             "NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)"),
    # A10 datasheet (a10-datasheet.pdf): FP32 31.2, TF32 62.5 (125*), BF16/FP16 125 (250*).
    GPUPeaks("A10", 31.2, 62.5, 125.0, 125.0, None,
             "NVIDIA A10 datasheet (a10/pdf/a10-datasheet.pdf)"),
    # A10G (AWS G5 only, no NVIDIA datasheet): GA102 with fewer tensor TFLOPS than A10:
    # ~70 TFLOPS BF16/FP16 dense, ~35 TF32, 31.5 FP32. Sources: AWS EC2 G5 instance page
    # (https://aws.amazon.com/ec2/instance-types/g5/) and Baseten "NVIDIA A10 vs A10G" spec table.
    GPUPeaks("A10G", 31.5, 35.0, 70.0, 70.0, None,
             "AWS EC2 G5 instance page / Baseten A10 vs A10G comparison (no NVIDIA datasheet)"),
    # GA102 whitepaper (nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf), RTX 3090:
    # FP32 35.6, TF32 35.6 (71*), FP16/BF16 with FP32 accumulate 71 (142*).
    GPUPeaks("RTX 3090", 35.6, 35.6, 71.0, 71.0, None,
             "NVIDIA Ampere GA102 GPU architecture whitepaper, RTX 3090 column"),
    # Ada. Ada whitepaper (nvidia-ada-gpu-architecture.pdf): L40S datasheet FP32 91.6,
    # TF32 183 (366*), BF16 362.05 (733*), FP8 733 (1466*).
    GPUPeaks("L40S", 91.6, 183.0, 362.05, 362.05, 733.0,
             "NVIDIA L40S datasheet (l40s-datasheet), sparse figures halved"),
    # L40 datasheet: FP32 90.5, TF32 90.5 (181*), BF16 181 (362*), FP8 362 (724*).
    GPUPeaks("L40", 90.5, 90.5, 181.0, 181.0, 362.0,
             "NVIDIA L40 datasheet, sparse figures halved"),
    # L4 datasheet: FP32 30.3, TF32 60 (120*), BF16 121 (242*), FP8 242.5 (485*).
    GPUPeaks("L4", 30.3, 60.0, 121.0, 121.0, 242.5,
             "NVIDIA L4 datasheet (l4-datasheet), sparse figures halved"),
    # Ada whitepaper, RTX 4090 column: FP32 82.6, TF32 82.6 (165.2*), FP16/BF16 with FP32
    # accumulate 165.2 (330.4*), FP8 with FP32 accumulate 330.3 (660.6*). (FP16-accumulate rates
    # are twice these, but training accumulates in FP32.)
    GPUPeaks("RTX 4090", 82.6, 82.6, 165.2, 165.2, 330.3,
             "NVIDIA Ada Lovelace GPU architecture whitepaper v2.1, RTX 4090, FP32 accumulate"),
    # Turing. T4 datasheet: FP32 8.1, mixed-precision FP16 65. No BF16/TF32.
    GPUPeaks("T4", 8.1, None, None, 65.0, None, "NVIDIA T4 datasheet (t4-tensor-core-datasheet)"),
    # Volta. V100 datasheet: SXM2 FP32 15.7 / tensor 125; PCIe 14 / 112; V100S PCIe 16.4 / 130.
    GPUPeaks("V100 SXM2", 15.7, None, None, 125.0, None, "NVIDIA V100 datasheet (SXM2 column)"),
    GPUPeaks("V100 PCIe", 14.0, None, None, 112.0, None, "NVIDIA V100 datasheet (PCIe column)"),
    GPUPeaks("V100S PCIe", 16.4, None, None, 130.0, None, "NVIDIA V100S datasheet"),
)}
# fmt: on

# Patterns over the lower-cased name that `torch.cuda.get_device_name()` / nvidia-smi report,
# e.g. "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-16GB".
# Order matters: the first match wins (H200 NVL before H200, L40S before L40 before L4, A10G before A10).
_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\bgh200\b", "H200 SXM"),  # Grace Hopper: H100/H200-class GPU, same compute as SXM
    (r"\bh200\b.*\bnvl\b", "H200 NVL"),
    (r"\bh200\b", "H200 SXM"),  # the driver reports plain "NVIDIA H200" for the SXM part
    (r"\bh100\b.*\bnvl\b", "H100 NVL"),
    (r"\bh100\b.*\b(pcie|hbm2e)\b", "H100 PCIe"),
    (r"\bh100\b", "H100 SXM"),  # "NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 80GB"
    (r"\bb200\b", "B200"),
    (r"\ba100\b", "A100"),
    (r"\ba10g\b", "A10G"),
    (r"\ba10\b", "A10"),
    (r"\bl40s\b", "L40S"),
    (r"\bl40\b", "L40"),
    (r"\bl4\b", "L4"),
    (r"\brtx 4090\b(?! d)", "RTX 4090"),
    (r"\brtx 3090\b(?! ti)", "RTX 3090"),
    (r"\bt4\b", "T4"),
    (r"\bv100s\b", "V100S PCIe"),
    (r"\bv100\b.*\bpcie\b", "V100 PCIe"),
    (r"\bv100\b", "V100 SXM2"),
)


def find_gpu(device_name: str) -> Optional[GPUPeaks]:
    """The peak table entry for a GPU from the name the driver reports (``find_gpu("NVIDIA H100 80GB HBM3").bf16``
    is 989.4); ``None`` if unknown."""
    name = device_name.lower().replace("_", " ")
    for pattern, key in _PATTERNS:
        if re.search(pattern, name):
            return GPU_PEAKS[key]
    return None


def dtype_name(dtype: Union[torch.dtype, str]) -> str:
    """Normalise a ``torch.dtype`` or a name to one of ``fp32``, ``tf32``, ``bf16``, ``fp16``, ``fp8``, ``fp64``."""
    if isinstance(dtype, torch.dtype):
        if dtype == torch.float32:
            return "fp32"
        if dtype == torch.bfloat16:
            return "bf16"
        if dtype == torch.float16:
            return "fp16"
        if dtype == torch.float64:
            return "fp64"
        if "float8" in str(dtype):
            return "fp8"
        raise ValueError(f"No peak FLOP/s are tabulated for {dtype}: use one of {DTYPES}.")
    aliases = {"float32": "fp32", "32": "fp32", "tfloat32": "tf32", "bfloat16": "bf16", "float16": "fp16",
               "half": "fp16", "16": "fp16", "float8": "fp8", "float64": "fp64", "64": "fp64"}
    name = aliases.get(str(dtype).lower(), str(dtype).lower())
    if name not in DTYPES + ("fp64",):
        raise ValueError(f"Unknown dtype {dtype!r}: use one of {DTYPES}.")
    return name


def peak_flops(device_name: str, dtype: Union[torch.dtype, str]) -> Optional[float]:
    """Dense per-GPU peak FLOP/s (not TFLOP/s) for ``dtype`` of the GPU the driver names ``device_name``;
    ``None`` if unknown. ``bf16`` on a GPU without bf16 tensor cores (T4, V100) falls back to its ``fp16`` peak."""
    gpu = find_gpu(device_name)
    name = dtype_name(dtype)
    if gpu is None or name == "fp64":
        return None
    tflops = getattr(gpu, name)
    if tflops is None and name == "bf16":
        tflops = gpu.fp16
    return None if tflops is None else tflops * 1e12


def measure_peak_flops(
    device: torch.device, dtype: torch.dtype = torch.bfloat16, size: int = 8192, iters: int = 20
) -> float:
    """Achievable matmul FLOP/s on a CUDA ``device``: ``iters`` timed ``size`` x ``size`` matmuls after a warm-up."""
    if device.type != "cuda":
        raise ValueError(f"measure_peak_flops needs a CUDA device, got {device}.")
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # timing on the GPU itself
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1000
    del a, b
    return 2 * size**3 * iters / seconds
