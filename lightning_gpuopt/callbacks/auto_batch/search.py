"""The micro-batch search behind `AutoBatchSize`: which sizes keep the global batch, and the largest that fits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Optional, get_args

from lightning_gpuopt.option_checks import check_choice, check_int, option
from lightning_gpuopt.perf.units import GiB

__all__ = ["SEARCH_MODES", "SearchMode", "Trial", "describe_search", "divisors", "nothing_fits_error", "search_metrics",
           "largest_fitting", "micro_batch_candidates", "per_device_batch", "fallback_micro_batch"]

SearchMode = Literal["binsearch", "power"]
SEARCH_MODES: tuple[str, ...] = get_args(SearchMode)


@dataclass
class Trial:
    """One tried micro-batch: whether it fit, and the peak memory it used (bytes; ``None`` off-GPU)."""

    micro_batch_size: int
    fits: bool
    peak_memory: Optional[int] = None
    reason: str = field(default="")


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order: ``divisors(12) == [1, 2, 3, 4, 6, 12]``."""
    if n < 1:
        raise ValueError(f"divisors() needs a positive integer, got {n}.")
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def per_device_batch(global_batch_size: int, world_size: int) -> int:
    """Samples each of ``world_size`` data-parallel devices processes per optimizer step, or an error naming
    global batches that split evenly."""
    check_int("AutoBatchSize", "global_batch_size", global_batch_size, minimum=1)
    if global_batch_size % world_size:
        lower = global_batch_size // world_size * world_size
        upper = lower + world_size
        options = [v for v in (lower, upper) if v > 0]
        raise ValueError(
            f"AutoBatchSize: global_batch_size={global_batch_size} cannot be split evenly over {world_size} "
            f"processes: use a multiple of {world_size}, e.g. global_batch_size="
            + " or ".join(str(v) for v in options)
            + "."
        )
    return global_batch_size // world_size


def micro_batch_candidates(per_device: int, max_micro_batch_size: Optional[int] = None) -> list[int]:
    """The micro-batches that divide ``per_device`` (so accumulation keeps the global batch), smallest first,
    up to ``max_micro_batch_size``: ``micro_batch_candidates(24, 10) == [1, 2, 3, 4, 6, 8]``."""
    found = divisors(per_device)
    if max_micro_batch_size is not None:
        found = [d for d in found if d <= max_micro_batch_size]
    return found


def fallback_micro_batch(micro_batch_size: int, per_device: int) -> Optional[int]:
    """After an OOM in training: the largest divisor of ``per_device`` at most half ``micro_batch_size``
    (``None`` at 1), so the global batch is kept. ``fallback_micro_batch(6, 24) == 3``."""
    smaller = [d for d in divisors(per_device) if d <= micro_batch_size // 2]
    return smaller[-1] if smaller else None


def largest_fitting(
    candidates: list[int],
    try_size: Callable[[int], Trial],
    mode: SearchMode = "binsearch",
) -> tuple[Optional[int], list[Trial]]:
    """The largest candidate for which ``try_size`` reports a fit, and every trial made to find it.

    Doubles from the smallest candidate until a size fails; ``"binsearch"`` then bisects between the
    last fit and the first failure, ``"power"`` stops. Fitting is assumed monotone.

    Example::

        best, trials = largest_fitting([1, 2, 4, 8, 16, 32], lambda b: Trial(b, fits=b <= 12))
        # best == 8, tried 1, 2, 4, 8, 16; best is None when even the smallest candidate fails
    """
    check_choice("AutoBatchSize", "mode", mode, SEARCH_MODES)
    trials: list[Trial] = []

    def fits(index: int) -> bool:
        trial = try_size(candidates[index])
        trials.append(trial)
        return trial.fits

    good, bad = -1, len(candidates)  # indices: largest known fit, smallest known failure
    index = 0
    while index < bad:
        if not fits(index):
            bad = index
            break
        good = index
        target = 2 * candidates[index]
        index = next((i for i in range(index + 1, len(candidates)) if candidates[i] >= target), len(candidates))
        if index == len(candidates) and good < len(candidates) - 1:
            index = len(candidates) - 1  # the largest candidate is below twice the last fit: try it
    if mode == "binsearch":
        while bad - good > 1:
            middle = (good + bad) // 2
            if fits(middle):
                good = middle
            else:
                bad = middle
    return (candidates[good] if good >= 0 else None), trials


def describe_search(trials: list[Trial]) -> tuple[str, str]:
    """A search as a table (one row per tried size) and a one-line trace (``"1 fits; 2 no (out of memory)"``)."""
    rows = ["  micro  fits  peak memory"]
    for t in trials:
        peak = f"{t.peak_memory / GiB:.2f} GiB" if t.peak_memory is not None else "-"
        rows.append(f"  {t.micro_batch_size:>6}  {'fits' if t.fits else 'no':>4}  "
                    f"{peak}" + (f"  ({t.reason})" if t.reason else ""))
    trace = "; ".join(
        f"{t.micro_batch_size} {'fits' if t.fits else 'no'}" + (f" ({t.reason})" if t.reason else "") for t in trials
    )
    return "\n".join(rows), trace


def search_metrics(trials: list[Trial], micro: int, accumulate: int, replicas: int) -> dict[str, float]:
    """What ``AutoBatchSize`` logs about its decision (``auto_batch_size/*``; peak memory in GiB, CUDA only)."""
    metrics: dict[str, float] = {
        "auto_batch_size/micro_batch_size": micro,
        "auto_batch_size/accumulate_grad": accumulate,
        "auto_batch_size/global_batch_size": micro * accumulate * replicas,
        "auto_batch_size/trials": len(trials),
    }
    chosen = next(t for t in trials if t.micro_batch_size == micro and t.fits)
    if chosen.peak_memory is not None:
        metrics["auto_batch_size/peak_memory_gb"] = chosen.peak_memory / GiB
    return metrics


def nothing_fits_error(memory_margin: float) -> RuntimeError:
    return RuntimeError(
        "AutoBatchSize: even a micro-batch of 1 runs out of memory"
        + (f" (or leaves less than memory_margin={memory_margin} free)" if memory_margin else "")
        + f". Make the model fit first: {option('GPTModule', 'activation_checkpointing', True)}, a shorter block_size, "
        "FSDP2 (ModelParallelStrategy) across more GPUs, or a lower memory_margin."
    )
