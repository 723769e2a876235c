"""Performance arithmetic: peak FLOP/s of GPUs, FLOPs counting, the compute dtype of a precision plugin."""

from lightning_gpuopt.perf.peaks import GPU_PEAKS, GPUPeaks, dtype_name, find_gpu, peak_flops

__all__ = ["GPU_PEAKS", "GPUPeaks", "dtype_name", "find_gpu", "peak_flops"]
