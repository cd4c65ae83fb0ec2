"""``culmen.flash_attn.utils.distributed`` on 2 gloo ranks: the raw collectives (sync and asynchronous,
gloo's reduce-scatter through an all-reduce), the differentiable ones and their gradients,
``sync_shared_params``, ``allreduce_sequence_parallel_grad``; ``get_dim_for_local_rank`` without a group."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from culmen.flash_attn.utils.distributed import get_dim_for_local_rank

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402

F64 = torch.float64


def test_get_dim_for_local_rank():
    assert [get_dim_for_local_rank(8, 2, r) for r in range(2)] == [4, 4]
    assert [get_dim_for_local_rank(7, 3, r) for r in range(3)] == [3, 2, 2]
    # in units of multiple_of: 5 units of 4 over 2 ranks -> 3 units, 2 units
    assert [get_dim_for_local_rank(20, 2, r, multiple_of=4) for r in range(2)] == [12, 8]
    assert [get_dim_for_local_rank(2, 4, r) for r in range(4)] == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="dim \\(10\\) must be a multiple of multiple_of \\(4\\)"):
        get_dim_for_local_rank(10, 2, 0, multiple_of=4)
    with pytest.raises(ValueError, match="local_rank \\(2\\) must be in \\[0, world_size=2\\)"):
        get_dim_for_local_rank(10, 2, 2)


def _worker(rank, world):
    import torch.distributed as dist
    from torch import nn

    from culmen.flash_attn.utils import distributed as ud

    pg = dist.group.WORLD
    errs = {}

    def err(name, a, b):
        errs[name] = (a - b).abs().max().item()

    torch.manual_seed(0)
    full = torch.randn(4, 3, dtype=F64)  # identical on both ranks
    parts = [torch.randn(2, 3, dtype=F64) + r for r in range(world)]  # every rank's input, known to all
    mine = parts[rank]

    out, h = ud.all_gather_raw(mine, pg)
    err("all_gather_raw", out, torch.cat(parts))
    errs["all_gather_raw handle"] = float(h is not None)
    out, h = ud.all_gather_raw(mine, pg, async_op=True)
    h.wait()
    err("all_gather_raw async", out, torch.cat(parts))

    contrib = [full * (r + 1) for r in range(world)]  # rank r contributes full * (r + 1)
    total = sum(contrib)
    out, _ = ud.reduce_scatter_raw(contrib[rank], pg)
    err("reduce_scatter_raw", out, total[rank * 2:(rank + 1) * 2])
    out, h = ud.reduce_scatter_raw(contrib[rank], pg, async_op=True)
    h.wait()
    err("reduce_scatter_raw async", out, total[rank * 2:(rank + 1) * 2])
    errs["reduce_scatter_raw async completed"] = float(not h.is_completed())

    x = contrib[rank].clone()
    out, _ = ud.all_reduce_raw(x, pg)
    err("all_reduce_raw", out, total)
    errs["all_reduce_raw in place"] = float(out.data_ptr() != x.data_ptr())

    # Differentiable forms: gradients are the adjoint collectives.
    a = mine.clone().requires_grad_()
    ga = torch.randn(4, 3, dtype=F64) * (rank + 1)
    ud.all_gather(a, pg).backward(ga)
    other = torch.randn(4, 3, dtype=F64)  # same on both ranks (same RNG stream so far)
    grads = [ga / (rank + 1) * (r + 1) for r in range(world)]  # every rank's cotangent
    err("all_gather grad", a.grad, sum(grads)[rank * 2:(rank + 1) * 2])
    b = contrib[rank].clone().requires_grad_()
    gb = other[:2] * (rank + 1)
    y = ud.reduce_scatter(b, pg)
    err("reduce_scatter", y, total[rank * 2:(rank + 1) * 2])
    y.backward(gb)
    err("reduce_scatter grad", b.grad, torch.cat([other[:2] * (r + 1) for r in range(world)]))
    c = contrib[rank].clone().requires_grad_()
    before = c.detach().clone()
    y = ud.all_reduce(c, pg)
    err("all_reduce", y, total)
    err("all_reduce leaves its input", c.detach(), before)
    y.backward(other)
    err("all_reduce grad passes through", c.grad, other)

    # sync_shared_params: flagged parameters take rank 0's values; the others keep their own.
    m = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(float(rank + 1))
    for p in m[1].parameters():
        p._shared_params = True
    ud.sync_shared_params(m, pg)
    err("shared synced", m[1].weight, torch.ones(3, dtype=F64))
    err("unshared kept", m[0].weight, torch.full((3, 3), float(rank + 1), dtype=F64))

    # allreduce_sequence_parallel_grad: flagged gradients summed, others untouched, None skipped.
    for p in m.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    m[1].weight._sequence_parallel = True
    m[1].bias._sequence_parallel = True
    extra = nn.Parameter(torch.zeros(2, dtype=F64))
    extra._sequence_parallel = True
    m.register_parameter("z_extra", extra)  # flagged, no gradient on either rank
    ud.allreduce_sequence_parallel_grad(m, pg)
    err("seq-parallel grad summed", m[1].weight.grad, torch.full((3,), 3.0, dtype=F64))
    err("seq-parallel bias summed", m[1].bias.grad, torch.full((3,), 3.0, dtype=F64))
    err("other grad untouched", m[0].weight.grad, torch.full((3, 3), float(rank + 1), dtype=F64))
    errs["no grad stays None"] = float(extra.grad is not None)

    try:
        ud.reduce_scatter_raw(torch.zeros(3, 2), pg)
        errs["indivisible raises"] = 1.0
    except ValueError as e:
        errs["indivisible raises"] = float("divisible by the world size" not in str(e))
    return errs


def test_collectives_two_gloo_ranks():
    results = run_group(_worker, 2)
    for rank, errs in enumerate(results):
        assert len(errs) == 21, errs
        bad = {k: v for k, v in errs.items() if not v <= 1e-12}
        assert not bad, f"rank {rank}: {bad}"


def test_single_rank_group_skips_collectives():
    # Without a group (None: world size 1) the raw forms return their input and no handle.
    from culmen.flash_attn.utils import distributed as ud

    x = torch.randn(2, 3)
    for fn in (ud.all_gather_raw, ud.reduce_scatter_raw, ud.all_reduce_raw):
        out, h = fn(x, None)
        assert out is x and h is None
    for fn in (ud.all_gather, ud.reduce_scatter, ud.all_reduce):
        assert torch.equal(fn(x, None), x)
    lin = torch.nn.Linear(2, 2)
    lin.weight._sequence_parallel = True
    lin.weight.grad = torch.ones(2, 2)
    ud.allreduce_sequence_parallel_grad(lin, None)
    assert torch.equal(lin.weight.grad, torch.ones(2, 2))
