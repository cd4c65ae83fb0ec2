"""RNG tracker, ``model_parallel_cuda_manual_seed`` and ``checkpoint`` (CPU generator fallback).

On 4 gloo ranks with TP=2 (two data-parallel replicas): dropout outside the tracker is the same on
every rank; inside ``get_cuda_rng_tracker().fork()`` it is the same for ranks of equal TP rank and
different between TP ranks. ``checkpoint`` must reproduce the plain run's output and gradients
(dropout inside and outside the tracker, a non-tensor argument), also with the first input's saved
copy distributed over the TP ranks, and leave the RNG states as a plain run would.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from culmen.transformer import tensor_parallel as tpl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402


def _rng_worker(rank: int, world: int) -> list[str]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from culmen.transformer import parallel_state as ps
    from culmen.transformer import tensor_parallel as tpl

    ps.initialize_model_parallel(2)
    tp_rank = ps.get_tensor_model_parallel_rank()
    failures: list[str] = []
    tracker = tpl.get_cuda_rng_tracker()
    tpl.model_parallel_cuda_manual_seed(1000)

    def gather(t):
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t)
        return out

    ones = torch.ones(64)
    outside = F.dropout(ones, 0.5)
    with tracker.fork():
        inside = F.dropout(ones, 0.5)
    outside_after = F.dropout(ones, 0.5)
    all_out, all_in, all_after = gather(outside), gather(inside), gather(outside_after)
    tp_of = [r % 2 for r in range(world)]  # parallel_state's layout: TP groups are consecutive ranks
    for r in range(world):
        if not torch.equal(all_out[r], all_out[0]) or not torch.equal(all_after[r], all_after[0]):
            failures.append(f"rank {rank}: dropout outside the tracker differs on rank {r}")
        same_tp = tp_of[r] == tp_rank
        if torch.equal(all_in[r], inside) != same_tp:
            failures.append(f"rank {rank}: dropout inside the tracker vs rank {r} (same TP rank: {same_tp})")
    if torch.equal(inside, outside):
        failures.append(f"rank {rank}: tracker state equals the default state")

    # fork restores the default stream: the default sequence is the one a run without the fork gives.
    tpl.model_parallel_cuda_manual_seed(1000)
    a = torch.rand(8)
    with tracker.fork():
        torch.rand(100)
    b = torch.rand(8)
    tpl.model_parallel_cuda_manual_seed(1000)
    if not (torch.equal(a, torch.rand(8)) and torch.equal(b, torch.rand(8))):
        failures.append(f"rank {rank}: fork disturbed the default RNG stream")

    # checkpoint == plain run, with dropout inside and outside the tracker and a linear in between.
    torch.manual_seed(5)
    w = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)

    def block(x, scale, y):
        h = F.dropout(x @ w, 0.3) * scale
        with tracker.fork():
            h = F.dropout(torch.tanh(h), 0.4)
        return h + y, h.sum(-1)

    x0 = torch.randn(4, 6, dtype=torch.float64)
    y0 = torch.randn(4, 6, dtype=torch.float64)
    g1, g2 = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    for distribute in (False, True):
        results = []
        for use_ckpt in (False, True):
            tpl.model_parallel_cuda_manual_seed(77)
            torch.manual_seed(77)
            x = x0.clone().requires_grad_()
            y = y0.clone().requires_grad_()
            w.grad = None
            if use_ckpt:
                o1, o2 = tpl.checkpoint(block, distribute, x, 2.0, y)
            else:
                o1, o2 = block(x, 2.0, y)
            torch.rand(3)  # consume RNG between forward and backward: the recomputation must not see it
            with tracker.fork():
                torch.rand(3)
            torch.autograd.backward([o1, o2], [g1, g2])
            after = (torch.rand(4), tracker.get_states()["model-parallel-rng"].clone())
            results.append((o1.detach(), o2.detach(), x.grad, y.grad, w.grad.clone(), after))
        plain, ckpt = results
        names = ("out1", "out2", "dx", "dy", "dw")
        for name, p, c in zip(names, plain[:5], ckpt[:5]):
            if not torch.equal(p, c):
                failures.append(f"rank {rank} checkpoint(distribute={distribute}) {name} differs from the plain run")
        if not (torch.equal(plain[5][0], ckpt[5][0]) and torch.equal(plain[5][1], ckpt[5][1])):
            failures.append(f"rank {rank} checkpoint(distribute={distribute}): RNG states after backward differ")

    # Tracker bookkeeping errors.
    try:
        tracker.add("another", 77 + 2718 + tp_rank)  # the seed of the last model_parallel_cuda_manual_seed
        failures.append(f"rank {rank}: a reused seed did not raise")
    except ValueError:
        pass
    try:
        with tracker.fork("missing"):
            pass
        failures.append(f"rank {rank}: an unknown state did not raise")
    except KeyError:
        pass
    return failures


def test_rng_tracker_and_checkpoint_on_4_ranks():
    results = run_group(_rng_worker, 4, timeout=180)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures)


def test_tracker_states_roundtrip():
    tracker = tpl.random.CudaRNGStatesTracker()
    state = torch.get_rng_state()
    tracker.add("a", 11)
    assert torch.equal(torch.get_rng_state(), state), "add must not change the default state"
    saved = tracker.get_states()
    with tracker.fork("a"):
        first = torch.rand(5)
    with tracker.fork("a"):
        second = torch.rand(5)
    assert not torch.equal(first, second), "fork must keep the advanced state"
    tracker.set_states(saved)
    with tracker.fork("a"):
        again = torch.rand(5)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    torch.manual_seed(11)
    torch.testing.assert_close(torch.rand(5), first, rtol=0, atol=0)
    tracker.reset()
    with pytest.raises(KeyError, match="a"):
        with tracker.fork("a"):
            pass


def test_memory_buffer():
    buf = tpl.memory.MemoryBuffer("test", 10, torch.float32, track_usage=True)
    a = torch.arange(6.0).view(2, 3)
    view = buf.add(a)
    torch.testing.assert_close(view, a)
    assert view.data_ptr() == buf.data.data_ptr() and buf.numel_in_use() == 6 and buf.is_in_use()
    with pytest.raises(ValueError, match="4 > 4|5 > 4"):
        buf.add(torch.zeros(5))
    with pytest.raises(TypeError, match="float64"):
        buf.add(torch.zeros(1, dtype=torch.float64))
    assert buf.get_data().numel() == 6
    buf.reset()
    assert not buf.is_in_use()
    ring = tpl.memory.RingMemBuffer("ring-test", 2, 4, torch.float32, track_usage=False)
    first = ring.get_next_buffer()
    first.add(torch.ones(2))
    assert ring.get_next_buffer() is not first
    with pytest.raises(RuntimeError, match="in use"):
        ring.get_next_buffer()
    with pytest.raises(ValueError, match="already allocated"):
        tpl.allocate_mem_buff("ring-test 0", 4, torch.float32, False)
