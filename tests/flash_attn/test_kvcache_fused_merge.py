"""Split-KV decoding merged inside the split kernel (``launch.TUNING["fused_merge"]``): the last split program of a
row block merges every split's partial, counted in a per-plan int32 workspace it puts back to 0; and paged caches
read with one page-table load per key block (``TUNING["paged_block"]``, pages a multiple of the key block).

Under ``TRITON_INTERPRET=1`` the programs run one after another, so these tests check the merge's math, the
counters' reset and the paged addressing, not the memory ordering between programs on a GPU (the ``gpu`` tests at
the end run the same calls concurrently, eager and under a CUDA graph). Every case is checked against the
unsplit call, the two-launch merge and float64 attention; empty splits (rows shorter than ``num_splits`` key
blocks, a row with no key), GQA packing, odd head dims and shuffled page tables included. The interpreter's key
block is 16 (``TUNING["interp_block"]``), so pages of 16, 64 and 256 rows take the per-block table load and pages
of 24 the per-row one."""

from __future__ import annotations

import pytest
import torch

from culmen.flash_attn import flash_attn_with_kvcache
from culmen.ops.attention import kvcache, launch
from culmen.testing.tensors import poisoned_allocations
from culmen.testing.tolerance import assert_close_tolerance


def attend64(q, k, v, n):
    """float64 attention of ``q (sq, h, d)`` over keys ``0 .. n`` of ``k``/``v`` ``(S, hk, .)`` (no mask):
    ``(out (sq, h, dv), lse (h, sq))``; no key gives 0 / ``+inf`` (culmen's convention)."""
    sq, h, d = q.shape
    g = h // k.shape[1]
    if n == 0:
        return (torch.zeros(sq, h, v.shape[-1], dtype=torch.float64),
                torch.full((h, sq), float("inf"), dtype=torch.float64))
    kk, vv = k[:n].double().repeat_interleave(g, 1), v[:n].double().repeat_interleave(g, 1)
    s = torch.einsum("ihd,jhd->hij", q.double(), kk) * d ** -0.5
    return torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), vv), torch.logsumexp(s, -1)


@pytest.fixture
def fused(request):
    """``TUNING["fused_merge"]`` set for the test (the parameter, default on), restored after."""
    saved = launch.TUNING["fused_merge"]
    launch.TUNING["fused_merge"] = getattr(request, "param", True)
    kvcache.PLANS.clear()
    yield launch.TUNING["fused_merge"]
    launch.TUNING["fused_merge"] = saved


def _plans(n_splits):
    return [p for p in kvcache.PLANS.values() if p.n_splits == n_splits]


def _dense_case(B, h, hk, d, S, lens, sq=1, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(B, S, hk, d, generator=g).to(dtype)
    vc = torch.randn(B, S, hk, d, generator=g).to(dtype)
    q = torch.randn(B, sq, h, d, generator=g).to(dtype)
    return q, kc, vc, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("n_splits", [2, 3, 4, 5, 6, 7])
def test_fused_merge_equals_unsplit_and_float64(triton_backend, fused, n_splits):
    """GQA 4:1 one-token decoding (pack-GQA: 4 rows a program, merge tile of 4 rows), head dim 40 (padded to 64),
    101-position caches (7 key blocks): row 1 fills one key block (its other splits are empty), row 2 has no key at
    all (every split empty: output 0, lse +inf), row 3 ends inside a block. The workspace and outputs come from
    poisoned allocations (NaN), so a partial the merge reads but no program wrote shows."""
    q, kc, vc, lens = _dense_case(4, 8, 2, 40, 101, [101, 9, 0, 60])
    with poisoned_allocations():
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=n_splits, return_softmax_lse=True)
    (plan,) = _plans(n_splits)
    assert plan.attn.fused and plan.attn.merge_m == 4
    one, lse1 = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=1, return_softmax_lse=True)
    torch.testing.assert_close(out, one, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(lse, lse1, atol=2e-6, rtol=2e-6)
    for b in range(4):
        w, wl = attend64(q[b], kc[b], vc[b], int(lens[b]))
        torch.testing.assert_close(out[b].double(), w, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse[b].double(), wl, atol=2e-5, rtol=2e-5)
    assert not plan.attn._ctrs[None].any(), "the merging programs put every counter back to 0"


def test_fused_merge_in_chunks(triton_backend, fused):
    """16 query heads on one KV head at d128 (a 16-row merge tile: 4 splits a chunk) with 7 splits: the merge's
    online pass over two chunks (the rescale of the first by the second's larger max) against float64."""
    q, kc, vc, lens = _dense_case(2, 16, 1, 128, 112, [112, 50], seed=5)
    q[1] *= 4  # sharper softmax: the chunks' maxima differ more
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=7, return_softmax_lse=True)
    (plan,) = _plans(7)
    assert plan.attn.fused and (plan.attn.merge_m, plan.attn.merge_s) == (16, 4)
    for b in range(2):
        w, wl = attend64(q[b], kc[b], vc[b], int(lens[b]))
        torch.testing.assert_close(out[b].double(), w, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse[b].double(), wl, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_launch"], indirect=True)
def test_fused_and_two_launch_merges_agree(triton_backend, fused):
    """The same partials merged either way: the fused merge (on) and ``_combine_rows_kernel`` (off) give the same
    output and lse up to fp32 rounding; MHA (one row a program: a merge tile of one row) and GQA without packing
    (three query rows: a tile of four rows, one masked)."""
    for h, hk, sq in ((3, 3, 1), (4, 2, 3)):
        q, kc, vc, lens = _dense_case(2, h, hk, 24, 70, [70, 17], sq=sq, seed=sq)
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=5, return_softmax_lse=True)
        assert _plans(5)[-1].attn.fused is fused
        for b in range(2):
            kk, vv = kc[b, : int(lens[b])], vc[b, : int(lens[b])]
            sdpa = torch.nn.functional.scaled_dot_product_attention(
                q[b].transpose(0, 1).double(), kk.transpose(0, 1).double().repeat_interleave(h // hk, 0),
                vv.transpose(0, 1).double().repeat_interleave(h // hk, 0)).transpose(0, 1)
            torch.testing.assert_close(out[b].double(), sdpa, atol=2e-5, rtol=2e-5)
        kvcache.PLANS.clear()


@pytest.mark.parametrize("page", [16, 64, 256, 24])
def test_fused_merge_paged(triton_backend, fused, page):
    """Paged caches through a shuffled page table with the fused merge: pages of 16, 64 and 256 rows (multiples
    of the interpreter's 16-key block: one table load per block) and of 24 (per-row lookup); rows ending inside a
    page, one shorter than a key block. Equal to the dense cache's unsplit call and to float64."""
    B, h, hk, d = 3, 8, 2, 32
    lens = [250, 9, 131]
    npages = -(-max(lens) // page)
    g = torch.Generator().manual_seed(page)
    kc = torch.randn(B * npages, page, hk, d, generator=g)
    vc = torch.randn(B * npages, page, hk, d, generator=g)
    table = torch.randperm(B * npages, generator=g).to(torch.int32).view(B, npages)
    q = torch.randn(B, 1, h, d, generator=g)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    dk = kc[table.long()].reshape(B, npages * page, hk, d)
    dv = vc[table.long()].reshape(B, npages * page, hk, d)
    want = flash_attn_with_kvcache(q, dk, dv, cache_seqlens=seqlens, num_splits=1)
    for splits in (1, 4):
        out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, num_splits=splits)
        (plan,) = [p for p in kvcache.PLANS.values() if p.paged and p.n_splits == splits]
        assert plan.attn.page_block is (page % 16 == 0)
        assert plan.attn.fused is (splits > 1)
        torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-6)
    for b in range(B):
        w, _ = attend64(q[b], dk[b], dv[b], lens[b])
        torch.testing.assert_close(out[b].double(), w, atol=2e-5, rtol=2e-5)


def test_paged_block_load_equals_per_row(triton_backend):
    """Page 64 with a cache_leftpad (keys not starting at 0: the per-row lookup, whatever the page size) and
    without (the per-block load), with TUNING["paged_block"] off (per row) as the control: all equal."""
    B, h, hk, d, page, npages = 2, 4, 2, 16, 64, 3
    g = torch.Generator().manual_seed(7)
    kc, vc = torch.randn(B * npages, page, hk, d, generator=g), torch.randn(B * npages, page, hk, d, generator=g)
    table = torch.randperm(B * npages, generator=g).to(torch.int32).view(B, npages)
    q = torch.randn(B, 1, h, d, generator=g)
    seqlens = torch.tensor([150, 77], dtype=torch.int32)
    pad = torch.tensor([5, 0], dtype=torch.int32)
    outs = {}
    try:
        for flag in (True, False):
            launch.TUNING["paged_block"] = flag
            for lp in (None, pad):
                outs[flag, lp is None] = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table,
                                                                 cache_leftpad=lp, num_splits=3)
                (plan,) = [p for p in kvcache.PLANS.values() if (p.attn.k_range == 1) is (lp is None)]
                assert plan.attn.page_block is (flag and lp is None)
    finally:
        launch.TUNING["paged_block"] = True
    torch.testing.assert_close(outs[True, True], outs[False, True], atol=0, rtol=0)
    torch.testing.assert_close(outs[True, False], outs[False, False], atol=0, rtol=0)
    dk = kc[table.long()].reshape(B, npages * page, hk, d)
    dv = vc[table.long()].reshape(B, npages * page, hk, d)
    for b in range(B):
        p = int(pad[b])
        w, _ = attend64(q[b], dk[b, p:], dv[b, p:], int(seqlens[b]) - p)
        torch.testing.assert_close(outs[True, False][b].double(), w, atol=2e-5, rtol=2e-5)


def test_fused_merge_repeated_calls_reuse_counters(triton_backend, fused):
    """Calls on one plan reuse its counters (zeroed once, put back to 0 by every launch): results are bitwise the
    same call after call, with new values in between, and the counters stay 0."""
    q, kc, vc, lens = _dense_case(2, 8, 2, 16, 90, [90, 33])
    first = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=6)
    (plan,) = _plans(6)
    ctr = plan.attn._ctrs[None]
    for _ in range(2):
        torch.testing.assert_close(flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=6), first,
                                   atol=0, rtol=0)
        assert plan.attn._ctrs[None] is ctr and not ctr.any()
    lens2 = torch.tensor([12, 90], dtype=torch.int32)
    other = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens2, num_splits=6)
    assert _plans(6) == [plan] and not ctr.any()
    for b in range(2):
        w, _ = attend64(q[b], kc[b], vc[b], int(lens2[b]))
        torch.testing.assert_close(other[b].double(), w, atol=2e-5, rtol=2e-5)


def test_fused_merge_bf16_tolerance_rule(triton_backend, fused):
    """bf16 decoding with the fused merge: its error against float64 is within DESIGN.md's rule (twice PyTorch's
    own bf16 error, SDPA on the same rows, plus the bf16 atol)."""
    B, h, hk, d, S = 2, 8, 2, 64, 97
    q, kc, vc, lens = _dense_case(B, h, hk, d, S, [97, 40], dtype=torch.bfloat16, seed=3)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=4)
    assert _plans(4)[0].attn.fused
    for b in range(B):
        n = int(lens[b])
        w, _ = attend64(q[b], kc[b], vc[b], n)
        lo = torch.nn.functional.scaled_dot_product_attention(
            q[b].transpose(0, 1), kc[b, :n].transpose(0, 1).repeat_interleave(h // hk, 0),
            vc[b, :n].transpose(0, 1).repeat_interleave(h // hk, 0)).transpose(0, 1)
        assert_close_tolerance(out[b], w, lo, name=f"out[{b}]")


# ----------------------------------------------------------------------------------------------------- GPU


def _gpu_case(B, L, page, seed=0):
    dev, h, hk, d = "cuda", 32, 8, 128
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(B, 1, h, d, device=dev, dtype=torch.bfloat16, generator=g)
    if page:
        n = -(-L // page)
        kc = torch.randn(B * n, page, hk, d, device=dev, dtype=torch.bfloat16, generator=g)
        vc = torch.randn(B * n, page, hk, d, device=dev, dtype=torch.bfloat16, generator=g)
        table = torch.randperm(B * n, device=dev, generator=g).to(torch.int32).view(B, n)
    else:
        kc = torch.randn(B, L, hk, d, device=dev, dtype=torch.bfloat16, generator=g)
        vc = torch.randn(B, L, hk, d, device=dev, dtype=torch.bfloat16, generator=g)
        table = None
    return q, kc, vc, table


@pytest.mark.gpu
@pytest.mark.parametrize("B,L,page", [(1, 4096, 0), (1, 32768, 0), (8, 8192, 256), (8, 8192, 16)])
def test_gpu_fused_merge_eager_many_calls(fused, B, L, page):
    """Issue 17's decode shape (bf16, 32 query heads over 8 KV heads, d 128) with the automatic split count: the
    fused merge equals the two-launch merge call after call (50 calls with changing lengths, some rows shorter
    than a split, one empty), which a missing release/acquire between the split programs would break."""
    q, kc, vc, table = _gpu_case(B, L, page)
    g = torch.Generator(device="cuda").manual_seed(1)
    all_lens = [torch.randint(0, L + 1, (B,), device="cuda", generator=g, dtype=torch.int32) for _ in range(50)]
    for it in range(0, 50, 5):
        all_lens[it][0] = 0 if it % 10 == 0 else 37
    results = {}
    for flag in (True, False):  # (a TUNING change drops the plans: each setting runs all calls on one plan)
        launch.TUNING["fused_merge"] = flag
        results[flag] = [flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                                 return_softmax_lse=True) for lens in all_lens]
        (plan,) = kvcache.PLANS.values()
        assert plan.n_splits > 1 and plan.attn.fused is flag
        assert all(not c.any() for c in plan.attn._ctrs.values())
    for (got, lse), (want, wlse) in zip(results[True], results[False]):
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse, wlse, atol=1e-4, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [0, 256, 16])
def test_gpu_fused_merge_cuda_graph(fused, page):
    """Batch-1 split decoding with the fused merge captured in a CUDA graph (no warm-up on the capture stream:
    the capture gets its own counters, zeroed inside the graph) and replayed with new q and cache lengths: equal
    to eager fused calls bitwise (the merge's order is fixed), and to the unsplit call within bf16 rounding."""
    q, kc, vc, table = _gpu_case(1, 4096, page)
    lens = torch.tensor([4096], device="cuda", dtype=torch.int32)

    def step(splits=0):
        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, num_splits=splits)

    step()  # compile and plan on the current stream (its own counters)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = step()
    (plan,) = [p for p in kvcache.PLANS.values() if p.attn.fused]
    assert plan.n_splits > 1 and len(plan.attn._ctrs) == 1  # the capture's counters are the graph's, not cached
    for n in (4096, 1, 333, 2049, 4000):
        lens.fill_(n)
        q.normal_()
        for _ in range(3):
            g.replay()
        got = static.clone()
        want = step()
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        torch.testing.assert_close(got.float(), step(1).float(), atol=1e-2, rtol=1e-2)
