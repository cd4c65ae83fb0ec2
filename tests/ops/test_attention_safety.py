"""No index value makes attention touch memory outside its tensors (issue 14, items 1 and 2).

Bad ``cu_seqlens`` (varlen) and bad ``cache_seqlens`` / ``cache_batch_idx`` / ``block_table`` (KV cache)
raise a clear error where culmen checks values (CPU tensors always; GPUs under ``set_check_values``).
With the checks off, as on a GPU by default, the kernels (Triton's interpreter here) and the PyTorch
paths must stay inside the tensors whatever the values: every input and every buffer culmen allocates
sits inside a NaN guard zone, a write outside a tensor changes the zone and a read outside pulls a NaN
into the results.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from culmen.flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
from culmen.ops.attention import checks, flash_attn_varlen
from culmen.ops.attention.checks import CacheCapacityError

GUARD = 2048  # elements of NaN on each side of every guarded tensor


INT_GUARD = 123456789  # the guard of integer tensors


class Guards:
    """Tensors living inside guard-filled buffers (NaN, or ``INT_GUARD`` for integers): ``make`` builds
    one, ``intact`` says no guard changed."""

    def __init__(self) -> None:
        self.zones: list[tuple[torch.Tensor, int, int]] = []

    def make(self, data: torch.Tensor) -> torch.Tensor:
        n = data.numel()
        fill = float("nan") if data.dtype.is_floating_point else INT_GUARD
        buf = torch.full((n + 2 * GUARD,), fill, dtype=data.dtype)
        t = buf[GUARD:GUARD + n].view(data.shape)
        t.copy_(data)
        self.zones.append((buf, GUARD, GUARD + n))
        return t

    @staticmethod
    def _clean(x: torch.Tensor) -> bool:
        return bool(x.isnan().all()) if x.dtype.is_floating_point else bool((x == INT_GUARD).all())

    def empty(self, shape, dtype) -> torch.Tensor:
        return self.make(torch.full(shape, float("nan"), dtype=dtype))

    def intact(self) -> bool:
        return all(self._clean(buf[:lo]) and self._clean(buf[hi:]) for buf, lo, hi in self.zones)


@contextlib.contextmanager
def guarded_allocations(guards: Guards):
    """``torch.empty`` / ``torch.empty_like`` of floating dtypes return guarded tensors (culmen's outputs
    and gradients are allocated with them)."""
    empty, empty_like = torch.empty, torch.empty_like

    def g_empty(*size, dtype=None, device=None, **kw):
        shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
        dt = dtype or torch.get_default_dtype()
        if not dt.is_floating_point or kw.get("out") is not None:
            return empty(*size, dtype=dtype, device=device, **kw)
        return guards.empty(tuple(shape), dt)

    def g_empty_like(t, *, dtype=None, **kw):
        dt = dtype or t.dtype
        if not dt.is_floating_point:
            return empty_like(t, dtype=dtype, **kw)
        return guards.empty(tuple(t.shape), dt)

    torch.empty, torch.empty_like = g_empty, g_empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


@pytest.fixture
def unchecked(monkeypatch):
    """The value checks off, as on a GPU without ``set_check_values(True)``."""
    monkeypatch.setattr(checks, "check_cu_values", lambda *a, **k: None)
    monkeypatch.setattr(checks, "check_kvcache_values", lambda *a, **k: None)


def _covered(cu: list[int], total: int, max_len: int) -> torch.Tensor:
    """Rows the kernels give to some sequence: sequence ``b`` is rows ``clamp(cu[b], 0, total)`` on, at most
    ``clamp(cu[b + 1], start, total) - start`` and ``max_len`` of them (the documented clamping)."""
    rows = torch.zeros(total, dtype=torch.bool)
    for a, b in zip(cu, cu[1:]):
        s = min(max(a, 0), total)
        e = min(max(b, s), total)
        rows[s:s + min(e - s, max_len)] = True
    return rows


TOTAL = 40
GOOD = [0, 15, 40]
BAD_CU = {
    "past_the_end": [0, 15, 100],
    "int32_max": [0, 30, 2**31 - 1],
    "negative_start": [-50, 10, 40],
    "all_negative": [-9, -5, -1],
    "decreasing": [0, 30, 10],
    "huge_negative": [0, -2**31, 40],
}


# ------------------------------------------------------------------------------------------ varlen


@pytest.mark.parametrize("backend", ["triton_backend", "reference_backend"])
@pytest.mark.parametrize("which", ["q", "k"])
@pytest.mark.parametrize("name", list(BAD_CU))
def test_varlen_bad_cu_seqlens_raise_naming_values(request, backend, which, name):
    request.getfixturevalue(backend)
    q, k, v = (torch.randn(TOTAL, 2, 16) for _ in range(3))
    bad, good = torch.tensor(BAD_CU[name], dtype=torch.int32), torch.tensor(GOOD, dtype=torch.int32)
    cu_q, cu_k = (bad, good) if which == "q" else (good, bad)
    with pytest.raises(ValueError, match=f"cu_seqlens_{which}") as err:
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 25, 25, causal=True)
    assert any(str(x) in str(err.value) for x in BAD_CU[name])  # the offending value is reported


def test_varlen_max_seqlen_too_small_raises():
    q = torch.randn(TOTAL, 2, 16)
    cu = torch.tensor(GOOD, dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q=10 .*cu_seqlens_q \\(25\\)"):
        flash_attn_varlen_func(q, q, q, cu, cu, 10, 25)


@pytest.mark.parametrize("name", list(BAD_CU))
def test_varlen_kernels_stay_inside_tensors(triton_backend, unchecked, name):
    """Forward and backward kernels (interpreter) with the checks off: no write outside any tensor, no
    read outside (every row the kernels own is finite), whatever ``cu_seqlens`` holds."""
    g = Guards()
    q, k, v = (g.make(torch.randn(TOTAL, 2, 16)).requires_grad_() for _ in range(3))
    cu = torch.tensor(BAD_CU[name], dtype=torch.int32)
    cu_k = torch.tensor(GOOD, dtype=torch.int32)
    with guarded_allocations(g):
        out, lse, _ = flash_attn_varlen(q, k, v, cu, cu_k, 25, 25, causal=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn(TOTAL, 2, 16))
    assert g.intact(), "a kernel wrote outside a tensor"
    rows_q = _covered(BAD_CU[name], TOTAL, 25)
    rows_k = _covered(GOOD, TOTAL, 25)
    assert torch.isfinite(out[rows_q]).all() and torch.isfinite(dq[rows_q]).all(), "a kernel read outside a tensor"
    assert not lse[:, rows_q].isnan().any()
    assert torch.isfinite(dk[rows_k]).all() and torch.isfinite(dv[rows_k]).all()


@pytest.mark.parametrize("name", list(BAD_CU))
def test_varlen_reference_stays_inside_tensors(reference_backend, unchecked, name):
    """The PyTorch path with the checks off: clamped gathers (an index outside a tensor would raise here,
    or be a device-side assert on a GPU), finite results, gradients included."""
    q, k, v = (torch.randn(TOTAL, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    cu = torch.tensor(BAD_CU[name], dtype=torch.int32)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, 25, 25, dropout_p=0.2, causal=True, return_attn_probs=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.isfinite(out).all() and not lse.isnan().any()
    assert all(torch.isfinite(t).all() for t in grads)


def test_varlen_block_table_pages_clamped():
    from culmen.ops.attention.kvcache import paged_gather

    pages = torch.arange(3 * 4, dtype=torch.float32).view(3, 4, 1, 1)
    table = torch.tensor([[2, 0], [7, -4]], dtype=torch.int32)
    dense = paged_gather(pages, table)
    assert dense.shape == (2, 8, 1, 1)
    assert dense[0, :, 0, 0].tolist() == [8, 9, 10, 11, 0, 1, 2, 3]
    assert dense[1, :, 0, 0].tolist() == [8, 9, 10, 11, 0, 1, 2, 3]  # 7 -> page 2, -4 -> page 0


# ---------------------------------------------------------------------------------------- KV cache


def _kv_inputs(g: Guards | None, B=2, S=24, hk=2, d=16, s_new=3, paged=False):
    make = g.make if g is not None else (lambda t: t)
    q = make(torch.randn(B, s_new, 4, d))
    kn, vn = make(torch.randn(B, s_new, hk, d)), make(torch.randn(B, s_new, hk, d))
    if paged:  # 6 pages of 8 rows; each batch row lists 3 pages (24 positions)
        kc, vc = make(torch.randn(6, 8, hk, d)), make(torch.randn(6, 8, hk, d))
    else:
        kc, vc = make(torch.randn(B + 1, S, hk, d)), make(torch.randn(B + 1, S, hk, d))
    return q, kn, vn, kc, vc


TABLE = [[4, 1, 3], [0, 5, 2]]


def test_kvcache_capacity_errors_name_block_table():
    q, kn, vn, kc, vc = _kv_inputs(None, paged=True)
    table = torch.tensor(TABLE, dtype=torch.int32)
    for lens in ([22, 3], [5, 24], [0, 2**31 - 1]):  # 22 + 3 new > 3 pages of 8
        with pytest.raises(RuntimeError, match="block_table") as err:
            flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                    block_table=table, causal=True)
        assert isinstance(err.value, ValueError) and isinstance(err.value, CacheCapacityError)
        assert str(lens) in str(err.value)
    # Shape level (no value read): more new tokens than the pages can ever hold.
    big = torch.randn(2, 25, 2, 16)
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_with_kvcache(torch.randn(2, 25, 4, 16), kc, vc, big, big, cache_seqlens=0, block_table=table)
    # An int cache_seqlens is a host value: checked on every device, with the checks off too.
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=23, block_table=table)


def test_kvcache_capacity_errors_contiguous_cache():
    q, kn, vn, kc, vc = _kv_inputs(None)
    with pytest.raises(CacheCapacityError, match="k_cache/v_cache row.*cache_seqlens=\\[22, 3\\]"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor([22, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_seqlens must be >= 0, got \\[-1, 3\\]"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_batch_idx must index the 3 cache rows, got \\[0, 3\\]"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor([1, 3], dtype=torch.int32),
                                cache_batch_idx=torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="k_cache/v_cache have 1 rows for a batch of 2"):
        flash_attn_with_kvcache(q, kc[:1], vc[:1], kn, vn, cache_seqlens=1)
    cos = torch.randn(10, 4)
    with pytest.raises(ValueError, match="rotary_cos/rotary_sin must have a row for each of the cache's 24"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cos, cos, cache_seqlens=1)
    _, _, _, pk, pv = _kv_inputs(None, paged=True)
    with pytest.raises(ValueError, match="block_table entries must index the 6 cache pages, got values in \\[0, 9\\]"):
        flash_attn_with_kvcache(q, pk, pv, kn, vn, cache_seqlens=1,
                                block_table=torch.tensor([[0, 9, 9], [0, 9, 9]], dtype=torch.int32))


BAD_KV = {
    # name: (cache_seqlens, cache_batch_idx, block_table)
    "past_capacity": ([22, 3], None, None),
    "int32_max": ([2**31 - 1, 3], None, None),
    "negative": ([-2, 5], None, None),
    "very_negative": ([-2**31, 5], None, None),
    "bad_batch_idx": ([4, 5], [7, 1], None),
    "negative_batch_idx": ([4, 5], [-3, 1], None),
    "paged_past_table": ([23, 4], None, TABLE),
    "paged_bad_pages": ([4, 9], None, [[4, 99, 3], [0, -7, 2]]),
    "paged_negative": ([-5, 9], None, TABLE),
}


def _expected_cache(kc, vc, kn, vn, lens, rows, table):
    """The caches after the valid writes only (a write outside the cache is dropped)."""
    kc, vc = kc.clone(), vc.clone()
    for b, n in enumerate(lens):
        for t in range(kn.shape[1]):
            pos = n + t
            if table is None:
                r = b if rows is None else rows[b]
                if 0 <= r < kc.shape[0] and 0 <= pos < kc.shape[1]:
                    kc[r, pos], vc[r, pos] = kn[b, t], vn[b, t]
            elif 0 <= pos < len(table[b]) * kc.shape[1]:
                page = table[b][pos // kc.shape[1]]
                if 0 <= page < kc.shape[0]:
                    kc[page, pos % kc.shape[1]], vc[page, pos % kc.shape[1]] = kn[b, t], vn[b, t]
    return kc, vc


@pytest.mark.parametrize("backend", ["triton_backend", "reference_backend"])
@pytest.mark.parametrize("name", list(BAD_KV))
def test_kvcache_unchecked_stays_inside_and_writes_only_valid(request, backend, unchecked, name):
    """With the value checks off: the append lands exactly the writes inside the cache (the append
    kernel masks, ``_safe_write`` sends the others nowhere), nothing outside any tensor is written or
    read, and the output is finite (rotary positions clamped into the tables)."""
    request.getfixturevalue(backend)
    lens, rows, table = BAD_KV[name]
    g = Guards()
    q, kn, vn, kc, vc = _kv_inputs(g, paged=table is not None)
    ang = torch.rand(24, 4) * 3
    cos, sin = g.make(ang.cos()), g.make(ang.sin())
    want_k, want_v = _expected_cache(kc, vc, kn, vn, lens, rows, table)
    lens_t = g.make(torch.tensor(lens, dtype=torch.int32))
    rows_t = None if rows is None else torch.tensor(rows, dtype=torch.int32)
    table_t = None if table is None else torch.tensor(table, dtype=torch.int32)
    with guarded_allocations(g):
        out = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens_t, cache_batch_idx=rows_t,
                                      block_table=table_t, causal=True)
        out_rot = flash_attn_with_kvcache(q, kc, vc, None, None, cos, sin, cache_seqlens=lens_t,
                                          cache_batch_idx=rows_t, block_table=table_t, causal=True)
    assert g.intact(), "something was written outside a tensor"
    assert torch.isfinite(out).all() and torch.isfinite(out_rot).all(), "something was read outside a tensor"
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_kvcache_safe_write_duplicates_never_undo_valid_writes():
    """``_safe_write`` of a batch whose second row is invalid and whose clamped target coincides with the
    first row's valid write: the valid value lands (the invalid write duplicates it)."""
    from culmen.ops.attention.kvcache import _safe_write

    cache = torch.zeros(2, 4, 1, 1)
    new = torch.tensor([1.0, 2.0]).view(2, 1, 1, 1)
    pos = torch.tensor([[3], [9]])  # row 1's position 9 clamps onto (1, 3)
    rows = torch.tensor([1, 1])
    for _ in range(3):
        cache.zero_()
        _safe_write(cache, new, rows, pos, None)
        assert cache[1, 3].item() == 1.0 and cache.sum().item() == 1.0
    cache.zero_()
    _safe_write(cache, new, rows, torch.tensor([[-1], [9]]), None)  # nothing valid: nothing changes
    assert cache.abs().sum().item() == 0.0


@pytest.mark.gpu
def test_gpu_bad_values_never_poison_the_context():
    """On a GPU with the checks off, absurd index values give numbers, never a device-side assert (which
    would poison the CUDA context); with ``set_check_values(True)`` they raise the CPU errors."""
    from culmen.ops.backend import set_check_values

    dev = torch.device("cuda")
    q, k, v = (torch.randn(40, 2, 64, device=dev, dtype=torch.float16, requires_grad=True) for _ in range(3))
    for bad in BAD_CU.values():
        cu = torch.tensor(bad, dtype=torch.int32, device=dev)
        out = flash_attn_varlen_func(q, k, v, cu, cu, 25, 25, causal=True)
        out.float().sum().backward()
    qd = torch.randn(2, 3, 4, 64, device=dev, dtype=torch.float16)
    kn = torch.randn(2, 3, 2, 64, device=dev, dtype=torch.float16)
    kc, vc = (torch.randn(6, 8, 2, 64, device=dev, dtype=torch.float16) for _ in range(2))
    for lens, rows, table in BAD_KV.values():
        if rows is not None:
            continue
        t = torch.tensor(table or TABLE, dtype=torch.int32, device=dev)
        flash_attn_with_kvcache(qd, kc, vc, kn, kn, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=dev),
                                block_table=t, causal=True)
    torch.cuda.synchronize()  # a device-side assert would surface here
    assert torch.isfinite(kc).all()
    set_check_values(True)
    try:
        with pytest.raises(RuntimeError, match="block_table"):
            flash_attn_with_kvcache(qd, kc, vc, kn, kn, block_table=torch.tensor(TABLE, dtype=torch.int32, device=dev),
                                    cache_seqlens=torch.tensor([23, 4], dtype=torch.int32, device=dev))
        with pytest.raises(ValueError, match="cu_seqlens_q"):
            cu = torch.tensor([0, 15, 100], dtype=torch.int32, device=dev)
            flash_attn_varlen_func(q, k, v, cu, cu, 25, 25)
    finally:
        set_check_values(False)
