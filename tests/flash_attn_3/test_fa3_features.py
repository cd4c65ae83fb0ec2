"""FA3's features in ``culmen.flash_attn_3``: a V head dim other than the QK head dim (forward and backward,
dense, varlen, ``seqused_k``, KV cache), chunked-local ``attention_chunk`` (forward and backward, which FA3
lacks), and the FP8 forward (float8_e4m3fn with per-(batch, kv head) descales, bf16 out), each against
float64 attention written out here; the FP8 error is measured against bf16 attention on the same inputs."""

from __future__ import annotations

import pytest
import torch

import culmen.flash_attn_3 as fa3
from culmen.testing import assert_close_tolerance

F8 = torch.float8_e4m3fn
F8_MAX = 448.0


def _mask(sq: int, sk: int, causal: bool, window, chunk: int, device=None) -> torch.Tensor:
    """bool ``(sq, sk)``: query ``i`` (key position ``i + sk - sq``) sees key ``j``."""
    i = torch.arange(sq, device=device).view(sq, 1)
    j = torch.arange(sk, device=device).view(1, sk)
    pos = i + sk - sq
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    right = 0 if causal else window[1]
    if right >= 0:
        ok &= j <= pos + right
    if window[0] >= 0:
        ok &= j >= pos - window[0]
    if chunk:
        ok &= torch.div(j, chunk, rounding_mode="floor") == torch.div(pos, chunk, rounding_mode="floor")
    return ok


def oracle(q, k, v, dtype, causal=False, window=(-1, -1), chunk=0, softcap=0.0):
    """Attention in ``dtype`` of ``q (B, sq, h, d)``, ``k (B, sk, hk, d)``, ``v (B, sk, hk, dv)``; rows that see no
    key give 0. Returns ``(out (B, sq, h, dv), lse (B, h, sq), +inf on empty rows)``."""
    B, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qq, kk, vv = q.to(dtype), k.to(dtype).repeat_interleave(h // hk, 2), v.to(dtype).repeat_interleave(h // hk, 2)
    s = torch.einsum("bihd,bjhd->bhij", qq, kk) * d ** -0.5
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    ok = _mask(sq, sk, causal, window, chunk, q.device)
    seen = ok.any(-1).view(1, 1, sq, 1)
    s = s.masked_fill(~ok, float("-inf")).masked_fill(~seen, 0.0)
    a = torch.softmax(s, -1) * seen
    lse = torch.where(seen[..., 0], torch.logsumexp(s, -1), torch.full((), float("inf"), dtype=s.dtype))
    return torch.einsum("bhij,bjhd->bihd", a, vv), lse


def _grads_check(out, want, lo, leaves, leaves64, leaves_lo):
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dout)
    ref = torch.autograd.grad(want, leaves64, dout.double())
    low = torch.autograd.grad(lo, leaves_lo, dout)
    for name, g, r, lw in zip(("dq", "dk", "dv"), got, ref, low):
        assert g.shape == r.shape, name
        assert_close_tolerance(g, r, lw, factor=3.0, name=name)


# ------------------------------------------------------------------------- dense: V head dim, chunk

DENSE = {
    "dv16_gqa_causal": dict(sq=37, sk=53, h=4, hk=2, d=24, dv=16, causal=True),
    "dv40_mqa": dict(sq=21, sk=33, h=2, hk=1, d=16, dv=40),
    "chunk8_causal": dict(sq=40, sk=40, h=2, hk=2, d=16, dv=16, causal=True, chunk=8),
    "chunk7_window_dv_softcap": dict(sq=33, sk=45, h=2, hk=1, d=32, dv=16, window=(5, 3), chunk=7, softcap=6.0),
    "chunk6_longer_q": dict(sq=29, sk=17, h=2, hk=2, d=16, dv=24, chunk=6),
}


@pytest.mark.parametrize("backend", ["reference_backend", "triton_backend"])
@pytest.mark.parametrize("case", list(DENSE))
def test_dense_v_headdim_and_chunk_match_float64(request, backend, case):
    request.getfixturevalue(backend)
    c = DENSE[case]
    kw = dict(causal=c.get("causal", False), window=c.get("window", (-1, -1)), chunk=c.get("chunk", 0),
              softcap=c.get("softcap", 0.0))
    q = torch.randn(2, c["sq"], c["h"], c["d"], dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, c["sk"], c["hk"], c["d"], dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, c["sk"], c["hk"], c["dv"], dtype=torch.bfloat16, requires_grad=True)
    out, lse = fa3.flash_attn_func(q, k, v, causal=kw["causal"], window_size=kw["window"],
                                   attention_chunk=kw["chunk"], softcap=kw["softcap"], return_attn_probs=True)
    assert out.shape == (2, c["sq"], c["h"], c["dv"]) and out.dtype == torch.bfloat16
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want, lse64 = oracle(q64, k64, v64, torch.float64, **kw)
    lo, _ = oracle(q, k, v, torch.bfloat16, **kw)
    assert_close_tolerance(out, want, lo, name="out")
    assert_close_tolerance(lse, lse64.detach(), None, atol=2e-4, name="lse")
    _grads_check(out, want, lo, (q, k, v), (q64, k64, v64), (q, k, v))


def test_chunk_changes_the_result_and_chunk_ge_seqlen_is_plain():
    """A chunk that covers every key is no chunk; a small one changes the answer (the mask is applied)."""
    q, k, v = (torch.randn(1, 24, 2, 16) for _ in range(3))
    base = fa3.flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(fa3.flash_attn_func(q, k, v, causal=True, attention_chunk=64), base)
    assert not torch.allclose(fa3.flash_attn_func(q, k, v, causal=True, attention_chunk=4), base, atol=1e-3)


# ------------------------------------------------------------------------------------------ varlen


@pytest.mark.parametrize("backend", ["reference_backend", "triton_backend"])
def test_varlen_v_headdim_chunk_per_sequence(request, backend):
    request.getfixturevalue(backend)
    lens_q, lens_k = [7, 19, 1], [13, 19, 9]
    h, hk, d, dv, chunk = 4, 2, 16, 24, 5
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lens_q), h, d, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lens_k), hk, d, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(sum(lens_k), hk, dv, dtype=torch.bfloat16, requires_grad=True)
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                          attention_chunk=chunk, return_attn_probs=True)
    assert out.shape == (sum(lens_q), h, dv) and lse.shape == (h, sum(lens_q))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    wants, los, lses = [], [], []
    for b in range(3):
        sq_, sk_ = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        w, ls = oracle(q64[None, sq_], k64[None, sk_], v64[None, sk_], torch.float64, causal=True, chunk=chunk)
        lo, _ = oracle(q[None, sq_], k[None, sk_], v[None, sk_], torch.bfloat16, causal=True, chunk=chunk)
        wants.append(w[0])
        los.append(lo[0])
        lses.append(ls[0])
    want, lo = torch.cat(wants), torch.cat(los)
    assert_close_tolerance(out, want, lo, name="out")
    assert_close_tolerance(lse, torch.cat(lses, -1).detach(), None, atol=2e-4, name="lse")
    _grads_check(out, want, lo, (q, k, v), (q64, k64, v64), (q, k, v))


def test_seqused_k_with_v_headdim_and_chunk():
    """Padded sides with ``seqused_k``: each sequence attends to its used keys only, chunks counted from 0."""
    B, sq, sk, h, d, dv, chunk = 2, 5, 12, 2, 16, 8, 4
    q, k = torch.randn(B, sq, h, d), torch.randn(B, sk, h, d)
    v = torch.randn(B, sk, h, dv)
    used = torch.tensor([12, 7], dtype=torch.int32)
    out = fa3.flash_attn_varlen_func(q, k, v, None, None, None, None, seqused_k=used, causal=True,
                                     attention_chunk=chunk)
    assert out.shape == (B, sq, h, dv)
    for b in range(B):
        n = int(used[b])
        want, _ = oracle(q[b:b + 1].double(), k[b:b + 1, :n].double(), v[b:b + 1, :n].double(), torch.float64,
                         causal=True, chunk=chunk)
        torch.testing.assert_close(out[b:b + 1].double(), want, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------- kv cache


@pytest.mark.parametrize("backend", ["reference_backend", "triton_backend"])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_v_headdim_chunk_appends_and_attends(request, backend, paged):
    request.getfixturevalue(backend)
    B, S, h, hk, d, dv, s_new, chunk = 2, 24, 4, 2, 16, 8, 3, 5
    lens = torch.tensor([9, 17], dtype=torch.int32)
    q = torch.randn(B, 2, h, d)
    kn, vn = torch.randn(B, s_new, hk, d), torch.randn(B, s_new, hk, dv)
    k_full, v_full = torch.randn(B, S, hk, d), torch.randn(B, S, hk, dv)
    if paged:
        page = 6
        perm = torch.randperm(B * S // page)
        table = perm.view(B, S // page).to(torch.int32)
        k_cache = torch.empty(B * S // page, page, hk, d)
        v_cache = torch.empty(B * S // page, page, hk, dv)
        k_cache[perm] = k_full.view(B, S // page, page, hk, d).reshape(-1, page, hk, d)
        v_cache[perm] = v_full.view(B, S // page, page, hk, dv).reshape(-1, page, hk, dv)
        kw = dict(page_table=table)
    else:
        k_cache, v_cache, kw = k_full.clone(), v_full.clone(), {}
    out = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens=lens, causal=True,
                                      attention_chunk=chunk, **kw)
    assert out.shape == (B, 2, h, dv)
    for b in range(B):
        n = int(lens[b])
        kk = torch.cat([k_full[b, :n], kn[b]])[None]
        vv = torch.cat([v_full[b, :n], vn[b]])[None]
        want, _ = oracle(q[b:b + 1].double(), kk.double(), vv.double(), torch.float64, causal=True, chunk=chunk)
        torch.testing.assert_close(out[b:b + 1].double(), want, atol=2e-5, rtol=1e-4)
    # the new v rows (their own head dim) landed in the cache
    vc = v_cache[table.long()].reshape(B, S, hk, dv) if paged else v_cache
    for b in range(B):
        n = int(lens[b])
        assert torch.equal(vc[b, n:n + s_new], vn[b])


# --------------------------------------------------------------------------------------------- FP8


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(batch, kv head) scaled float8_e4m3fn of ``x (B, s, hk, d)`` and its fp32 descale ``(B, hk)``."""
    amax = x.float().abs().amax(dim=(1, 3)).clamp(min=1e-6)
    descale = amax / F8_MAX
    return (x.float() / descale[:, None, :, None]).to(F8), descale


def _fp8_case(B, sq, sk, h, hk, d, dv, device=None, spread=True):
    q, k, v = (torch.randn(B, s, n, dd, device=device, dtype=torch.bfloat16)
               for s, n, dd in ((sq, h, d), (sk, hk, d), (sk, hk, dv)))
    if spread:  # different magnitudes per (batch, kv head), so a wrong descale index shows
        scale = torch.rand(B, 1, hk, 1, device=device) * 3 + 0.25
        k, v = (k.float() * scale).to(torch.bfloat16), (v.float() * scale).to(torch.bfloat16)
    # q's descale is per (batch, kv head) as FA3 takes it: its query heads share one
    qg = q.view(B, sq, hk, (h // hk) * d)
    q8, qd = _quantize(qg)
    k8, kd = _quantize(k)
    v8, vd = _quantize(v)
    return (q, k, v), (q8.view(B, sq, h, d), k8, v8), (qd, kd, vd)


@pytest.mark.parametrize("backend", ["reference_backend", "triton_backend"])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_forward_error_vs_bf16(request, backend, causal):
    """FP8 forward: bf16 out; against float64 attention of the dequantized inputs it errs by P's and
    the output's rounding only; against the original bf16 inputs its error (quantization included) is
    reported beside bf16 attention's and bounded: relative RMS <= 8% (about 5.5% measured, nearly all from
    quantizing q/k/v; bf16 attention: 0.2-0.4%), max <= 25% of max |out|."""
    request.getfixturevalue(backend)
    torch.manual_seed(1)
    (q, k, v), (q8, k8, v8), (qd, kd, vd) = _fp8_case(2, 19, 37, 4, 2, 32, 16)
    out = fa3.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 19, 4, 16)
    # float64 attention of exactly what the kernel was given (dequantized)
    g = 2
    qdq = q8.double() * qd.double().repeat_interleave(g, 1)[:, None, :, None]
    kdq, vdq = k8.double() * kd.double()[:, None, :, None], v8.double() * vd.double()[:, None, :, None]
    deq, _ = oracle(qdq, kdq, vdq, torch.float64, causal=causal)
    err_deq = (out.double() - deq).abs().max().item()
    assert err_deq <= 0.08 * deq.abs().max().item(), err_deq
    # against the original bf16 inputs, beside bf16 attention
    want, _ = oracle(q.double(), k.double(), v.double(), torch.float64, causal=causal)
    bf16 = fa3.flash_attn_func(q, k, v, causal=causal)
    rms = (want ** 2).mean().sqrt().item()
    err8 = ((out.double() - want) ** 2).mean().sqrt().item() / rms
    err16 = ((bf16.double() - want) ** 2).mean().sqrt().item() / rms
    print(f"fp8 relative RMS error {err8:.4f} vs bf16 {err16:.4f}")
    assert err8 <= 0.08, (err8, err16)
    assert (out.double() - want).abs().max().item() <= 0.25 * want.abs().max().item()
    assert err16 < err8  # fp8 is the coarser one: the test would notice a bf16 path posing as fp8


def test_fp8_descales_are_per_batch_and_kv_head():
    """Descales of 1 vs the true ones differ (they are used), and each (batch, kv head) reads its own."""
    (q, k, v), (q8, k8, v8), (qd, kd, vd) = _fp8_case(2, 6, 9, 4, 2, 16, 16)
    out = fa3.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    vd2 = vd.clone()
    vd2[1, 0] *= 2.0  # doubles batch 1's output for the query heads of kv head 0 (heads 0 and 1) only
    out2 = fa3.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd2)
    torch.testing.assert_close(out2[1, :, :2].float(), 2 * out[1, :, :2].float(), rtol=1e-2, atol=1e-3)
    assert torch.equal(out2[0], out[0]) and torch.equal(out2[1, :, 2:], out[1, :, 2:])
    none = fa3.flash_attn_func(q8, k8, v8)  # no descales: they are 1
    assert none.dtype == torch.bfloat16 and not torch.allclose(none.float(), out.float(), atol=1e-2)


def test_fp8_varlen_and_kvcache():
    (q, k, v), (q8, k8, v8), (qd, kd, vd) = _fp8_case(2, 4, 10, 2, 1, 16, 16)
    dense = fa3.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    cu_q = torch.tensor([0, 4, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 10, 20], dtype=torch.int32)
    var = fa3.flash_attn_varlen_func(q8.reshape(8, 2, 16), k8.reshape(20, 1, 16), v8.reshape(20, 1, 16), cu_q,
                                     cu_k, 4, 10, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    torch.testing.assert_close(var.float(), dense.reshape(8, 2, 16).float(), atol=1e-2, rtol=1e-2)
    kc, vc = k8.clone(), v8.clone()
    dec = fa3.flash_attn_with_kvcache(q8, kc, vc, cache_seqlens=10, causal=True, q_descale=qd, k_descale=kd,
                                      v_descale=vd)
    torch.testing.assert_close(dec.float(), dense.float(), atol=1e-2, rtol=1e-2)


def test_fp8_and_feature_argument_errors():
    q, k, v = (torch.randn(1, 4, 2, 16) for _ in range(3))
    with pytest.raises(ValueError, match="float8"):
        fa3.flash_attn_func(q, k, v, q_descale=torch.ones(1, 2))
    with pytest.raises(ValueError, match="attention_chunk"):
        fa3.flash_attn_func(q, k, v, attention_chunk=-3)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        e5 = torch.float8_e5m2
        fa3.flash_attn_func(q.to(e5), k.to(e5), v.to(e5))
    with pytest.raises(ValueError, match="q_descale"):
        fa3.flash_attn_func(q.to(F8), k.to(F8), v.to(F8), q_descale=torch.ones(3, 5))
    with pytest.raises(ValueError, match="k head dim"):
        fa3.flash_attn_func(q, k[..., :8], v)
    cs = torch.ones(8, 4)
    with pytest.raises(ValueError, match="float8"):
        fa3.flash_attn_with_kvcache(q.to(F8), k.to(F8), v.to(F8), cache_seqlens=4, rotary_cos=cs, rotary_sin=cs)
    meta = fa3.get_scheduler_metadata(1, 1, 4, 2, 2, 16, torch.tensor([4], dtype=torch.int32), headdim_v=8,
                                      attention_chunk=3, qkv_dtype=F8)
    assert meta.dtype == torch.int32


def test_default_plans_leave_the_new_switches_off():
    """flash_attn 2's calls (and FA3's without the features) build kernels with every new constexpr at its
    off value, so their generated code is the one they had before these features (checked on sm_90 by
    compiling both versions; see the commit message)."""
    from culmen.ops.attention.launch import AttnPlan

    q = torch.randn(1, 4, 2, 16)
    plan = AttnPlan("dense", q, q, q, None)
    if plan.use_kernel:
        assert plan.flags["DV"] == 0 and plan.flags["CHUNK"] == 0 and plan.fwd_launch(True).meta["DESCALE"] is False
        assert plan.flags["BLOCK_DV"] == plan.block_d and plan.flags["EVEN_DV"] == plan.flags["EVEN_D"]
    assert plan.chunk == 0 and not plan.split_v and not plan.fp8 and not plan.descale


# --------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen,causal,chunk", [(1024, True, 0), (4096, False, 0), (2048, True, 512)])
def test_gpu_deepseek_192_128(seqlen, causal, chunk):
    """bf16, QK head dim 192, V head dim 128, at real lengths: forward and gradients against fp32
    attention, within 2x (3x for gradients) of bf16 attention's own error."""
    torch.manual_seed(0)
    B, h = 1, 8
    q = torch.randn(B, seqlen, h, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, seqlen, h, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, seqlen, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = fa3.flash_attn_func(q, k, v, causal=causal, attention_chunk=chunk)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    want, _ = oracle(q32, k32, v32, torch.float32, causal=causal, chunk=chunk)
    lo, _ = oracle(q, k, v, torch.bfloat16, causal=causal, chunk=chunk)
    assert_close_tolerance(out, want, lo, name="out")
    _grads_check(out, want, lo, (q, k, v), (q32, k32, v32), (q, k, v))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_fp8_forward_error_budget(causal, d):
    """FP8 (fp8 tensor-core products) at s 2k and each head dim's own tile (d 64 and 128 read K and V through
    TMA, d 256's 2-stage tile through pointers): relative RMS error vs fp32 attention of the original bf16
    inputs <= 10% (bf16 attention's is printed beside it), and within 8% of max |out| against the
    dequantized inputs."""
    torch.manual_seed(0)
    (q, k, v), (q8, k8, v8), (qd, kd, vd) = _fp8_case(2, 2048, 2048, 8, 2, d, d, device="cuda")
    out = fa3.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    want, _ = oracle(q.float(), k.float(), v.float(), torch.float32, causal=causal)
    bf16 = fa3.flash_attn_func(q, k, v, causal=causal)
    rms = (want ** 2).mean().sqrt().item()
    err8 = ((out.float() - want) ** 2).mean().sqrt().item() / rms
    err16 = ((bf16.float() - want) ** 2).mean().sqrt().item() / rms
    print(f"GPU fp8 d{d} relative RMS error {err8:.4f} vs bf16 {err16:.4f} (causal={causal})")
    assert err8 <= 0.10
    g = 4
    qdq = q8.float() * qd.repeat_interleave(g, 1)[:, None, :, None]
    deq, _ = oracle(qdq, k8.float() * kd[:, None, :, None], v8.float() * vd[:, None, :, None], torch.float32,
                    causal=causal)
    assert (out.float() - deq).abs().max().item() <= 0.08 * deq.abs().max().item()


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_transposed_v_matches_v_as_given(triton_backend, monkeypatch, causal):
    """The FP8 forward's transposed copy of V (``TUNING["fp8_v_t"]``) changes the layout only: the same bf16
    output as reading V as given, dense (V non-contiguous, odd lengths) and varlen."""
    from culmen.ops.attention import launch

    torch.manual_seed(3)
    (_, _, _), (q8, k8, v8), (qd, kd, vd) = _fp8_case(2, 21, 37, 4, 2, 32, 16)
    v_nc = torch.empty(2, 37, 2, 40, dtype=F8)[..., 3:19]  # a head-dim view: strided rows
    v_nc.copy_(v8)
    cu_q = torch.tensor([0, 21, 42], dtype=torch.int32)
    cu_k = torch.tensor([0, 37, 74], dtype=torch.int32)

    def run():
        dense = fa3.flash_attn_func(q8, k8, v_nc, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
        var = fa3.flash_attn_varlen_func(q8.reshape(42, 4, 32), k8.reshape(74, 2, 32), v8.reshape(74, 2, 16),
                                         cu_q, cu_k, 21, 37, causal=causal, q_descale=qd, k_descale=kd,
                                         v_descale=vd)
        return dense, var

    monkeypatch.setitem(launch.TUNING, "fp8_v_t", True)
    dense_t, var_t = run()
    monkeypatch.setitem(launch.TUNING, "fp8_v_t", False)
    dense, var = run()
    assert torch.equal(dense_t, dense) and torch.equal(var_t, var)
    torch.testing.assert_close(var.float(), dense.reshape(42, 4, 16).float(), atol=1e-2, rtol=1e-2)
    assert dense.abs().max() > 0.1


@pytest.mark.parametrize("d", [16, 64, 24])
def test_transposed_v_copy_is_the_permuted_tensor(triton_backend, d):
    """The FP8 forward's K-major V (``(B, hk, d, S)`` / ``(hk, d, T)``), made by the transpose kernel for
    power-of-two head dims (d 24: the torch copy), equals the permuted tensor bit for bit: odd lengths, a
    strided view, varlen."""
    from culmen.ops.attention.launch import _transposed_v

    torch.manual_seed(d)
    base = (torch.randn(3, 97, 2, d + 8) * 50).to(F8)
    v = base[..., 5:5 + d]  # rows d + 8 apart
    out = _transposed_v(v, varlen=False)
    assert out.shape == (3, 2, d, 97) and out.is_contiguous()
    assert torch.equal(out.view(torch.uint8), v.permute(0, 2, 3, 1).view(torch.uint8))
    flat = v.reshape(291, 2, d)
    out = _transposed_v(flat, varlen=True)
    assert out.shape == (2, d, 291)
    assert torch.equal(out.view(torch.uint8), flat.permute(1, 2, 0).view(torch.uint8))


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_tma_and_rotated_loop_match_pointer_loads(triton_backend, monkeypatch, causal):
    """FP8 with 16-byte aligned rows takes K and the transposed V through TMA descriptors and the rotated key
    loop (``TUNING["fp8_tma"]``, ``["fp8_overlap"]``): the launch really is the TMA one, and its output is
    bit-identical to pointer loads in the plain loop, over several key blocks with a ragged last one."""
    from culmen.ops.attention import launch

    taken = []
    fwd_launch = launch.AttnPlan.fwd_launch

    def spy(self, store_lse, tma=False):
        taken.append(tma)
        return fwd_launch(self, store_lse, tma)

    monkeypatch.setattr(launch.AttnPlan, "fwd_launch", spy)
    torch.manual_seed(5)
    (_, _, _), (q8, k8, v8), (qd, kd, vd) = _fp8_case(2, 48, 208, 4, 2, 32, 32)

    def run():
        return fa3.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)

    monkeypatch.setitem(launch.TUNING, "fp8_tma", True)
    monkeypatch.setitem(launch.TUNING, "fp8_overlap", True)
    fast = run()
    assert taken and all(taken)
    taken.clear()
    monkeypatch.setitem(launch.TUNING, "fp8_tma", False)
    plain = run()
    assert taken and not any(taken)
    assert torch.equal(fast, plain) and fast.abs().max() > 0.1
