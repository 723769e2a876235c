"""The batch-size search as plain functions: divisors, candidates, the search modes and the fallback size."""

from __future__ import annotations

import pytest

from lightning_gpuopt.callbacks.auto_batch.search import (
    Trial,
    divisors,
    fallback_micro_batch,
    largest_fitting,
    micro_batch_candidates,
    per_device_batch,
)


def test_divisors_and_candidates():
    assert divisors(48) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    assert micro_batch_candidates(48, max_micro_batch_size=20) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert per_device_batch(64, 4) == 16


def test_global_batch_not_divisible_names_values_that_work():
    with pytest.raises(ValueError, match=r"global_batch_size=100 or global_batch_size=104|e\.g\. global_batch_size=96 or 104"):
        per_device_batch(100, 8)


@pytest.mark.parametrize("limit", range(0, 50))
@pytest.mark.parametrize("mode", ["binsearch", "power"])
def test_search_finds_largest_fitting_divisor(limit, mode):
    candidates = micro_batch_candidates(48)
    best, trials = largest_fitting(candidates, lambda b: Trial(b, fits=b <= limit), mode)
    fitting = [c for c in candidates if c <= limit]
    if mode == "binsearch":
        assert best == (fitting[-1] if fitting else None)
    else:  # doubling only: 1, 2, 4, 8, 16, then 48 (the largest, below 2 x 16... no: 32 is no divisor)
        chain = [1, 2, 4, 8, 16, 48]
        assert best == max([c for c in chain if c <= limit], default=None)
    assert len({t.micro_batch_size for t in trials}) == len(trials)  # never tries a size twice


def test_fallback_micro_batch_keeps_a_divisor():
    assert fallback_micro_batch(16, 64) == 8
    assert fallback_micro_batch(15, 30) == 6  # 7.5 is not a divisor of 30: the largest one below
    assert fallback_micro_batch(1, 8) is None
