"""The resumable sampler: ranks split the stream, a resume starts mid-epoch, sample k is the same window at any
batch size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_gpuopt.data import RandomWindows, write_tokens
from lightning_gpuopt.data.sampler import ResumableSampler, stream_indices


# ------------------------------------------------------------------------------------ plain parts
def test_stream_indices_split_ranks_and_resume_mid_epoch():
    assert list(stream_indices(0, 8)) == list(range(8))
    assert list(stream_indices(1, 8, start=2, rank=1, world_size=2)) == [11, 13, 15]
    both = sorted(list(stream_indices(2, 9, world_size=2, rank=0)) + list(stream_indices(2, 9, world_size=2, rank=1)))
    assert both == list(range(18, 26))  # the odd tail is dropped so ranks read as many
    # A resume with another number of ranks: any start, and every rank still reads as many.
    ranks = [list(stream_indices(0, 10, start=3, rank=r, world_size=2)) for r in (0, 1)]
    assert ranks == [[3, 5, 7], [4, 6, 8]]
    assert [list(ResumableSampler(range(10), num_replicas=3, rank=r, start=4)) for r in range(3)] == [[4, 7], [5, 8], [6, 9]]
    with pytest.raises(ValueError, match=r"ResumableSampler.start must be an integer >= 0, got -1"):
        ResumableSampler(range(10), start=-1)


def test_sample_k_is_the_same_window_for_every_batch_size(tmp_path):
    write_tokens(tmp_path / "t.bin", [np.arange(5000) % 300], np.dtype(np.uint16))
    ds = RandomWindows(tmp_path / "t.bin", "uint16", 0, 5000, block_size=8, length=12, seed=1)
    sampler = ResumableSampler(ds, epoch=1)
    whole = [ds[i][0] for i in sampler]
    assert len(sampler) == 12 and len(whole) == 12
    sampler.load_state_dict({"epoch": 1, "start": 5})
    tail = [ds[i][0] for i in sampler]
    assert all(torch.equal(a, b) for a, b in zip(whole[5:], tail))
    assert not torch.equal(ds[0][0], ds[12][0])  # epoch 1 draws new windows
    sampler.set_epoch(1)
    assert sampler.start == 5  # same epoch: a resume keeps its position
    sampler.set_epoch(2)
    assert sampler.start == 0 and next(iter(sampler)) == 24
