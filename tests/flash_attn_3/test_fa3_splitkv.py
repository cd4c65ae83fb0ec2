"""Split-KV (flash-decoding) in ``culmen.flash_attn_3.flash_attn_with_kvcache``: ``num_splits > 1`` equals the
unsplit call and float64 attention (dense and paged caches of odd page sizes read through the page table, left
pads, new tokens, GQA, qv, a V head dim of its own, rows with no key); the automatic choice; a CUDA-graph decode
loop with a fixed schedule equals eager (GPU)."""

from __future__ import annotations

import pytest
import torch

import culmen.flash_attn_3 as fa3
from culmen.ops.attention import kvcache
from culmen.ops.attention.launch import choose_num_splits


def attend64(q, k, v, n, causal, lp=0, qv=None):
    """float64 attention of ``q (sq, h, d)`` over keys ``lp .. n`` of ``k``/``v`` ``(S, hk, .)``, causal aligned
    to key ``n``: ``(out (sq, h, dv), lse (h, sq))``; a row that sees no key gives 0 / ``+inf``."""
    sq, h, d = q.shape
    g = h // k.shape[1]
    kk, vv = k[lp:n].double().repeat_interleave(g, 1), v[lp:n].double().repeat_interleave(g, 1)
    dv = v.shape[-1]
    s = torch.einsum("ihd,jhd->hij", q.double(), kk)
    if qv is not None:
        s = s + torch.einsum("ihd,jhd->hij", qv.double(), vv)
    s = s * (d + (dv if qv is not None else 0)) ** -0.5
    if causal:
        i = torch.arange(sq).view(sq, 1) + n - sq
        j = torch.arange(lp, n).view(1, -1)
        s = s.masked_fill(j > i, float("-inf"))
    seen = torch.isfinite(s).any(-1, keepdim=True)
    s = s.masked_fill(~seen, 0.0)
    a = torch.softmax(s, -1) * seen
    lse = torch.where(seen[..., 0], torch.logsumexp(s, -1), torch.full((), float("inf"), dtype=s.dtype))
    return torch.einsum("hij,jhd->ihd", a, vv), lse


def _check(out, lse, want, wlse, atol=2e-5):
    torch.testing.assert_close(out.double(), want, atol=atol, rtol=atol)
    torch.testing.assert_close(lse.double(), wlse, atol=atol, rtol=atol)


def test_choose_num_splits():
    # decode at batch 1, 8 KV heads on 132 SMs: 16 splits (one wave); capped by the cache (2 key blocks a
    # split) and MAX_SPLITS
    assert choose_num_splits(1, 8, 1, 32768, 128, 64, 132) == 16  # one wave: 8 units x 16 splits <= 132 SMs
    assert choose_num_splits(1, 8, 1, 640, 128, 64, 132) == 5
    assert choose_num_splits(1, 1, 1, 1 << 20, 128, 64, 1000) == 128
    # enough programs, or prefill-sized seqlen_q: no split
    assert choose_num_splits(64, 8, 1, 32768, 128, 64, 132) == 1
    assert choose_num_splits(1, 8, 17, 32768, 128, 64, 132) == 1
    assert choose_num_splits(2, 2, 1, 0, 128, 64, 132) == 1
    # a paged cache: two waves at any batch (its programs stream slower through the page table)
    assert choose_num_splits(8, 8, 4, 8192, 16, 128, 132) == 2
    assert choose_num_splits(8, 8, 4, 8192, 16, 128, 132, paged=True) == 4
    assert choose_num_splits(1, 8, 4, 640, 16, 128, 132, paged=True) == 3  # still one split per two key blocks
    assert choose_num_splits(16, 8, 4, 8192, 16, 128, 132) == 1
    assert choose_num_splits(16, 8, 4, 8192, 16, 128, 132, paged=True) == 2
    assert choose_num_splits(64, 8, 4, 8192, 16, 128, 132, paged=True) == 1
    # ... read a key block at a time and merged in the split kernel: at most one chunk of the merge
    assert choose_num_splits(1, 8, 4, 32768, 16, 128, 132, paged=True) == 33
    assert choose_num_splits(1, 8, 4, 32768, 16, 128, 132, paged=True, merge_cap=16) == 16
    assert choose_num_splits(8, 8, 4, 8192, 16, 128, 132, paged=True, merge_cap=16) == 4
    assert choose_num_splits(1, 8, 4, 32768, 16, 128, 132, merge_cap=8) == 16  # dense caches: no cap


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("sq,causal", [(1, False), (3, True)])
def test_dense_cache_split_equals_unsplit_and_float64(triton_backend, splits, sq, causal):
    B, h, hk, d, S = 3, 4, 2, 16, 70
    kc, vc = torch.randn(B, S, hk, d), torch.randn(B, S, hk, d)
    q = torch.randn(B, sq, h, d)
    kn, vn = torch.randn(B, 2, hk, d), torch.randn(B, 2, hk, d)
    seqlens = torch.tensor([61, 0, 33], dtype=torch.int32)
    lp = torch.tensor([0, 0, 9], dtype=torch.int32)
    kc1, vc1 = kc.clone(), vc.clone()
    base, lb, *_ = fa3.flash_attn_with_kvcache(q, kc1, vc1, kn, vn, cache_seqlens=seqlens, cache_leftpad=lp,
                                               causal=causal, num_splits=1, return_softmax_lse=True)
    out, lse, *_ = fa3.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, cache_leftpad=lp,
                                               causal=causal, num_splits=splits, return_softmax_lse=True)
    torch.testing.assert_close(kc, kc1, atol=0, rtol=0)  # the same append
    _check(out, lse, base.double(), lb.double(), atol=1e-5)
    for b in range(B):
        w, wl = attend64(q[b], kc[b], vc[b], int(seqlens[b]) + 2, causal, int(lp[b]))
        _check(out[b], lse[b], w, wl)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("page", [1, 3, 16])
def test_paged_cache_read_through_the_table(triton_backend, page, splits):
    """Pages in a shuffled order, any page size; a V head dim of its own; one row with no key at all. Decoding
    reads the pages through the table split or not (no gathered copy of the cache)."""
    B, h, hk, d, dv, npages = 3, 2, 1, 16, 8, -(-40 // page)
    kc = torch.randn(B * npages, page, hk, d)
    vc = torch.randn(B * npages, page, hk, dv)
    table = torch.randperm(B * npages, dtype=torch.int32).view(B, npages)
    seqlens = torch.tensor([npages * page, 13, 0], dtype=torch.int32)
    q = torch.randn(B, 1, h, d)
    out, lse, *_ = fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table,
                                               num_splits=splits, return_softmax_lse=True)
    dk = kc[table.long()].reshape(B, npages * page, hk, d)
    dvv = vc[table.long()].reshape(B, npages * page, hk, dv)
    for b in range(B):
        w, wl = attend64(q[b], dk[b], dvv[b], int(seqlens[b]), False)
        _check(out[b], lse[b], w, wl)
    assert torch.all(out[2] == 0) and torch.all(torch.isinf(lse[2]) & (lse[2] > 0))
    # the plan really took the direct paged read (no gathered copy)
    plans = [p for p in kvcache.PLANS.values() if getattr(p, "paged_direct", False) and p.attn.page == page]
    assert plans and plans[-1].n_splits == min(splits, -(-npages * page // 16))  # at most one split per key block


def test_split_with_qv_and_new_tokens_paged(triton_backend):
    B, h, hk, d, dv, page, npages = 2, 4, 1, 8, 16, 5, 6
    kc, vc = torch.randn(B * npages, page, hk, d), torch.randn(B * npages, page, hk, dv)
    table = torch.randperm(B * npages, dtype=torch.int32).view(B, npages)
    seqlens = torch.tensor([20, 7], dtype=torch.int32)
    kn, vn = torch.randn(B, 1, hk, d), torch.randn(B, 1, hk, dv)
    q, qv = torch.randn(B, 1, h, d), torch.randn(B, 1, h, dv)
    out, lse, *_ = fa3.flash_attn_with_kvcache(q, kc, vc, kn, vn, qv=qv, cache_seqlens=seqlens, page_table=table,
                                               num_splits=3, return_softmax_lse=True)
    dk = kc[table.long()].reshape(B, -1, hk, d)
    dvv = vc[table.long()].reshape(B, -1, hk, dv)
    for b in range(B):
        torch.testing.assert_close(dk[b, int(seqlens[b])], kn[b, 0])  # appended through the table
        w, wl = attend64(q[b], dk[b], dvv[b], int(seqlens[b]) + 1, False, qv=qv[b])
        _check(out[b], lse[b], w, wl)


@pytest.mark.parametrize("rows", [True, False], ids=["merge_rows", "merge_blocks"])
def test_many_splits_merge_kernels(triton_backend, monkeypatch, rows):
    """40 splits of a d128 cache, more than one chunk of the per-row merge (32 splits of 128 values): both merge
    kernels give float64 attention, with and without the lse (the merge then writes it into the workspace)."""
    from culmen.ops.attention import launch

    monkeypatch.setitem(launch.TUNING, "combine_rows", rows)
    B, h, hk, d, S = 2, 2, 1, 128, 40 * 16
    kc, vc = torch.randn(B, S, hk, d), torch.randn(B, S, hk, d)
    q = torch.randn(B, 1, h, d)
    seqlens = torch.tensor([S, 100], dtype=torch.int32)  # row 1: most splits see no key
    out, lse, *_ = fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=40,
                                               return_softmax_lse=True)
    plan = [p for p in kvcache.PLANS.values() if p.attn.k_shape == kc.shape and p.return_lse][-1]
    assert plan.n_splits == 40
    alone = fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=40)
    assert torch.equal(alone, out)
    for b in range(B):
        w, wl = attend64(q[b], kc[b], vc[b], int(seqlens[b]), False)
        _check(out[b], lse[b], w, wl)


def test_automatic_choice_does_not_split_on_cpu_or_for_prefill(triton_backend):
    q, kc, vc = torch.randn(1, 1, 2, 16), torch.randn(1, 64, 1, 16), torch.randn(1, 64, 1, 16)
    fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=50)
    plan = [p for p in kvcache.PLANS.values() if p.out_shape[:3] == tuple(q.shape[:3])
            and p.attn.k_shape == kc.shape][-1]
    # pack-GQA: the 2 query heads of the one KV head are 2 rows of one program
    assert plan.pack and plan.n_splits == 1 and plan.attn.fwd_grid == (plan.attn.num_m * 1,)


# ----------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("page", [None, 1, 256])
def test_gpu_decode_auto_split_equals_unsplit(page, monkeypatch):
    """Decode at issue 17's shape (GQA 8:1, d 128, bf16), batch 1, 4k-token cache: the automatic choice splits
    (tiles.AUTO_SPLIT forced on, whatever its default), and its result equals the unsplit
    one within bf16 rounding (and float64 within the tolerance rule)."""
    from culmen.ops.attention import tiles

    monkeypatch.setattr(tiles, "AUTO_SPLIT", True)
    kvcache.PLANS.clear()
    dev, B, h, hk, d, S = "cuda", 1, 32, 4, 128, 4096
    if page is None:
        kc = torch.randn(B, S, hk, d, device=dev, dtype=torch.bfloat16)
        vc = torch.randn(B, S, hk, d, device=dev, dtype=torch.bfloat16)
        table = None
    else:
        kc = torch.randn(B * S // page, page, hk, d, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        table = torch.randperm(B * S // page, device=dev, dtype=torch.int32).view(B, -1)
    q = torch.randn(B, 1, h, d, device=dev, dtype=torch.bfloat16)
    seqlens = torch.tensor([4001], device=dev, dtype=torch.int32)
    auto, la, *_ = fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table,
                                               return_softmax_lse=True)
    one, l1, *_ = fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table, num_splits=1,
                                              return_softmax_lse=True)
    plan = [p for p in kvcache.PLANS.values() if p.out_shape[:3] == tuple(q.shape[:3]) and p.n_splits > 1]
    assert plan, "the automatic choice should split batch-1 decoding"
    torch.testing.assert_close(auto.float(), one.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(la, l1, atol=1e-3, rtol=1e-4)
    dk = kc if table is None else kc[table.long()].reshape(B, S, hk, d)
    dvv = vc if table is None else vc[table.long()].reshape(B, S, hk, d)
    w, _ = attend64(q[0].cpu(), dk[0].cpu(), dvv[0].cpu(), 4001, False)
    assert (auto[0].double().cpu() - w).abs().max() <= 2 * (one[0].double().cpu() - w).abs().max() + 1e-3


@pytest.mark.gpu
def test_gpu_decode_under_cuda_graph_equals_eager():
    """A decode step (append one token, attend with 8 fixed splits over a paged cache of page 64) captured in a
    CUDA graph and replayed with new cache lengths equals eager calls."""
    dev, B, h, hk, d, page, npages = "cuda", 4, 16, 2, 128, 64, 32
    kc = torch.randn(B * npages, page, hk, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(B * npages, device=dev, dtype=torch.int32).view(B, npages)
    q = torch.randn(B, 1, h, d, device=dev, dtype=torch.bfloat16)
    kn, vn = torch.randn(B, 1, hk, d, device=dev, dtype=torch.bfloat16), torch.randn(B, 1, hk, d, device=dev,
                                                                                      dtype=torch.bfloat16)
    seqlens = torch.tensor([100, 5, 1500, 2000], device=dev, dtype=torch.int32)

    def step():
        return fa3.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, page_table=table, num_splits=8)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: compile and build the plan outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = step()
    kc0, vc0 = kc.clone(), vc.clone()  # after the warm-up's append (the capture itself writes nothing)
    for lens in ([101, 6, 1501, 2001], [7, 900, 3, 2040]):
        seqlens.copy_(torch.tensor(lens, device=dev, dtype=torch.int32))
        q.normal_()
        kn.normal_()
        g.replay()
        torch.cuda.synchronize()
        got = static_out.clone()
        kc.copy_(kc0)
        vc.copy_(vc0)
        want = step()
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        kc0.copy_(kc)
        vc0.copy_(vc)


def test_paged_direct_read_clamps_bad_page_numbers_in_the_kernel(triton_backend):
    """With the value checks off (as on a GPU), page numbers outside ``[0, num_pages)`` in the table the split
    kernel reads directly are clamped by the kernel itself: the result is the one of the clamped table, and
    nothing outside the cache is read (the interpreter would fault)."""
    B, h, hk, d, page, npages = 2, 2, 1, 16, 4, 5
    kc = torch.randn(B * npages, page, hk, d)
    vc = torch.randn(B * npages, page, hk, d)
    table = torch.randperm(B * npages, dtype=torch.int32).view(B, npages)
    bad = table.clone()
    bad[0, 1], bad[1, 3] = 10 ** 6, -7
    seqlens = torch.tensor([npages * page, npages * page - 3], dtype=torch.int32)
    q = torch.randn(B, 1, h, d)

    def run(t):
        return fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=t, num_splits=3)

    want = run(bad.clamp(0, B * npages - 1))
    plans = [p for p in kvcache.PLANS.values() if getattr(p, "paged_direct", False) and p.attn.page == page]
    assert plans
    for p in plans:
        p.check_values = False
    got = run(bad)
    assert torch.equal(got, want)
