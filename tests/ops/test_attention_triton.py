"""The dense Triton FlashAttention kernels (CPU interpreter) against a float64 reference.

Every case runs ``flash_attn`` forward and backward through the kernels (``triton_backend``) and
checks ``out``, ``lse`` and the gradients of q, k, v with the tolerance rule (2x the error of the
same math done plainly in the input dtype). The launcher uses 16x16 blocks under the interpreter,
so the odd seqlens below cross several blocks, partial blocks and skipped (fully masked) blocks.
"""

from __future__ import annotations

import pytest
import torch

from culmen.ops.attention import attention_ref, dropout_keep_mask, flash_attn, flash_attn_varlen, launch, tiles
from culmen.ops.attention import op as attn_op
from culmen.ops.backend import set_backend
from culmen.testing import assert_close_tolerance
from culmen.testing.attention import grads as _grads
from culmen.testing.attention import plain


def _inputs(B, sq, sk, h, hk, d, dtype, noncontig=False):
    if noncontig:
        q = torch.randn(B, sq, h, 2 * d, dtype=dtype)[..., ::2]  # head dim not unit-stride
        k = torch.randn(B, hk, sk, d, dtype=dtype).transpose(1, 2)  # BHSD storage
        v = torch.randn(sk, B, hk, d, dtype=dtype).transpose(0, 1)
        assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    else:
        q = torch.randn(B, sq, h, d, dtype=dtype)
        k = torch.randn(B, sk, hk, d, dtype=dtype)
        v = torch.randn(B, sk, hk, d, dtype=dtype)
    return tuple(t.requires_grad_(True) for t in (q, k, v))


def check(*, B=2, sq=23, sk=29, h=2, hk=2, d=16, dtype=torch.float32, causal=False, window=(-1, -1), softcap=0.0,
          alibi=None, p=0.0, noncontig=False, factor=2.0, monkeypatch=None):
    q, k, v = _inputs(B, sq, sk, h, hk, d, dtype, noncontig)
    slopes = None
    if alibi == "h":
        slopes = torch.rand(h) * 0.5
    elif alibi == "bh":
        slopes = torch.rand(B, h) * 0.5
    keep = None
    if p > 0:
        rng = torch.tensor([0x1234_5678_9ABC, 4242], dtype=torch.int64)
        monkeypatch.setattr(attn_op, "_rng_state", lambda dp, dev: rng.clone())
        keep = dropout_keep_mask(rng, p, torch.arange(B), h, sq, sk)
    out, lse, _ = flash_attn(q, k, v, p, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (B, h, sq)
    dout = torch.randn_like(out)
    grads = _grads(out, dout, (q, k, v))
    assert grads[1].shape == k.shape and grads[2].shape == v.shape
    f = dict(causal=causal, window=window, softcap=softcap, alibi=slopes, keep=keep, p=p)
    hi = plain(q, k, v, torch.float64, **f)
    hi_g = _grads(hi, dout.double(), (q, k, v))
    lo = plain(q, k, v, dtype, **f)
    lo_g = _grads(lo, dout, (q, k, v))
    assert_close_tolerance(out, hi.detach(), lo.detach(), factor=factor, name="out")
    _, lse_hi = attention_ref(q.detach().double(), k.detach().double(), v.detach().double(), causal=causal,
                              window_size=window, softcap=softcap, alibi_slopes=slopes)
    _, lse_lo = attention_ref(q.detach().float(), k.detach().float(), v.detach().float(), causal=causal,
                              window_size=window, softcap=softcap, alibi_slopes=slopes)
    assert_close_tolerance(lse, lse_hi, lse_lo, name="lse")
    for name, g, gh, gl in zip("qkv", grads, hi_g, lo_g):
        assert g.dtype == dtype
        assert_close_tolerance(g, gh, gl, factor=factor, name=f"d{name}")
    return out, lse, grads


CASES = {
    "plain": dict(sq=37, sk=29),
    "seqlen1": dict(B=1, sq=1, sk=1),
    "causal_sq<sk": dict(sq=19, sk=45, causal=True),
    "causal_sq>sk": dict(sq=45, sk=19, causal=True),
    "window": dict(sq=33, sk=41, window=(5, 3)),
    "window_left_only": dict(sq=40, sk=21, window=(7, -1), d=24),
    "window_causal": dict(sq=35, sk=35, window=(9, 4), causal=True),
    "softcap": dict(sq=21, sk=27, softcap=2.0, d=24),
    "alibi_h": dict(sq=18, sk=35, alibi="h", causal=True),
    "alibi_bh": dict(sq=27, sk=17, alibi="bh"),
    "gqa": dict(sq=21, sk=33, h=4, hk=2, causal=True),
    "mqa_all": dict(B=1, sq=17, sk=70, h=4, hk=1, window=(20, 6), softcap=3.0, alibi="h"),
    "noncontig": dict(sq=25, sk=31, h=4, hk=2, noncontig=True, causal=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_match_float64(triton_backend, case):
    check(**CASES[case])


def test_dropout_replays_reference_mask(triton_backend, monkeypatch):
    out, _, _ = check(B=2, sq=21, sk=26, h=4, hk=2, causal=True, p=0.3, monkeypatch=monkeypatch)
    # Same rng_state -> same mask -> bitwise the same output from the kernels.
    q, k, v = (torch.randn(2, 21, 4, 16), torch.randn(2, 26, 2, 16), torch.randn(2, 26, 2, 16))
    a, _, _ = flash_attn(q, k, v, 0.3)
    b, _, _ = flash_attn(q, k, v, 0.3)
    assert torch.equal(a, b)
    assert not torch.equal(a, flash_attn(q, k, v, 0.0)[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision(triton_backend, dtype):
    check(B=1, sq=19, sk=37, h=4, hk=2, d=64, dtype=dtype, causal=True, softcap=5.0, factor=3.0)


def test_fully_masked_rows(triton_backend):
    # causal with sq > sk: the first sq - sk rows see no key; a (0, 0) window with sq > sk too.
    out, lse, grads = check(B=1, sq=40, sk=9, causal=True)
    assert torch.isinf(lse[:, :, :31]).all() and (lse[:, :, :31] > 0).all()
    assert torch.equal(out[:, :31], torch.zeros_like(out[:, :31]))
    assert torch.equal(grads[0][:, :31], torch.zeros_like(grads[0][:, :31]))
    assert all(torch.isfinite(g).all() for g in grads)
    check(B=1, sq=20, sk=5, window=(0, 0))


def test_backward_deterministic(triton_backend):
    q, k, v = _inputs(1, 30, 26, 4, 1, 16, torch.float32)
    out, _, _ = flash_attn(q, k, v, causal=True, deterministic=True)
    dout = torch.randn_like(out)
    g1 = _grads(out, dout, (q, k, v))
    g2 = _grads(flash_attn(q, k, v, causal=True, deterministic=True)[0], dout, (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_poisoned_outputs_fully_written(triton_backend, monkeypatch):
    # Outputs allocated by the plans are poisoned: every element must be overwritten.
    real_empty, real_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    q, k, v = _inputs(1, 21, 19, 2, 2, 24, torch.float32)
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
        m.setattr(torch, "empty_like", lambda *a, **kw: poison(real_like(*a, **kw)))
        out, lse, _ = flash_attn(q.detach(), k.detach(), v.detach(), causal=True)
        o2, _, _ = flash_attn(q, k, v, causal=True)
        dout = torch.randn_like(o2)
        grads = _grads(o2, dout, (q, k, v))
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out, o2.detach())
    assert all(not g.isnan().any() for g in grads)


def test_return_probs_uses_reference(triton_backend):
    q, k, v = _inputs(1, 9, 11, 2, 2, 16, torch.float32)
    out, _, probs = flash_attn(q, k, v, causal=True, return_attn_probs=True)
    assert probs.shape == (1, 2, 128, 128)
    ref, _ = attention_ref(q.detach(), k.detach(), v.detach(), causal=True)
    torch.testing.assert_close(out, ref)


def test_cuda_kernels_by_default_with_escape_hatch(monkeypatch):
    cuda, f16 = torch.device("cuda"), torch.float16
    monkeypatch.setattr(tiles, "choose_backend", lambda dev: "triton")
    assert tiles.use_kernels(cuda, f16, 64)
    assert not tiles.use_kernels(cuda, f16, 64, return_probs=True)
    assert tiles.use_kernels(cuda, f16, 512)
    assert not tiles.use_kernels(cuda, torch.float32, 512)  # fp32 tiles: head dim <= 256
    assert not tiles.use_kernels(cuda, torch.float64, 64)  # fp64 runs the reference
    try:
        tiles.set_kernels_on_gpu(False)  # the escape hatch (CULMEN_FLASH_TRITON=0)
        assert not tiles.use_kernels(cuda, f16, 64)
        assert tiles.use_kernels(torch.device("cpu"), f16, 64)  # CULMEN_BACKEND=triton on CPU is not affected
    finally:
        tiles.set_kernels_on_gpu(True)
    monkeypatch.setattr(tiles, "choose_backend", lambda dev: "reference")
    assert not tiles.use_kernels(torch.device("cpu"), f16, 64)


VARLEN_CASES = {
    # (q lengths, k lengths, options): an empty sequence, a length-1 one, lengths crossing blocks.
    "causal_gqa": ([5, 0, 23, 1, 17], [9, 3, 20, 1, 17], dict(h=4, hk=2, causal=True)),
    "window_alibi_softcap": ([18, 7, 33], [11, 30, 33], dict(window=(6, 2), alibi="bh", softcap=3.0)),
    "dropout": ([13, 21], [25, 9], dict(h=2, hk=1, causal=True, p=0.25)),
    "full": ([31, 2, 19], [19, 40, 1], dict()),
}


@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_varlen_kernels_match_float64(triton_backend, monkeypatch, case):
    lq, lk, o = VARLEN_CASES[case]
    h, hk, d = o.get("h", 2), o.get("hk", 2), 24
    cu_q = torch.tensor([0, *lq], dtype=torch.int32).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lk], dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lq), h, d, requires_grad=True)
    k = torch.randn(sum(lk), hk, d, requires_grad=True)
    v = torch.randn(sum(lk), hk, d, requires_grad=True)
    slopes = torch.rand(len(lq), h) * 0.5 if o.get("alibi") else None
    p = o.get("p", 0.0)
    if p:
        rng = torch.tensor([0x2468_ACE0, 77], dtype=torch.int64)
        monkeypatch.setattr(attn_op, "_rng_state", lambda dp, dev: rng.clone())
    kw = dict(dropout_p=p, causal=o.get("causal", False), window_size=o.get("window", (-1, -1)),
              softcap=o.get("softcap", 0.0), alibi_slopes=slopes)
    args = (cu_q, cu_k, max(lq), max(lk))

    def run(dt):
        ts = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        out, lse, _ = flash_attn_varlen(*ts, *args, **kw)
        out.backward(dout.to(dt))
        return out, lse, [t.grad for t in ts]

    dout = torch.randn(q.shape)
    out, lse, grads = run(torch.float32)  # the kernels
    assert lse.shape == (h, sum(lq)) and lse.dtype == torch.float32
    set_backend("reference")
    hi = run(torch.float64)
    lo = run(torch.float32)
    assert_close_tolerance(out, hi[0], lo[0], name="out")
    assert_close_tolerance(lse, hi[1], lo[1], name="lse")
    for name, g, gh, gl in zip("qkv", grads, hi[2], lo[2]):
        assert_close_tolerance(g, gh, gl, name=f"d{name}")
    if 0 in lq:  # an empty sequence's neighbours are untouched; rows of no sequence stay finite
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)


def test_tma_descriptor_forward(triton_backend, monkeypatch):
    # The optional TMA path of the forward (off by default) reads K/V through tensor descriptors.
    monkeypatch.setitem(launch.TUNING, "tma", True)
    check(B=1, sq=37, sk=45, h=2, hk=1, d=16, causal=True)
    check(B=2, sq=29, sk=23, h=2, hk=2, d=24, window=(6, 3))


def test_set_deterministic_turns_off_atomic_dq(triton_backend, monkeypatch):
    """With TUNING["atomic_dq"] the dK/dV kernel also sums dQ (no dQ kernel); culmen.set_deterministic
    (checked per backward, not per plan) brings the reproducible dQ kernel back. Same gradients both ways."""
    import culmen
    from culmen.ops.common.launch import Launch

    monkeypatch.setitem(launch.TUNING, "atomic_dq", True)
    seen = []
    real = Launch.__call__

    def spy(self, stream, aligned, *args):
        seen.append(self.fn.__name__)
        return real(self, stream, aligned, *args)

    monkeypatch.setattr(Launch, "__call__", spy)
    q, k, v = (torch.randn(1, 20, 2, 16, requires_grad=True) for _ in range(3))
    g_atomic = _grads(flash_attn(q, k, v, causal=True)[0], torch.ones(1, 20, 2, 16), (q, k, v))
    assert "_attn_bwd_dkdv_kernel" in seen and "_attn_bwd_dq_kernel" not in seen
    seen.clear()
    culmen.set_deterministic(True)
    try:
        for t in (q, k, v):
            t.grad = None
        out = flash_attn(q, k, v, causal=True)[0]
        out.sum().backward()  # an expanded (all stride 0) gradient: copied for the kernels
    finally:
        culmen.set_deterministic(False)
    assert "_attn_bwd_dq_kernel" in seen
    for a, b in zip(g_atomic, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(a, b)


def test_bad_index_values_checked_on_cpu_and_clamped_by_kernels(triton_backend):
    """cu_seqlens / cache_seqlens are value-checked on CPU tensors (on GPUs under set_check_values); with the
    check off the kernels clamp every offset they read, so even absurd values stay inside the tensors (under
    the interpreter an access outside them crashes the process)."""
    from culmen.flash_attn import flash_attn_with_kvcache
    from culmen.ops.attention import kvcache, op

    q, k, v = (torch.randn(40, 2, 16, requires_grad=True) for _ in range(3))
    good = torch.tensor([0, 15, 40], dtype=torch.int32)
    flash_attn_varlen(q, k, v, good, good, 25, 25, causal=True)
    (plan,) = op.PLANS.values()
    for bad in ([0, 100, 5000], [-50, 10, 7], [0, 30, 2**31 - 1]):
        cu = torch.tensor(bad, dtype=torch.int32)
        with pytest.raises(ValueError, match="cu_seqlens_q"):
            flash_attn_varlen(q, k, v, cu, good, 25, 25, causal=True)
        plan.check_values = False
        try:
            out, lse, _ = flash_attn_varlen(q, k, v, cu, cu, 25, 25, causal=True)
            out.sum().backward()
        finally:
            plan.check_values = True
    qd, kc = torch.randn(2, 3, 2, 16), torch.randn(2, 30, 2, 16)
    flash_attn_with_kvcache(qd, kc, kc, cache_seqlens=torch.tensor([5, 30], dtype=torch.int32), causal=True)
    (kplan,) = kvcache.PLANS.values()
    bad_lens = torch.tensor([-7, 10**9], dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(qd, kc, kc, cache_seqlens=bad_lens, causal=True)
    kplan.check_values = False
    try:
        out = flash_attn_with_kvcache(qd, kc, kc, cache_seqlens=bad_lens, causal=True)
    finally:
        kplan.check_values = True
    assert torch.isfinite(out).all()
