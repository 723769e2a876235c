"""Data-parallel size and rank: the ranks that read different samples, read from the Trainer's strategy."""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_gpuopt.perf.parallel import data_parallel_rank, data_parallel_size, tensor_parallel_size


def test_no_trainer_is_one_rank():
    assert (data_parallel_size(None), data_parallel_rank(None)) == (1, 0)


def test_one_device_is_one_rank():
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert (data_parallel_size(trainer), data_parallel_rank(trainer)) == (1, 0)


def test_ddp_counts_every_process():
    # The Trainer is only built, not fitted: no processes are launched.
    trainer = pl.Trainer(accelerator="cpu", devices=3, strategy="ddp", logger=False, enable_progress_bar=False)
    assert (data_parallel_size(trainer), data_parallel_rank(trainer)) == (3, 0)


def test_sampler_kwargs_win_over_world_size():
    """A tensor-parallel strategy states fewer replicas than processes; the sampler's numbers are the answer."""

    class TensorParallel:
        distributed_sampler_kwargs = {"num_replicas": 2, "rank": 1}

    class FourRanks:
        strategy, world_size, global_rank = TensorParallel(), 4, 3

    assert (data_parallel_size(FourRanks()), data_parallel_rank(FourRanks())) == (2, 1)
    assert tensor_parallel_size(FourRanks()) == 2  # the two ranks of each data-parallel rank split its layers


def test_tensor_parallel_size_is_one_without_a_tensor_parallel_dimension():
    trainer = pl.Trainer(accelerator="cpu", devices=3, strategy="ddp", logger=False, enable_progress_bar=False)
    assert tensor_parallel_size(trainer) == 1 and tensor_parallel_size(None) == 1
