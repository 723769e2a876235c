"""Callbacks: CUDA settings, MFU monitoring, automatic batch size, exact resume, the non-finite guard, the SIGTERM
checkpoint, progress bars that resume."""

from lightning_gpuopt.callbacks.auto_batch.callback import AutoBatchSize
from lightning_gpuopt.callbacks.cuda_settings import CUDASettings
from lightning_gpuopt.callbacks.exact_resume import ExactResume
from lightning_gpuopt.callbacks.mfu_monitor import MFUMonitor
from lightning_gpuopt.callbacks.nonfinite_guard import NonFiniteError, NonFiniteGuard
from lightning_gpuopt.callbacks.progress_bar import ResumedRichProgressBar, ResumedTQDMProgressBar
from lightning_gpuopt.callbacks.sigterm_checkpoint import SigtermCheckpoint

__all__ = ["AutoBatchSize", "CUDASettings", "ExactResume", "MFUMonitor", "NonFiniteError", "NonFiniteGuard",
           "ResumedRichProgressBar", "ResumedTQDMProgressBar", "SigtermCheckpoint"]
