"""ember.data.DistributedSampler against torch's: each process's share of a dataset, padding and dropping, the
epochs' orders, its errors, and a DataLoader drawing batches from it."""

from __future__ import annotations

import numpy as np
import pytest

import ember
from ember.data import DataLoader, DistributedSampler

torch_data = pytest.importorskip("torch.utils.data")


@pytest.mark.parametrize("size", [0, 1, 5, 8, 11])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_each_share_in_order_is_torchs(size, replicas, drop_last):
    data = list(range(size))
    for rank in range(replicas):
        ours = DistributedSampler(data, replicas, rank, shuffle=False, drop_last=drop_last)
        theirs = torch_data.DistributedSampler(data, replicas, rank, shuffle=False, drop_last=drop_last)
        assert list(ours) == list(theirs)
        assert (len(ours), ours.num_samples, ours.total_size) == (len(theirs), theirs.num_samples, theirs.total_size)


@pytest.mark.parametrize(("size", "replicas"), [(12, 3), (10, 4), (7, 2)])
def test_shuffled_shares_cover_the_dataset_and_change_with_the_epoch(size, replicas):
    samplers = [DistributedSampler(range(size), replicas, rank, seed=7) for rank in range(replicas)]
    first = [list(s) for s in samplers]
    union = sorted(i for share in first for i in share)
    assert set(union) == set(range(size)) and len(union) == samplers[0].total_size  # every index, some repeated
    if size % replicas == 0:
        assert len(set(union)) == len(union)  # disjoint shares
    assert first == [list(s) for s in samplers]  # the same epoch, the same order
    assert [list(s) for s in (DistributedSampler(range(size), replicas, r, seed=7) for r in range(replicas))] == first
    for s in samplers:
        s.set_epoch(1)
    assert [list(s) for s in samplers] != first
    assert [len(s) for s in samplers] == [len(torch_data.DistributedSampler(range(size), replicas, r))
                                          for r in range(replicas)]


def test_a_negative_seed_is_taken_as_torch_takes_it():
    assert sorted(DistributedSampler(range(6), 1, 0, seed=-3)) == list(range(6))


def test_bad_arguments_and_a_missing_process_group_are_refused():
    with pytest.raises(ValueError, match=r"invalid rank 2, rank should be in the interval \[0, 1\]"):
        DistributedSampler(range(4), num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="num_replicas must be a positive integer"):
        DistributedSampler(range(4), num_replicas=0, rank=0)
    with pytest.raises(RuntimeError, match="process group is not initialized"):
        DistributedSampler(range(4))


def test_a_dataloader_draws_its_batches_from_a_sampler():
    x = np.arange(10, dtype=np.float32).reshape(10, 1)
    y = np.arange(10)
    data = ember.data.TensorDataset(x, y)
    sampler = DistributedSampler(data, num_replicas=3, rank=1, shuffle=False)  # 1, 4, 7 and the padding's 0
    loader = DataLoader(data, batch_size=2, sampler=sampler)
    assert len(loader) == 2
    batches = [(xb.numpy()[:, 0].tolist(), yb.numpy().tolist()) for xb, yb in loader]
    assert batches == [([1.0, 4.0], [1, 4]), ([7.0, 0.0], [7, 0])]
    assert len(DataLoader(data, batch_size=3, sampler=sampler, drop_last=True)) == 1
    with pytest.raises(ValueError, match="sampler option is mutually exclusive with shuffle"):
        DataLoader(data, sampler=sampler, shuffle=True)
    assert ember.data.DistributedSampler is DistributedSampler
