"""apex.contrib.peer_memory: ``PeerMemoryPool`` bookkeeping and peer views, ``PeerHaloExchanger1d`` against an
all-gather reference, on spawned gloo ranks (shared-memory pool and send/recv transports), and on 2 GPUs
(symmetric memory, GPU-marked)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402

from culmen.contrib.peer_memory import PeerHaloExchanger1d, PeerMemoryPool  # noqa: E402

# (H_split, layout, dtype, inner rows, other spatial size, channels, half_halo); layout "nchw", "cl"
# (channels_last) or "nhwc" (explicit_nhwc).
CASES = [
    (True, "nchw", torch.float32, 5, 7, 3, 1),
    (True, "cl", torch.float16, 4, 5, 6, 2),
    (True, "nhwc", torch.bfloat16, 3, 6, 5, 1),
    (False, "nchw", torch.float64, 6, 3, 2, 2),
    (False, "cl", torch.int32, 5, 4, 3, 1),
    (False, "nhwc", torch.float32, 7, 5, 4, 3),
]


def _make(case, rank, seed):
    H_split, layout, dtype, inner, other, c, hh = case
    g = torch.Generator().manual_seed(seed * 100 + rank)
    rows = inner + 2 * hh
    if layout == "nhwc":
        shape = (2, rows, other, c) if H_split else (2, other, rows, c)
    else:
        shape = (2, c, rows, other) if H_split else (2, c, other, rows)
    y = (torch.randn(shape, generator=g) * 100).to(dtype)
    if layout == "cl":
        y = y.contiguous(memory_format=torch.channels_last)
    return y


def _expected(ys, rank, case):
    """The exchange computed from every rank's input: all-gathered ``ys``."""
    H_split, layout, _, inner, _, _, hh = case
    nhwc = layout == "nhwc"
    dim = (1 if nhwc else 2) if H_split else (2 if nhwc else 3)
    out = ys[rank].clone()
    world = len(ys)
    low = out.narrow(dim, 0, hh)
    high = out.narrow(dim, inner + hh, hh)
    low.copy_(ys[rank - 1].narrow(dim, inner, hh) if rank > 0 else torch.zeros_like(low))
    high.copy_(ys[rank + 1].narrow(dim, hh, hh) if rank < world - 1 else torch.zeros_like(high))
    return out


def _halo_worker(rank, world):
    import torch.distributed as dist

    failures = []
    ranks = list(range(world))
    pool = PeerMemoryPool(1000, 64 * 1024, ranks)
    if pool.mode != "shared_memory" or not pool.is_symmetric:
        failures.append(f"CPU pool on one host should be shared_memory, got {pool.mode}")
    for transport, p in (("peer", pool), ("p2p", None)):
        for step in range(2):  # the second round reuses the pool after reset()
            for i, case in enumerate(CASES):
                y = _make(case, rank, i + 10 * step)
                ys = [torch.empty(y.shape, dtype=y.dtype) for _ in range(world)]
                dist.all_gather(ys, y.contiguous())
                want = _expected(ys, rank, case)
                ex = PeerHaloExchanger1d(ranks, rank, p, case[6])
                ptr, strides = y.data_ptr(), y.stride()
                ex(y, case[0], case[1] == "nhwc", 4, False)
                if not torch.equal(y, want):
                    failures.append(f"{transport} step {step} case {i} {case}: halos differ")
                if y.data_ptr() != ptr or y.stride() != strides:
                    failures.append(f"{transport} case {i}: not in place")
            pool.reset()
    # Without reset() the dynamic region runs out (Apex's pool semantics), with a clear error.
    small = PeerMemoryPool(0, 1024, ranks)
    ex = PeerHaloExchanger1d(ranks, rank, small, 1)
    y = torch.randn(1, 4, 6, 40)
    try:
        for _ in range(8):
            ex(y)
        failures.append("dynamic pool never ran out without reset()")
    except RuntimeError as e:
        if "exhausted" not in str(e):
            failures.append(f"unexpected error text: {e}")
    return failures


def _pool_worker(rank, world):
    import torch.distributed as dist

    failures = []
    pool = PeerMemoryPool(300, 1000)  # default peer_ranks: every rank of this host
    if pool.peer_ranks != list(range(world)) or pool.peer_rank != rank:
        failures.append(f"default peer_ranks {pool.peer_ranks}, peer_rank {pool.peer_rank}")
    if (pool.static_size, pool.dynamic_size) != (512, 1024):
        failures.append(f"sizes not rounded to 256: {pool.static_size}, {pool.dynamic_size}")
    a = pool.allocate_peer_tensors([3, 5], torch.float32, False, False)
    b = pool.allocate_peer_tensors([2, 3, 4, 5], torch.float16, True, False)
    if pool.static_offset != 256 + 2 * 120:
        failures.append(f"static offset {pool.static_offset}: allocations not 256-aligned")
    if b[0].stride() != (60, 1, 15, 3) or b[0].shape != (2, 3, 4, 5):
        failures.append(f"channels_last view has shape {tuple(b[0].shape)} strides {b[0].stride()}")
    base = pool.raw.data_ptr()
    if a[rank].data_ptr() != base or b[rank].data_ptr() != base + 256:
        failures.append("own entries do not start at the aligned offsets of the local block")
    try:
        pool.allocate_peer_tensors([4, 4], torch.float32, False, False)  # 512 + 64 > 512
        failures.append("static region over-allocated")
    except RuntimeError as e:
        if "static" not in str(e):
            failures.append(f"static exhaustion message: {e}")
    if pool.static_offset != 496:
        failures.append("a failed allocation moved the offset")
    d1 = pool.allocate_peer_tensors([100], torch.int32, False, True)
    d2 = pool.allocate_peer_tensors([10], torch.float64, False, True)
    if d1[rank].data_ptr() != base + 512 or d2[rank].data_ptr() != base + 512 + 512:
        failures.append("dynamic allocations are not after the static region, 256-aligned")
    pool.reset()
    d3 = pool.allocate_peer_tensors([7], torch.int32, False, True)
    if d3[rank].data_ptr() != base + 512 or pool.static_offset != 496:
        failures.append("reset() must rewind the dynamic region only")
    # Peer views are the peers' memory: rank r writes into its view of rank (r+1)'s tensor.
    a[rank].fill_(-1.0)
    dist.barrier()
    a[(rank + 1) % world].copy_(torch.arange(15.0).view(3, 5) + rank)
    dist.barrier()
    src = (rank - 1) % world
    if not torch.equal(a[rank], torch.arange(15.0).view(3, 5) + src):
        failures.append(f"rank {rank} does not see what rank {src} wrote into its block")
    # A peer group of one (Apex: a rank outside the spatial groups passes [rank]).
    solo = PeerMemoryPool(256, 256, [rank])
    t = solo.allocate_peer_tensors([4], torch.float32, False, False)
    if len(t) != 1 or solo.group is not None:
        failures.append("a one-rank pool should have one entry and no group")
    # Inconsistent peer groups fail on every rank (none waits forever).
    try:
        PeerMemoryPool(256, 256, [0, 1] if rank == 0 else [1])
        failures.append("inconsistent peer_ranks accepted")
    except ValueError as e:
        if "peer_ranks" not in str(e):
            failures.append(f"inconsistent peer_ranks message: {e}")
    return failures


def _middle_worker(rank, world):
    """Three ranks: the middle one takes a halo from each side."""
    import torch.distributed as dist

    failures = []
    ranks = list(range(world))
    pool = PeerMemoryPool(0, 16 * 1024, ranks)
    for transport, p in (("peer", pool), ("p2p", None)):
        for i, case in enumerate(CASES[:3]):
            y = _make(case, rank, i)
            ys = [torch.empty_like(y) for _ in range(world)]
            dist.all_gather(ys, y)
            want = _expected(ys, rank, case)
            PeerHaloExchanger1d(ranks, rank, p, case[6])(y, case[0], case[1] == "nhwc")
            if not torch.equal(y, want):
                failures.append(f"{transport} case {i}: halos differ on rank {rank}")
        pool.reset()
    return failures


def _check(results):
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:20])


def test_halo_exchange_two_ranks():
    _check(run_group(_halo_worker, 2, timeout=90))


def test_pool_semantics_and_peer_views():
    _check(run_group(_pool_worker, 2, timeout=90))


def test_halo_exchange_three_ranks_middle():
    _check(run_group(_middle_worker, 3, timeout=90))


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="half_halo"):
        PeerHaloExchanger1d([0, 1], 0, None, 0)
    with pytest.raises(ValueError, match="rank_in_group"):
        PeerHaloExchanger1d([0, 1], 2, None, 1)
    with pytest.raises(ValueError, match="ranks"):
        PeerHaloExchanger1d([], 0, None, 1)
    with pytest.raises(TypeError, match="peer_pool"):
        PeerHaloExchanger1d([0], 0, object(), 1)
    ex = PeerHaloExchanger1d([0], 0, None, 2)
    with pytest.raises(ValueError, match="4-d"):
        ex(torch.zeros(3, 9, 9))
    with pytest.raises(ValueError, match="3 \\* half_halo"):
        ex(torch.zeros(1, 2, 5, 9))
    with pytest.raises(TypeError, match="static_size"):
        PeerMemoryPool(1.5, 10)
    with pytest.raises(ValueError, match="dynamic_size"):
        PeerMemoryPool(10, -1)


def test_one_rank_group_zeroes_both_halos():
    # A group of one has no neighbours: both halos are zero, the inner rows untouched (no process group needed).
    y = torch.randn(2, 3, 8, 5)
    want = y.clone()
    want[:, :, :2] = 0
    want[:, :, 6:] = 0
    PeerHaloExchanger1d([0], 0, None, 2)(y)
    assert torch.equal(y, want)


def test_alias_import():
    import subprocess
    import textwrap

    code = textwrap.dedent("""
        import culmen.compat as compat
        compat.install()
        from apex.contrib.peer_memory import PeerMemoryPool, PeerHaloExchanger1d
        import apex.contrib.peer_memory.peer_memory as pm
        import apex.contrib.peer_memory.peer_halo_exchanger_1d as hx
        import culmen.contrib.peer_memory as c
        assert PeerMemoryPool is c.PeerMemoryPool is pm.PeerMemoryPool
        assert PeerHaloExchanger1d is c.PeerHaloExchanger1d is hx.PeerHaloExchanger1d
        print("OK")
    """)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60)
    assert out.stdout.strip() == "OK", out.stderr


def _gpu_worker(rank, world):
    import torch.distributed as dist

    failures = []
    ranks = list(range(world))
    pool = PeerMemoryPool(64 * 1024, 4 * 1024 * 1024, ranks)
    if pool.mode != "symmetric_memory":
        failures.append(f"pool mode on GPUs is {pool.mode} (symmetric memory unavailable?)")
    gpu_cases = [(True, lay, dt, 40, 56, 64, 1) for lay in ("nchw", "cl", "nhwc")
                 for dt in (torch.float16, torch.bfloat16)]
    gpu_cases += [(False, lay, torch.float32, 38, 21, 32, 2) for lay in ("nchw", "cl", "nhwc")]
    for transport, p in (("peer", pool), ("p2p", None)):
        for step in range(3):
            for i, case in enumerate(gpu_cases):
                y = _make(case, rank, i + 10 * step).cuda()
                if case[1] == "cl":
                    y = y.contiguous(memory_format=torch.channels_last)
                ys = [torch.empty(y.shape, dtype=y.dtype, device="cuda") for _ in range(world)]
                dist.all_gather(ys, y.contiguous())
                want = _expected(ys, rank, case)
                PeerHaloExchanger1d(ranks, rank, p, case[6])(y, case[0], case[1] == "nhwc")
                if not torch.equal(y, want):
                    failures.append(f"{transport} step {step} case {case}: halos differ")
            pool.reset()
    torch.cuda.synchronize()
    return failures


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_halo_exchange_two_gpus_symmetric_memory():
    _check(run_group(_gpu_worker, 2, backend="nccl", timeout=180))
