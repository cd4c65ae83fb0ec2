"""``culmen.distributed_testing``: test methods run on spawned ranks of a real process group; a failing
rank fails the test quickly instead of hanging; the NCCL base runs on GPUs (skipped without one)."""

from __future__ import annotations

import time
import unittest

import pytest
import torch
import torch.distributed as dist

from culmen.distributed_testing import DistributedTestBase, NcclDistributedTestBase, UccDistributedTestBase


class TestGlooRanks(DistributedTestBase):
    def test_collectives_and_parallel_state(self):
        from culmen.transformer import parallel_state as ps

        assert dist.get_backend() == "gloo" and dist.get_world_size() == 2 == self.world_size
        assert dist.get_rank() == self.rank
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        self.assertEqual(t.item(), 3.0)
        ps.initialize_model_parallel(1, 2)
        self.assertEqual(ps.get_pipeline_model_parallel_rank(), self.rank)
        self.assertEqual(ps.get_pipeline_model_parallel_next_rank(), 1 - self.rank)
        u = torch.tensor([float(self.rank + 5)])
        dist.all_reduce(u, group=ps.get_pipeline_model_parallel_group())
        self.assertEqual(u.item(), 11.0)
        ps.destroy_model_parallel()


class _OneRankFails(DistributedTestBase):
    __test__ = False  # run only through test_failing_rank_fails_fast
    PG_TIMEOUT = 20.0

    def test_rank1_raises(self):
        if self.rank == 1:
            raise AssertionError("rank 1 fails on purpose")
        dist.barrier()  # rank 0 would wait here forever without the parent stopping it


def test_failing_rank_fails_fast():
    suite = unittest.defaultTestLoader.loadTestsFromName("test_rank1_raises", _OneRankFails)
    result = unittest.TestResult()
    t0 = time.monotonic()
    suite.run(result)
    elapsed = time.monotonic() - t0
    assert not result.wasSuccessful()
    msgs = "".join(tb for _, tb in result.failures + result.errors)
    assert "rank 1 fails on purpose" in msgs
    assert elapsed < 15.0, elapsed


def test_bases_metadata():
    assert DistributedTestBase.DISTRIBUTED_BACKEND == "gloo"
    assert NcclDistributedTestBase.DISTRIBUTED_BACKEND == "nccl"
    assert UccDistributedTestBase.DISTRIBUTED_BACKEND == "ucc"
    if not torch.cuda.is_available():
        assert getattr(NcclDistributedTestBase, "__unittest_skip__", False)


@pytest.mark.gpu
class TestNcclRanks(NcclDistributedTestBase):
    def test_all_reduce_on_gpus(self):
        assert torch.cuda.current_device() == self.rank % torch.cuda.device_count()
        t = torch.full((3,), float(self.rank + 1), device="cuda")
        dist.all_reduce(t)
        expect = self.world_size * (self.world_size + 1) / 2
        torch.testing.assert_close(t, torch.full((3,), expect, device="cuda"))
