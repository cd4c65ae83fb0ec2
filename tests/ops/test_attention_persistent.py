"""``TUNING["persistent_fwd"]``: the dense / varlen forward on a persistent 1-D grid, each program looping over
query tiles (``PERSISTENT`` in ``_attn_fwd_kernel``).

The interpreter runs programs one after another, so ``interp_persistent_programs`` (3 here) makes every program
loop over several tiles of several heads and batch rows. Outputs and lse are checked against float64 with the
tolerance rule and against the one-program-per-tile grid (the same math per tile: bitwise equal); KV-cache and
split-KV calls keep their own grids; the default (off) launches one program per tile.
"""

from __future__ import annotations

import pytest
import torch

from culmen.flash_attn import flash_attn_with_kvcache
from culmen.ops.attention import attention_ref, flash_attn, flash_attn_varlen, launch
from culmen.ops.backend import set_backend
from culmen.ops.common.launch import Launch
from culmen.testing import assert_close_tolerance
from culmen.testing.attention import plain
from tests.ops.test_attention_triton import check

PROGRAMS = 3


@pytest.fixture
def fwd_launches(monkeypatch):
    """Records ``(grid[0], PERSISTENT, SPLIT)`` of every forward-kernel launch."""
    seen = []
    real = Launch.__call__

    def spy(self, stream, aligned, *args):
        if self.fn.__name__ == "_attn_fwd_kernel":
            seen.append((self.grid[0], self.meta.get("PERSISTENT"), self.meta.get("SPLIT")))
        return real(self, stream, aligned, *args)

    monkeypatch.setattr(Launch, "__call__", spy)
    return seen


@pytest.fixture
def persistent(monkeypatch):
    monkeypatch.setitem(launch.TUNING, "persistent_fwd", True)
    monkeypatch.setitem(launch.TUNING, "interp_persistent_programs", PROGRAMS)


def _tiles(B, sq, h):
    return -(-sq // launch.TUNING["interp_block"]) * B * h


def _dense(B, sq, sk, h, hk, d, causal, dtype=torch.float32):
    g = torch.Generator().manual_seed(B * 1000 + sq * 10 + sk)
    return (torch.randn(B, sq, h, d, generator=g, dtype=dtype), torch.randn(B, sk, hk, d, generator=g, dtype=dtype),
            torch.randn(B, sk, hk, d, generator=g, dtype=dtype))


def _check_fwd(out, lse, q, k, v, **kw):
    """fp32 ``out`` / ``lse`` against float64 with the tolerance rule (the same math in fp32 as baseline)."""
    hi_o, hi_l = attention_ref(q.double(), k.double(), v.double(), **kw)
    lo_o, lo_l = attention_ref(q, k, v, **kw)
    assert_close_tolerance(out, hi_o, lo_o, name="out")
    assert_close_tolerance(lse, hi_l, lo_l, name="lse")


DENSE = {
    "full_odd": dict(B=2, sq=37, sk=29, h=2, hk=2, d=16, causal=False),
    "causal_odd": dict(B=2, sq=45, sk=45, h=2, hk=2, d=16, causal=True),
    "causal_gqa_sq<sk": dict(B=1, sq=19, sk=41, h=4, hk=2, d=24, causal=True),
    "causal_mqa_sq>sk": dict(B=2, sq=40, sk=9, h=3, hk=1, d=16, causal=True),  # rows that see no key
    "seqlen1": dict(B=1, sq=1, sk=1, h=1, hk=1, d=16, causal=False),  # fewer tiles (1) than programs
}


@pytest.mark.parametrize("case", list(DENSE))
def test_persistent_dense_forward(triton_backend, persistent, fwd_launches, case):
    c = DENSE[case]
    q, k, v = _dense(c["B"], c["sq"], c["sk"], c["h"], c["hk"], c["d"], c["causal"])
    out, lse, _ = flash_attn(q, k, v, causal=c["causal"])
    tiles = _tiles(c["B"], c["sq"], c["h"])
    assert fwd_launches == [(min(tiles, PROGRAMS), True, False)]
    _check_fwd(out, lse, q, k, v, causal=c["causal"])
    launch.TUNING["persistent_fwd"] = False  # (the fixture restores it) the one-program-per-tile grid
    o1, l1, _ = flash_attn(q, k, v, causal=c["causal"])
    assert fwd_launches[-1] == (tiles, False, False)
    assert torch.equal(out, o1) and torch.equal(lse, l1)  # same math per tile, only the schedule differs


def test_persistent_bf16_window_softcap(triton_backend, persistent, fwd_launches):
    q, k, v = _dense(1, 33, 27, 4, 2, 32, False, torch.bfloat16)
    kw = dict(window_size=(6, 2), softcap=3.0)
    out, lse, _ = flash_attn(q, k, v, **kw)
    assert fwd_launches == [(PROGRAMS, True, False)]
    f = dict(causal=False, window=(6, 2), softcap=3.0, alibi=None, keep=None, p=0.0)
    assert_close_tolerance(out, plain(q, k, v, torch.float64, **f), plain(q, k, v, torch.bfloat16, **f), name="out")
    hi_l = attention_ref(q.double(), k.double(), v.double(), **kw)[1]
    assert_close_tolerance(lse, hi_l, attention_ref(q.float(), k.float(), v.float(), **kw)[1], name="lse")


def test_persistent_forward_then_backward(triton_backend, persistent, fwd_launches):
    # The backward reads the persistent forward's out / lse: gradients of every input against float64.
    check(B=2, sq=29, sk=35, h=4, hk=2, d=16, causal=True)
    assert fwd_launches and all(p for _, p, _ in fwd_launches)


def test_persistent_dropout_same_mask(triton_backend, persistent, fwd_launches):
    # Dropout counters use each tile's (batch, head, row): the persistent schedule keeps the same mask.
    q, k, v = _dense(2, 21, 26, 4, 2, 16, True)
    rng = torch.tensor([0x1357_9BDF, 11], dtype=torch.int64)
    from culmen.ops.attention import op as attn_op

    real = attn_op._rng_state
    try:
        attn_op._rng_state = lambda dp, dev: rng.clone()
        a, la, _ = flash_attn(q, k, v, 0.3, causal=True)
        launch.TUNING["persistent_fwd"] = False
        b, lb, _ = flash_attn(q, k, v, 0.3, causal=True)
    finally:
        attn_op._rng_state = real
    assert [p for _, p, _ in fwd_launches] == [True, False]
    assert torch.equal(a, b) and torch.equal(la, lb)


VARLEN = {
    "causal_gqa_empty": ([5, 0, 23, 1, 17], [9, 3, 20, 1, 17], dict(h=4, hk=2, causal=True)),
    "full_odd_empty_k": ([31, 2, 19], [19, 0, 1], dict(h=2, hk=1, causal=False)),
}


@pytest.mark.parametrize("case", list(VARLEN))
def test_persistent_varlen_forward(triton_backend, persistent, fwd_launches, case):
    lq, lk, o = VARLEN[case]
    h, hk, d = o["h"], o["hk"], 24
    cu_q = torch.tensor([0, *lq]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lk]).cumsum(0).to(torch.int32)
    g = torch.Generator().manual_seed(len(lq))
    q = torch.randn(sum(lq), h, d, generator=g)
    k = torch.randn(sum(lk), hk, d, generator=g)
    v = torch.randn(sum(lk), hk, d, generator=g)
    args = (cu_q, cu_k, max(lq), max(lk))
    out, lse, _ = flash_attn_varlen(q, k, v, *args, causal=o["causal"])
    assert fwd_launches == [(PROGRAMS, True, False)]
    set_backend("reference")
    hi = flash_attn_varlen(q.double(), k.double(), v.double(), *args, causal=o["causal"])
    lo = flash_attn_varlen(q, k, v, *args, causal=o["causal"])
    assert_close_tolerance(out, hi[0], lo[0], name="out")
    assert_close_tolerance(lse, hi[1], lo[1], name="lse")
    assert torch.isfinite(out).all()
    if 0 in lk:  # a sequence with no key: zero output, lse +inf
        b = lk.index(0)
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        assert torch.equal(out[rows], torch.zeros_like(out[rows]))
        assert torch.isinf(lse[:, rows]).all() and (lse[:, rows] > 0).all()


def test_default_off_one_program_per_tile(triton_backend, fwd_launches):
    assert launch.TUNING["persistent_fwd"] is False  # the shipped default
    q, k, v = _dense(2, 37, 29, 2, 2, 16, True)
    out, lse, _ = flash_attn(q, k, v, causal=True)
    assert fwd_launches == [(_tiles(2, 37, 2), False, False)]
    _check_fwd(out, lse, q, k, v, causal=True)


def test_programs_per_sm_sets_gpu_grid(monkeypatch):
    # On a GPU the grid is min(tiles, SMs * programs_per_sm): a fake 7-SM device.
    monkeypatch.setitem(launch.TUNING, "persistent_programs_per_sm", 2)

    class Props:
        multi_processor_count = 7

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: Props())
    cuda = torch.device("cuda")
    assert launch.persistent_grid(100, cuda) == (14,)
    assert launch.persistent_grid(5, cuda) == (5,)
    assert launch.persistent_grid(0, cuda) == (0,)
    monkeypatch.setitem(launch.TUNING, "persistent_programs_per_sm", 3)
    assert launch.persistent_grid(100, cuda) == (21,)
    monkeypatch.setitem(launch.TUNING, "interp_persistent_programs", 4)
    assert launch.persistent_grid(100, torch.device("cpu")) == (4,)


def test_kvcache_and_split_keep_their_grids(triton_backend, persistent, fwd_launches):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 4, 16, generator=g)
    kc, vc = torch.randn(2, 40, 2, 16, generator=g), torch.randn(2, 40, 2, 16, generator=g)
    lens = torch.tensor([17, 40], dtype=torch.int32)
    one = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, num_splits=1)
    split = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, num_splits=3)
    assert fwd_launches and not any(p for _, p, _ in fwd_launches)
    assert any(s for _, _, s in fwd_launches)
    torch.testing.assert_close(split, one)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_persistent_matches_per_tile_grid(monkeypatch, d, causal):
    # Real block configs and a real SM count: the persistent forward (bf16, many tiles per program) gives the
    # one-program-per-tile forward's output and lse bit for bit, and both are within the tolerance rule; varlen too.
    g = torch.Generator(device="cuda").manual_seed(d)
    B, s, h, hk = 3, 1000, 8, 2
    q = torch.randn(B, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, s, hk, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    monkeypatch.setitem(launch.TUNING, "persistent_fwd", False)
    o0, l0, _ = flash_attn(q, k, v, causal=causal)
    monkeypatch.setitem(launch.TUNING, "persistent_fwd", True)
    monkeypatch.setitem(launch.TUNING, "persistent_programs_per_sm", 1)
    o1, l1, _ = flash_attn(q, k, v, causal=causal)
    assert torch.equal(o0, o1) and torch.equal(l0, l1)
    f = dict(causal=causal, window=(-1, -1), softcap=0.0, alibi=None, keep=None, p=0.0)
    assert_close_tolerance(o1, plain(q, k, v, torch.float64, **f), plain(q, k, v, torch.bfloat16, **f), name="out")
    lens = [1000, 0, 517, 3]
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)
    qp, kp, vp = q.reshape(-1, h, d)[:sum(lens)], k.reshape(-1, hk, d)[:sum(lens)], v.reshape(-1, hk, d)[:sum(lens)]
    ov, lv, _ = flash_attn_varlen(qp, kp, vp, cu, cu, max(lens), max(lens), causal=causal)
    monkeypatch.setitem(launch.TUNING, "persistent_fwd", False)
    ov0, lv0, _ = flash_attn_varlen(qp, kp, vp, cu, cu, max(lens), max(lens), causal=causal)
    assert torch.equal(ov, ov0) and torch.equal(lv, lv0)
