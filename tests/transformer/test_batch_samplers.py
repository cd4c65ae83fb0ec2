"""``culmen.transformer._data`` samplers: sharding over data-parallel ranks, order, resuming from
``consumed_samples``, ramp-up changes of the batch size, DataLoader use, argument errors."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from culmen.transformer._data import MegatronPretrainingRandomSampler, MegatronPretrainingSampler
from culmen.transformer._data._batchsampler import SamplerArgumentError


class _Range(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i, 2 * i])


@pytest.mark.parametrize("total,lmb,dp", [(23, 3, 1), (23, 3, 2), (40, 2, 4)])
def test_sequential_shards_consecutive_global_batches(total, lmb, dp):
    per_rank = [list(MegatronPretrainingSampler(total, 0, lmb, r, dp)) for r in range(dp)]
    steps = total // (lmb * dp)
    assert all(len(b) == steps for b in per_rank)
    for s in range(steps):
        glob = list(itertools.chain.from_iterable(per_rank[r][s] for r in range(dp)))
        assert glob == list(range(s * lmb * dp, (s + 1) * lmb * dp))
    # drop_last=False: the partial tail is split by position; rank slices stay disjoint and cover it.
    tails = [list(MegatronPretrainingSampler(total, 0, lmb, r, dp, drop_last=False))[steps:] for r in range(dp)]
    tail = list(itertools.chain.from_iterable(t[0] for t in tails if t))
    assert tail == list(range(steps * lmb * dp, total))


def test_sequential_resume_and_rampup():
    full = list(MegatronPretrainingSampler(50, 0, 4, 1, 2))
    resumed = list(MegatronPretrainingSampler(50, 16, 4, 1, 2))
    assert resumed == full[2:]
    s = MegatronPretrainingSampler(50, 0, 2, 0, 2)
    it = iter(s)
    assert next(it) == [0, 1]
    s.local_minibatch_size = 4  # ramp-up: the next global batch is 8 samples
    assert s.local_minibatch_times_data_parallel_size == 8
    assert next(it) == [4, 5, 6, 7]
    assert len(s) == 50 and s.get_start_end_idx() == (0, 4)


def _random_epoch(total, consumed, lmb, dp):
    samplers = [MegatronPretrainingRandomSampler(total, consumed, lmb, r, dp) for r in range(dp)]
    return samplers, [list(s) for s in samplers]


@pytest.mark.parametrize("total,lmb,dp", [(37, 3, 2), (64, 4, 4), (10, 5, 1)])
def test_random_partitions_each_epoch(total, lmb, dp):
    bucket = (total // (lmb * dp)) * lmb
    samplers, batches = _random_epoch(total, 0, lmb, dp)
    seen = []
    for r, bs in enumerate(batches):
        flat = [i for b in bs for i in b]
        assert all(len(b) == lmb for b in bs)
        assert sorted(flat) == list(range(r * bucket, (r + 1) * bucket))  # each rank walks its own bucket
        seen += flat
    assert len(set(seen)) == len(seen) == bucket * dp
    assert samplers[0].consumed_samples == bucket * dp and samplers[0].epoch == 0
    # The next epoch is another permutation of the same buckets.
    nxt_samplers, nxt = _random_epoch(total, bucket * dp, lmb, dp)
    assert nxt_samplers[0].epoch == 1
    assert sorted(i for b in nxt[0] for i in b) == sorted(i for b in batches[0] for i in b)
    if bucket > 4:
        assert nxt[0] != batches[0]


def test_random_resume_matches_uninterrupted_run():
    total, lmb, dp = 45, 2, 2
    for r in range(dp):
        s = MegatronPretrainingRandomSampler(total, 0, lmb, r, dp)
        whole = list(s)
        part = MegatronPretrainingRandomSampler(total, 0, lmb, r, dp)
        it = iter(part)
        head = [next(it) for _ in range(4)]
        assert part.consumed_samples == 4 * lmb * dp
        rest = list(MegatronPretrainingRandomSampler(total, part.consumed_samples, lmb, r, dp))
        assert head + rest == whole
    # Same permutation whatever the batch size (Apex's behaviour): 2 batches of 4 == 4 batches of 2.
    a = list(itertools.islice(MegatronPretrainingRandomSampler(100, 0, 4, 0, 1), 2))
    b = list(itertools.islice(MegatronPretrainingRandomSampler(100, 0, 2, 0, 1), 4))
    assert sum(a, []) == sum(b, [])


def test_dataloader_integration():
    loader = DataLoader(_Range(30), batch_sampler=MegatronPretrainingRandomSampler(30, 0, 4, 1, 2))
    batches = list(loader)
    assert len(batches) == 3 and all(b.shape == (4, 2) for b in batches)
    idx = torch.cat([b[:, 0] for b in batches])
    assert torch.equal(batches[0][:, 1], 2 * batches[0][:, 0])
    assert sorted(idx.tolist()) == list(range(12, 24))
    seq = DataLoader(_Range(30), batch_sampler=MegatronPretrainingSampler(30, 8, 4, 1, 2))
    assert next(iter(seq))[:, 0].tolist() == [12, 13, 14, 15]


def test_errors():
    with pytest.raises(ValueError, match="no sample to consume"):
        MegatronPretrainingSampler(0, 0, 1, 0, 1)
    with pytest.raises(RuntimeError, match="no samples left to consume: consumed_samples=10, total_samples=10"):
        MegatronPretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(SamplerArgumentError, match=r"data_parallel_rank \(2\) must be in \[0, data_parallel_size=2\)"):
        MegatronPretrainingRandomSampler(10, 0, 1, 2, 2)
    with pytest.raises(ValueError, match="local_minibatch_size must be greater than 0, got 0"):
        MegatronPretrainingRandomSampler(10, 0, 0, 0, 1)
    with pytest.raises(ValueError, match="data_parallel_size must be greater than 0, got 0"):
        MegatronPretrainingSampler(10, 0, 1, 0, 0)
    with pytest.raises(ValueError, match=r"total_samples \(3\) is smaller than one global batch"):
        MegatronPretrainingRandomSampler(3, 0, 2, 0, 2)
    s = MegatronPretrainingSampler(10, 0, 1, 0, 1)
    with pytest.raises(ValueError, match="got -1"):
        s.local_minibatch_size = -1
