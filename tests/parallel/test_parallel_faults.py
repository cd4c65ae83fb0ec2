"""Faults: a rank that leaves early, and models that differ across ranks.

A rank exiting (cleanly or by crashing) must make the others fail with an error within the process
group's timeout, never hang; parameters that differ across ranks at construction must raise a clear
``ValueError`` on every rank.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn as nn
from dist_harness import RankError, run_group

PG_TIMEOUT = 8.0


def _differing_worker(rank, world):
    from culmen.parallel import DistributedDataParallel as DDP

    msgs = []
    for build in (lambda: nn.Linear(4, 4 + rank),  # a shape differs
                  lambda: nn.Sequential(*[nn.Linear(3, 3) for _ in range(1 + (rank == 2))]),  # a parameter more
                  lambda: nn.Linear(3, 3).to(torch.float16 if rank == 1 else torch.float32)):  # a dtype differs
        try:
            DDP(build())
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    # The group is still usable afterwards: a matching model wraps fine.
    DDP(nn.Linear(2, 2))
    return msgs


def test_parameters_differing_across_ranks():
    results = run_group(_differing_worker, 3)
    for msgs in results:
        assert all(m is not None for m in msgs), msgs
        assert "differ across ranks" in msgs[0] and "weight" in msgs[0] and "(5, 4)" in msgs[0], msgs[0]
        assert "rank 2 has 4 parameters, rank 0 has 2" in msgs[1], msgs[1]
        assert "float16" in msgs[2], msgs[2]


def _early_exit_worker(rank, world, mode):
    import torch.distributed as dist

    from culmen.parallel import DistributedDataParallel as DDP

    dev = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).to(dev)
    ddp = DDP(m, message_size=10)
    x = torch.randn(4, 8, device=dev)
    ddp(x).sum().backward()  # one good iteration
    if rank == 1:
        if mode == "crash":
            os._exit(3)
        return "left"
    t0 = time.monotonic()
    try:
        for _ in range(5):
            m.zero_grad()
            ddp(x).sum().backward()
            # Read the result like a training loop's loss.item(): on NCCL the collectives run on the
            # GPU, so this is where the host meets a reduction that cannot finish.
            float(m[0].weight.grad.sum())
        return ("no error", time.monotonic() - t0)
    except RuntimeError as e:
        return ("error", time.monotonic() - t0, str(e)[:200])


def test_rank_leaving_early_fails_the_others():
    for mode in ("crash", "return"):
        t0 = time.monotonic()
        results = run_group(_early_exit_worker, 3, mode, pg_timeout=PG_TIMEOUT, timeout=PG_TIMEOUT + 40,
                            expect_errors=True)
        assert time.monotonic() - t0 < PG_TIMEOUT + 40
        if mode == "crash":
            assert isinstance(results[1], RankError) and results[1].kind == "Exited"
        else:
            assert results[1] == "left"
        for r in (0, 2):
            assert results[r][0] == "error", (mode, results[r])
            assert results[r][1] < PG_TIMEOUT + 10, (mode, results[r])
