"""flash_attn's internals as other libraries use them: ``_flash_attn_forward`` / ``_flash_attn_backward`` and
their varlen forms (flash_attn 2.8 signatures and return tuples), the ``FlashAttn*Func`` autograd classes,
``flash_attn_gpu`` (the extension's entry points), ``USE_TRITON_ROCM``, and ``rotary_kernel``.

Values and gradients are checked against a float64 attention written here (plain PyTorch), on the
reference path and on the Triton kernels (the CPU interpreter, fp32); a ring-attention step (KV chunks
run separately, combined through their log-sum-exp, each chunk's backward given the combined output and
log-sum-exp) must equal full attention.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import culmen.flash_attn as fa
from culmen.flash_attn import flash_attn_interface as fi
from culmen.ops.attention import dropout_keep_mask

F32, F64 = torch.float32, torch.float64
INF = float("inf")


# ----------------------------------------------------------------------------------- the reference


def ref_attention(q, k, v, scale=None, causal=False, window=(-1, -1), softcap=0.0, keep=None, p=0.0):
    """float64 attention ``(out (B, sq, h, d), lse (B, h, sq))``: bottom-right aligned causal / window
    masks, softcap, GQA (K/V heads repeated), and an optional dropout keep-mask ``(B, h, sq, sk)``."""
    sq, sk, g = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kk, vv = k.double().repeat_interleave(g, 2), v.double().repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    rel = torch.arange(sk)[None, :] - (torch.arange(sq)[:, None] + sk - sq)
    left, right = window[0], 0 if causal else window[1]
    mask = torch.zeros(sq, sk, dtype=torch.bool)
    if left >= 0:
        mask |= rel < -left
    if right >= 0:
        mask |= rel > right
    s = s.masked_fill(mask, -INF)
    lse = torch.logsumexp(s, -1)
    pr = torch.exp(s - lse[..., None])
    if keep is not None:
        pr = torch.where(keep, pr, 0.0) / (1 - p)
    return torch.einsum("bhqk,bkhd->bqhd", pr, vv), lse


def _inputs(B=2, sq=7, sk=11, h=4, hk=2, d=16, dtype=F64, grad=True):
    return tuple(torch.randn(B, s, n, d, dtype=dtype, requires_grad=grad) for s, n in ((sq, h), (sk, hk), (sk, hk)))


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


def _ref_grads(ref, inputs, dout):
    """Gradients of the float64 reference, in float64 (the inputs may be fp32)."""
    return tuple(g.double() for g in torch.autograd.grad(ref, inputs, dout.double()))


@pytest.fixture(params=["reference", "triton"])
def path(request):
    """Run on the PyTorch reference (fp64) and on the Triton kernels (the interpreter, fp32)."""
    from culmen.ops.backend import use_backend

    with use_backend(request.param):
        yield (F64 if request.param == "reference" else F32), (1e-10 if request.param == "reference" else 2e-5)


# --------------------------------------------------------------------------------------- signatures

FWD = ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap",
       "alibi_slopes", "return_softmax"]
VARLEN_FWD = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
              "softmax_scale", "causal", ("window_size_left", -1), ("window_size_right", -1), ("softcap", 0.0),
              ("alibi_slopes", None), ("return_softmax", False), ("block_table", None), ("leftpad_k", None),
              ("seqused_k", None), ("zero_tensors", False)]
BWD = ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "dropout_p", "softmax_scale", "causal",
       "window_size_left", "window_size_right", "softcap", "alibi_slopes", "deterministic", ("rng_state", None)]
VARLEN_BWD = ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k",
              "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal", "window_size_left",
              "window_size_right", "softcap", "alibi_slopes", "deterministic", ("rng_state", None),
              ("zero_tensors", False)]
TAIL = ["dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
        "return_softmax"]
CLASSES = {
    "FlashAttnQKVPackedFunc": ["qkv", *TAIL, "is_grad_enabled"],
    "FlashAttnKVPackedFunc": ["q", "kv", *TAIL, "is_grad_enabled"],
    "FlashAttnFunc": ["q", "k", "v", *TAIL, "is_grad_enabled"],
    "FlashAttnVarlenQKVPackedFunc": ["qkv", "cu_seqlens", "max_seqlen", *TAIL, "is_grad_enabled"],
    "FlashAttnVarlenKVPackedFunc": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", *TAIL,
                                    "is_grad_enabled"],
    "FlashAttnVarlenFunc": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", *TAIL,
                            "block_table", "is_grad_enabled"],
}


@pytest.mark.parametrize("name,want", [("_flash_attn_forward", FWD), ("_flash_attn_varlen_forward", VARLEN_FWD),
                                       ("_flash_attn_backward", BWD), ("_flash_attn_varlen_backward", VARLEN_BWD)])
def test_internal_signatures_are_flash_attn_28(name, want):
    params = list(inspect.signature(getattr(fi, name)).parameters.values())
    assert [p.name for p in params] == [w if isinstance(w, str) else w[0] for w in want]
    for p, w in zip(params, want):
        assert p.default == (inspect.Parameter.empty if isinstance(w, str) else w[1]), p.name
    wrapped = getattr(fi, "_wrapped" + name)  # the torch.library op behind it, as flash_attn's _wrapped_*
    schema = wrapped.default._schema
    assert [a.name for a in schema.arguments] == [p.name for p in params]


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_autograd_classes_take_flash_attn_positional_arguments(name):
    cls = getattr(fi, name)
    assert isinstance(cls, type) and issubclass(cls, torch.autograd.Function)
    assert list(inspect.signature(cls.forward).parameters)[1:] == CLASSES[name]
    assert getattr(fa.flash_attn_interface, name) is cls


def test_module_level_names():
    assert fi.USE_TRITON_ROCM is False
    for entry in ("fwd", "bwd", "varlen_fwd", "varlen_bwd", "fwd_kvcache"):
        assert callable(getattr(fi.flash_attn_gpu, entry))
    assert fi.round_multiple(130, 128) == 256 and fi.maybe_contiguous(None) is None
    x = torch.randn(4, 3).t()
    assert fi.maybe_contiguous(x).stride(-1) == 1 and fi.maybe_contiguous(x.t()) is not None
    # flash_attn >= 2.7's op decorators: the real ones on the torch versions culmen supports, and the no-op
    # stand-ins for older torch, usable as decorators (with or without the function) like the real ones
    assert fi._torch_custom_op_wrapper is torch.library.custom_op
    assert fi._torch_register_fake_wrapper is torch.library.register_fake

    def f(t):
        return t + 1

    assert fi.noop_custom_op_wrapper("lib::f", mutates_args=())(f) is f
    assert fi.noop_custom_op_wrapper("lib::f", f, mutates_args=(), device_types="cuda") is f
    assert fi.noop_register_fake_wrapper("lib::f")(f) is f and fi.noop_register_fake_wrapper("lib::f", f) is f
    with pytest.raises(TypeError):  # mutates_args is required, as in flash_attn
        fi.noop_custom_op_wrapper("lib::f", f)


# ------------------------------------------------------------------------------ forward / backward


CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window=(3, 1)),
    "softcap_causal": dict(softcap=2.0, causal=True, scale=0.3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_backward_pair_reproduces_autograd(path, case):
    dtype, tol = path
    c = CASES[case]
    q, k, v = _inputs(dtype=dtype)
    left, right = c.get("window", (-1, -1))
    out, lse, S, rng = fi._flash_attn_forward(q, k, v, 0.0, c.get("scale"), c.get("causal", False), left, right,
                                              c.get("softcap", 0.0), None, False)
    ref, ref_lse = ref_attention(q, k, v, c.get("scale"), c.get("causal", False), (left, right), c.get("softcap", 0.0))
    assert out.dtype == dtype and lse.dtype == (F64 if dtype == F64 else F32) and lse.shape == (2, 4, 7)
    assert S.numel() == 0 and rng.dtype == torch.int64 and rng.shape == (2,)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=tol, atol=tol)

    dout = torch.randn_like(out)
    bufs = [torch.full_like(t, float("nan")) for t in (q, k, v)]  # poisoned: every element must be written
    scale = c.get("scale") or 16 ** -0.5
    softmax_d = fi._flash_attn_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, *bufs, 0.0, scale,
                                        c.get("causal", False), left, right, c.get("softcap", 0.0), None, False, rng)
    for got, want, name in zip(bufs, _ref_grads(ref, (q, k, v), dout), "qkv"):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=10 * tol, msg=lambda m, n=name: f"d{n}: {m}")
    assert softmax_d.shape == (2, 4, 128) and softmax_d.dtype == F32
    delta = (dout.double() * out.double()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(softmax_d[:, :, :7].double(), delta, rtol=1e-5, atol=1e-5)
    assert (softmax_d[:, :, 7:] == 0).all()


def _varlen(lens_q=(3, 1, 6), lens_k=(5, 4, 6), h=4, hk=2, d=16, dtype=F64):
    cu_q = torch.tensor([0, *lens_q]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lens_k]).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), h, d, dtype=dtype, requires_grad=True)
    k = torch.randn(int(cu_k[-1]), hk, d, dtype=dtype, requires_grad=True)
    v = torch.randn(int(cu_k[-1]), hk, d, dtype=dtype, requires_grad=True)
    return cu_q, cu_k, max(lens_q), max(lens_k), q, k, v


def _varlen_ref(q, k, v, cu_q, cu_k, **kw):
    """Per-sequence float64 reference, packed back: ``(out (total_q, h, d), lse (h, total_q))``."""
    outs, lses = [], []
    for b in range(cu_q.shape[0] - 1):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        o, lse = ref_attention(q[sq][None], k[sk][None], v[sk][None], **kw)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_pair_reproduces_autograd(path, causal):
    dtype, tol = path
    cu_q, cu_k, mq, mk, q, k, v = _varlen(dtype=dtype)
    out, lse, S, rng = fi._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, 0.0, None, causal)
    ref, ref_lse = _varlen_ref(q, k, v, cu_q, cu_k, causal=causal)
    assert lse.shape == (4, 10) and S.numel() == 0
    torch.testing.assert_close(out.double(), ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=tol, atol=tol)
    dout = torch.randn_like(out)
    bufs = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    softmax_d = fi._flash_attn_varlen_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, *bufs, cu_q, cu_k,
                                               mq, mk, 0.0, 16 ** -0.5, causal, -1, -1, 0.0, None, False, rng)
    for got, want in zip(bufs, _ref_grads(ref, (q, k, v), dout)):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=10 * tol)
    assert softmax_d.shape == (4, 10 + 128 * 3)
    delta = (dout.double() * out.double()).sum(-1)  # (total_q,) per head
    for b in range(3):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        cols = slice(int(cu_q[b]) + 128 * b, int(cu_q[b + 1]) + 128 * b)
        torch.testing.assert_close(softmax_d[:, cols].double(), delta[rows].T, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ the autograd classes


def _dense_class_calls(q, k, v, kw, return_softmax):
    """``name -> (out, inputs for the gradient, how to map the inputs' grads to (dq, dk, dv))``."""
    tail = (kw["p"], kw["scale"], kw["causal"], kw["window"], kw["softcap"], None, False, return_softmax, True)
    qkv = torch.stack((q, k, v), dim=2).detach().requires_grad_()
    kv = torch.stack((k, v), dim=2).detach().requires_grad_()
    q2 = q.detach().clone().requires_grad_()
    return {
        "FlashAttnQKVPackedFunc": (fi.FlashAttnQKVPackedFunc.apply(qkv, *tail), (qkv,),
                                   lambda g: g[0].unbind(2)),
        "FlashAttnKVPackedFunc": (fi.FlashAttnKVPackedFunc.apply(q2, kv, *tail), (q2, kv),
                                  lambda g: (g[0], *g[1].unbind(2))),
        "FlashAttnFunc": (fi.FlashAttnFunc.apply(q, k, v, *tail), (q, k, v), lambda g: g),
    }


@pytest.mark.parametrize("return_softmax", [False, True])
def test_dense_classes_values_and_grads(path, return_softmax):
    dtype, tol = path
    q, k, v = _inputs(sq=9, sk=9, hk=4, dtype=dtype)  # qkv-packed needs equal lengths and heads
    kw = dict(p=0.0, scale=None, causal=True, window=(-1, -1), softcap=0.0)
    ref, ref_lse = ref_attention(q, k, v, causal=True)
    dout = torch.randn(ref.shape, dtype=dtype)
    want = _ref_grads(ref, (q, k, v), dout)
    for name, (res, inputs, split) in _dense_class_calls(q, k, v, kw, return_softmax).items():
        out = res
        if return_softmax:
            out, lse, S = res
            torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=tol, atol=tol)
            assert not lse.requires_grad and not S.requires_grad
        torch.testing.assert_close(out.double(), ref.detach(), rtol=tol, atol=tol, msg=name)
        for got, w in zip(split(_grads(out, inputs, dout)), want):
            torch.testing.assert_close(got.double(), w, rtol=tol, atol=10 * tol, msg=name)


def test_varlen_classes_values_and_grads(path):
    dtype, tol = path
    cu, _, mx, _, q, k, v = _varlen(lens_q=(3, 1, 6), lens_k=(3, 1, 6), hk=4, dtype=dtype)
    ref, _ = _varlen_ref(q, k, v, cu, cu, window=(2, 0))
    dout = torch.randn(ref.shape, dtype=dtype)
    want = _ref_grads(ref, (q, k, v), dout)
    tail = (0.0, None, False, [2, 0], 0.0, None, False, False)
    qkv = torch.stack((q, k, v), dim=1).detach().requires_grad_()
    kv = torch.stack((k, v), dim=1).detach().requires_grad_()
    q2 = q.detach().clone().requires_grad_()
    runs = {
        "qkvpacked": (fi.FlashAttnVarlenQKVPackedFunc.apply(qkv, cu, mx, *tail, True), (qkv,),
                      lambda g: g[0].unbind(1)),
        "kvpacked": (fi.FlashAttnVarlenKVPackedFunc.apply(q2, kv, cu, cu, mx, mx, *tail, True), (q2, kv),
                     lambda g: (g[0], *g[1].unbind(1))),
        "func": (fi.FlashAttnVarlenFunc.apply(q, k, v, cu, cu, mx, mx, *tail, None, True), (q, k, v), lambda g: g),
    }
    for name, (out, inputs, split) in runs.items():
        torch.testing.assert_close(out.double(), ref.detach(), rtol=tol, atol=tol, msg=name)
        for got, w in zip(split(_grads(out, inputs, dout)), want):
            torch.testing.assert_close(got.double(), w, rtol=tol, atol=10 * tol, msg=name)


def test_varlen_func_block_table_grads_land_on_the_pages():
    """Paged K/V through ``FlashAttnVarlenFunc``: values equal the packed keys'; the gradient of a page row
    is that of its packed key (zero on rows no sequence uses)."""
    cu, _, mx, _, q, k, v = _varlen(lens_q=(3, 5), lens_k=(3, 5), hk=2)
    page = 4
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)  # sequence 0: pages 2, 0; sequence 1: 1, 3
    pk = torch.zeros(4, page, 2, 16, dtype=F64)
    pv = torch.zeros(4, page, 2, 16, dtype=F64)
    rows = [(2, 0), (2, 1), (2, 2), (1, 0), (1, 1), (1, 2), (1, 3), (3, 0)]  # (page, row) of each packed key
    for i, (pg, r) in enumerate(rows):
        pk[pg, r], pv[pg, r] = k[i].detach(), v[i].detach()
    pk.requires_grad_()
    pv.requires_grad_()
    tail = (0.0, None, True, (-1, -1), 0.0, None, False, False)
    out = fi.FlashAttnVarlenFunc.apply(q, pk, pv, cu, cu, mx, mx, *tail, table, True)
    ref = fi.FlashAttnVarlenFunc.apply(q, k, v, cu, cu, mx, mx, *tail, None, True)
    torch.testing.assert_close(out, ref)
    dout = torch.randn_like(out)
    gpk, gpv = _grads(out, (pk, pv), dout)
    gk, gv = _grads(ref, (k, v), dout)
    used = torch.zeros(4, page, dtype=torch.bool)
    for i, (pg, r) in enumerate(rows):
        torch.testing.assert_close(gpk[pg, r], gk[i])
        torch.testing.assert_close(gpv[pg, r], gv[i])
        used[pg, r] = True
    assert (gpk[~used] == 0).all() and (gpv[~used] == 0).all()


def test_is_grad_enabled_false_keeps_nothing():
    q, k, v = _inputs()
    with torch.no_grad():
        out = fi.FlashAttnFunc.apply(q, k, v, 0.0, None, False, (-1, -1), 0.0, None, False, False, False)
    assert out.grad_fn is None
    torch.testing.assert_close(out, ref_attention(q, k, v)[0].detach())


# ------------------------------------------------------------------------------------------ dropout


def test_dropout_rng_state_replays_the_mask(path):
    """The forward's ``rng_state`` names the keep-mask (``culmen.ops.attention.dropout_keep_mask``): the
    output is the float64 attention with that mask, and the backward given it reproduces the gradient."""
    dtype, tol = path
    p = 0.3
    q, k, v = _inputs(dtype=dtype)
    out, lse, S, rng = fi._flash_attn_forward(q, k, v, p, None, True, -1, -1, 0.0, None, False)
    assert rng.dtype == torch.int64 and rng.shape == (2,) and bool(rng.ne(0).any())
    keep = dropout_keep_mask(rng, p, torch.arange(2), 4, 7, 11)
    assert 0.4 < keep.double().mean() < 0.95
    ref, _ = ref_attention(q, k, v, causal=True, keep=keep, p=p)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=tol, atol=tol)
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    fi._flash_attn_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, dq, dk, dv, p, 16 ** -0.5, True, -1,
                            -1, 0.0, None, False, rng)
    for got, want in zip((dq, dk, dv), _ref_grads(ref, (q, k, v), dout)):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=10 * tol)
    with pytest.raises(ValueError, match="rng_state"):
        fi._flash_attn_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, dq, dk, dv, p, 16 ** -0.5, True,
                                -1, -1, 0.0, None, False, None)


def test_generator_argument_draws_the_mask():
    q, k, v = _inputs(grad=False)
    args = (None, None, 0.5, None, False, -1, -1, 0.0, False)
    a = fi.flash_attn_gpu.fwd(q, k, v, *args, torch.Generator().manual_seed(3))
    b = fi.flash_attn_gpu.fwd(q, k, v, *args, torch.Generator().manual_seed(3))
    c = fi.flash_attn_gpu.fwd(q, k, v, *args, torch.Generator().manual_seed(4))
    assert torch.equal(a[3], b[3]) and torch.equal(a[0], b[0]) and not torch.equal(a[3], c[3])


# ---------------------------------------------------------------------------------- ring attention


def _combine(parts):
    """Merge chunk results ``[(out (B, s, h, d), lse (B, h, s))]`` through their log-sum-exps."""
    lse = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)
    out = sum(o * torch.exp(lse_i - lse).transpose(1, 2)[..., None] for o, lse_i in parts)
    return out, lse


def test_ring_attention_two_kv_chunks(path):
    """Ring step: attention over two K/V chunks run separately and combined equals attention over all keys;
    each chunk's backward, given the combined ``out`` and ``lse``, gives that chunk's dK/dV, and their dQ
    sum to the full dQ (GQA, softcap)."""
    dtype, tol = path
    q, k, v = _inputs(sq=9, sk=14, dtype=dtype)
    chunks = [(k[:, :6], v[:, :6]), (k[:, 6:], v[:, 6:])]
    parts = [fi._flash_attn_forward(q, kc, vc, 0.0, None, False, -1, -1, 3.0, None, False)[:2] for kc, vc in chunks]
    out, lse = _combine(parts)
    ref, ref_lse = ref_attention(q, k, v, softcap=3.0)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=tol, atol=tol)

    dout = torch.randn_like(out)
    out = out.to(dtype)
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for kc, vc in chunks:
        dq_c, dk_c, dv_c = (torch.empty_like(t) for t in (q, kc, vc))
        fi._flash_attn_backward(dout, q.detach(), kc.detach(), vc.detach(), out, lse, dq_c, dk_c, dv_c, 0.0,
                                16 ** -0.5, False, -1, -1, 3.0, None, False)
        dq += dq_c
        dks.append(dk_c)
        dvs.append(dv_c)
    got = (dq, torch.cat(dks, 1), torch.cat(dvs, 1))
    for g, w in zip(got, _ref_grads(ref, (q, k, v), dout)):
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=10 * tol)


def test_ring_attention_causal_split(path):
    """Causal ring attention as context parallelism runs it: the second half of the queries attend to their
    own K/V chunk (causal, the diagonal block) and to the earlier chunk (no mask)."""
    dtype, tol = path
    n = 8
    q, k, v = _inputs(sq=2 * n, sk=2 * n, dtype=dtype)
    q1 = q[:, n:]
    steps = [(k[:, n:], v[:, n:], True), (k[:, :n], v[:, :n], False)]
    parts = [fi._flash_attn_forward(q1, kc, vc, 0.0, None, causal, -1, -1, 0.0, None, False)[:2]
             for kc, vc, causal in steps]
    out, lse = _combine(parts)
    ref, ref_lse = ref_attention(q, k, v, causal=True)
    torch.testing.assert_close(out.double(), ref[:, n:].detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse[:, :, n:].detach(), rtol=tol, atol=tol)

    dout = torch.randn_like(out)
    dq1 = torch.zeros_like(q1)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for (kc, vc, causal), sl in zip(steps, (slice(n, None), slice(None, n))):
        dq_c, dk_c, dv_c = (torch.empty_like(t) for t in (q1, kc, vc))
        fi._flash_attn_backward(dout, q1.detach(), kc.detach(), vc.detach(), out.to(dtype), lse, dq_c, dk_c, dv_c,
                                0.0, 16 ** -0.5, causal, -1, -1, 0.0, None, False)
        dq1 += dq_c
        dk[:, sl] += dk_c
        dv[:, sl] += dv_c
    want = _ref_grads(ref[:, n:], (q, k, v), dout)
    torch.testing.assert_close(dq1.double(), want[0][:, n:], rtol=tol, atol=10 * tol)
    torch.testing.assert_close(dk.double(), want[1], rtol=tol, atol=10 * tol)
    torch.testing.assert_close(dv.double(), want[2], rtol=tol, atol=10 * tol)


def test_ring_attention_varlen_chunks(path):
    """The varlen internals in a ring step: each sequence's keys split in two chunks (their own cu_seqlens),
    combined through the (h, total_q) log-sum-exps, backward per chunk."""
    dtype, tol = path
    cu_q, cu_k, mq, mk, q, k, v = _varlen(lens_q=(4, 6), lens_k=(6, 9), dtype=dtype)
    split = [(0, 2), (6, 10)], [(2, 6), (10, 15)]  # (start, end) rows of k for each sequence, per chunk
    chunks = []
    for rows in split:
        idx = torch.cat([torch.arange(a, b) for a, b in rows])
        cu = torch.tensor([0, *[b - a for a, b in rows]]).cumsum(0).to(torch.int32)
        chunks.append((idx, cu, max(b - a for a, b in rows)))
    parts = []
    for idx, cu, m in chunks:
        o, lse = fi._flash_attn_varlen_forward(q, k[idx], v[idx], cu_q, cu, mq, m, 0.0, None, False)[:2]
        parts.append((o[None], lse.T[None].transpose(1, 2)))
    out, lse = _combine(parts)
    out, lse = out[0], lse[0]  # (total_q, h, d), (h, total_q)
    ref, ref_lse = _varlen_ref(q, k, v, cu_q, cu_k)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=tol, atol=tol)
    dout = torch.randn_like(out)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for idx, cu, m in chunks:
        kc, vc = k[idx].detach(), v[idx].detach()
        dq_c, dk_c, dv_c = (torch.empty_like(t) for t in (q, kc, vc))
        fi._flash_attn_varlen_backward(dout, q.detach(), kc, vc, out.to(dtype), lse.contiguous(), dq_c, dk_c, dv_c,
                                       cu_q, cu, mq, m, 0.0, 16 ** -0.5, False, -1, -1, 0.0, None, False)
        dq += dq_c
        dk[idx] += dk_c
        dv[idx] += dv_c
    for g, w in zip((dq, dk, dv), _ref_grads(ref, (q, k, v), dout)):
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=10 * tol)


# ------------------------------------------------------------------------------- flash_attn_gpu


def test_extension_entry_points_write_into_given_buffers():
    q, k, v = _inputs(grad=False)
    out_ = torch.full_like(q, float("nan"))
    res = fi.flash_attn_gpu.fwd(q, k, v, out_, None, 0.0, None, True, -1, -1, 0.0, False, None)
    assert isinstance(res, list) and len(res) == 4 and res[0] is out_
    torch.testing.assert_close(out_, ref_attention(q, k, v, causal=True)[0])
    dout = torch.randn_like(q)
    dq_, dk_, dv_ = (torch.full_like(t, float("nan")) for t in (q, k, v))
    dq, dk, dv, sd = fi.flash_attn_gpu.bwd(dout, q, k, v, out_, res[1], dq_, dk_, dv_, None, 0.0, None, True, -1, -1,
                                           0.0, False, None, res[3])
    assert dq is dq_ and dk is dk_ and dv is dv_ and torch.isfinite(dq).all() and torch.isfinite(dk).all()
    alloc = fi.flash_attn_gpu.bwd(dout, q, k, v, out_, res[1], None, None, None, None, 0.0, None, True, -1, -1, 0.0,
                                  False, None, res[3])
    assert all(torch.equal(a, b) for a, b in zip(alloc, (dq, dk, dv, sd)))
    with pytest.raises(ValueError, match="dq"):
        fi.flash_attn_gpu.bwd(dout, q, k, v, out_, res[1], dq_[:1], None, None, None, 0.0, None, True, -1, -1, 0.0,
                              False, None, res[3])
    with pytest.raises(ValueError, match="softmax_lse"):
        fi.flash_attn_gpu.bwd(dout, q, k, v, out_, res[1][:1], None, None, None, None, 0.0, None, True, -1, -1, 0.0,
                              False, None, res[3])


def test_fwd_kvcache_entry_point():
    q = torch.randn(2, 3, 4, 16, dtype=F64)
    kc, vc = torch.randn(2, 20, 2, 16, dtype=F64), torch.randn(2, 20, 2, 16, dtype=F64)
    kn, vn = torch.randn(2, 3, 2, 16, dtype=F64), torch.randn(2, 3, 2, 16, dtype=F64)
    seqlens = torch.tensor([4, 9], dtype=torch.int32)
    kc2, vc2 = kc.clone(), vc.clone()
    out_ = torch.empty_like(q)
    res = fi.flash_attn_gpu.fwd_kvcache(q, kc, vc, kn, vn, seqlens, None, None, None, None, None, None, out_, None,
                                        True, -1, -1, 0.0, True, 0)
    want, want_lse = fa.flash_attn_with_kvcache(q, kc2, vc2, kn, vn, cache_seqlens=seqlens, causal=True,
                                                return_softmax_lse=True)
    assert len(res) == 2 and res[0] is out_
    assert torch.equal(res[0], want) and torch.equal(res[1], want_lse) and torch.equal(kc, kc2)


def test_varlen_forward_leftpad_seqused_and_paged_keys():
    """``seqused_k`` / ``leftpad_k``: sequence b attends to its keys [leftpad_k[b], seqused_k[b]); a paged cache
    through ``block_table`` equals the packed keys."""
    cu_q, cu_k, mq, mk, q, k, v = _varlen(lens_q=(2, 3), lens_k=(6, 7))
    q, k, v = q.detach(), k.detach(), v.detach()
    used, pad = torch.tensor([5, 6], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32)
    out = fi._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, 0.0, None, True, leftpad_k=pad, seqused_k=used)[0]
    for b in range(2):
        s0 = int(cu_k[b])
        sk = slice(s0 + int(pad[b]), s0 + int(used[b]))
        sq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        torch.testing.assert_close(out[sq], ref_attention(q[sq][None], k[sk][None], v[sk][None], causal=True)[0][0])
    page = 4
    table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    pk, pv = torch.randn(4, page, 2, 16, dtype=F64), torch.randn(4, page, 2, 16, dtype=F64)
    for b, n in enumerate((6, 7)):
        for t in range(n):
            pk[int(table[b, t // page]), t % page] = k[int(cu_k[b]) + t]
            pv[int(table[b, t // page]), t % page] = v[int(cu_k[b]) + t]
    paged = fi._flash_attn_varlen_forward(q, pk, pv, cu_q, cu_k, mq, mk, 0.0, None, True, block_table=table)[0]
    packed = fi._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, 0.0, None, True)[0]
    torch.testing.assert_close(paged, packed)
    with pytest.raises(ValueError, match="leftpad_k"):
        fi._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, 0.0, None, True, leftpad_k=used + 1,
                                      seqused_k=used)
    with pytest.raises(ValueError, match="block_table"):
        fi._flash_attn_varlen_forward(q, pk, pv, cu_q, cu_k, mq, mk, 0.0, None, True, block_table=table + 4)
    with pytest.raises(TypeError, match="seqused_k"):
        fi._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, 0.0, None, True, seqused_k=used[:1])


def test_zero_tensors_clears_rows_outside_the_sequences():
    cu_q, cu_k, mq, mk, q, k, v = _varlen(lens_q=(2, 3), lens_k=(4, 4))
    q = torch.cat((q.detach(), torch.randn(3, 4, 16, dtype=F64)))  # 3 rows past cu_seqlens_q[-1]
    k, v = k.detach(), v.detach()
    out, lse, _, rng = fi._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, 0.0, None, False, zero_tensors=True)
    assert (out[5:] == 0).all() and torch.isneginf(lse[:, 5:]).all() and torch.isfinite(lse[:, :5]).all()
    dq = torch.full_like(q, float("nan"))
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    sd = fi._flash_attn_varlen_backward(torch.randn_like(out), q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, mq, mk, 0.0,
                                        0.25, False, -1, -1, 0.0, None, False, rng, zero_tensors=True)
    assert (dq[5:] == 0).all() and torch.isfinite(dq[:5]).all()
    assert torch.isfinite(sd).all() and (sd[:, 128 + 5:128 + 8] == 0).all()  # rows 5..7 sit after sequence 1's


# ------------------------------------------------------------------------------ custom ops, compile


def test_opcheck_of_the_custom_ops():
    q, k, v = _inputs(dtype=F32, grad=False)
    cu_q, cu_k, mq, mk, pq, pk, pv = _varlen(dtype=F32)
    pq, pk, pv = pq.detach(), pk.detach(), pv.detach()
    out, lse, _, rng = fi._flash_attn_forward(q, k, v, 0.0, None, True, -1, -1, 0.0, None, False)
    vout, vlse, _, vrng = fi._flash_attn_varlen_forward(pq, pk, pv, cu_q, cu_k, mq, mk, 0.0, None, True)
    samples = [
        (torch.ops.culmen.fa_forward, (q, k, v, 0.0, 0.25, True, 3, -1, 0.0, None, True)),
        (torch.ops.culmen.fa_varlen_forward, (pq, pk, pv, cu_q, cu_k, mq, mk, 0.0, None, True)),
        (torch.ops.culmen.fa_backward, (torch.randn_like(out), q, k, v, out, lse, torch.empty_like(q),
                                        torch.empty_like(k), torch.empty_like(v), 0.0, 0.25, True, -1, -1, 0.0, None,
                                        False, rng)),
        (torch.ops.culmen.fa_varlen_backward, (torch.randn_like(vout), pq, pk, pv, vout, vlse, torch.empty_like(pq),
                                               torch.empty_like(pk), torch.empty_like(pv), cu_q, cu_k, mq, mk, 0.0,
                                               0.25, True, -1, -1, 0.0, None, False, vrng)),
    ]
    for op, args in samples:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_compile_inductor_classes_and_internals():
    """``FlashAttnFunc`` and the internals under ``torch.compile`` (Inductor, fullgraph): the custom ops are
    opaque calls with fake implementations; results and gradients equal eager."""
    q, k, v = _inputs(dtype=F32)

    def via_class(q, k, v):
        return fi.FlashAttnFunc.apply(q, k, v, 0.0, None, True, (4, -1), 0.0, None, False, False, True)

    def via_internals(q, k, v):
        out, lse = fi._flash_attn_forward(q, k, v, 0.0, None, False, -1, -1, 0.0, None, False)[:2]
        return out * 2, lse

    torch._dynamo.reset()
    eager = via_class(q, k, v)
    comp = torch.compile(via_class, fullgraph=True)(q, k, v)
    torch.testing.assert_close(comp, eager)
    dout = torch.randn_like(eager)
    for a, b in zip(_grads(comp, (q, k, v), dout), _grads(eager, (q, k, v), dout)):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        for a, b in zip(torch.compile(via_internals, fullgraph=True)(q, k, v), via_internals(q, k, v)):
            torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------ rotary_kernel


def test_rotary_kernel_is_the_kernel_of_the_rotary_layers(monkeypatch):
    """``flash_attn.ops.triton.rotary.rotary_kernel`` is the kernel ``apply_rotary_emb`` launches (forward
    and backward), and flash_attn's compile-count configuration (batch 4 / 32, seqlen 128 / 256, 4 heads,
    head dim 128, fp16) asks Triton for two compilations: one per direction. Launches are recorded with
    Triton's specialization of each argument (integers: 1 / divisible by 16 unless ``do_not_specialize``)."""
    from culmen.flash_attn.layers.rotary import apply_rotary_emb
    from culmen.flash_attn.ops.triton.rotary import rotary_kernel
    from culmen.ops.backend import use_backend
    from culmen.ops.common.launch import Launch
    from culmen.ops.rotary.kernels import _rotary_kernel

    assert rotary_kernel is _rotary_kernel and "CONJUGATE" in rotary_kernel.arg_names
    raw = getattr(rotary_kernel, "do_not_specialize", None)
    if raw is None:  # Triton's interpreter keeps the decorator's arguments
        raw = getattr(rotary_kernel, "kwargs", {}).get("do_not_specialize", ())
    dns = {rotary_kernel.arg_names[i] if isinstance(i, int) else i for i in raw}
    assert {"seqlen", "n_sblocks", "offset"} <= dns  # the sizes that change per batch
    keys = set()

    def spec(name, a):
        if isinstance(a, torch.Tensor):
            return str(a.dtype)
        if isinstance(a, int) and not isinstance(a, bool):
            return ("int",) if name in dns else ("int", a == 1, a % 16 == 0)
        return a

    def record(self, stream, aligned, *args):
        assert self.fn is rotary_kernel
        keys.add((tuple(sorted(self.meta.items())), self.num_warps, self.num_stages,
                  tuple(spec(n, a) for n, a in zip(self.fn.arg_names, args))))

    monkeypatch.setattr(Launch, "__call__", record)
    with use_backend("triton"):
        for seqlen in (128, 256):
            for batch in (4, 32):
                x = torch.randn(batch, seqlen, 4, 128, dtype=torch.float16, requires_grad=True)
                t = torch.arange(seqlen, dtype=torch.float32)[:, None] * torch.rand(64)[None, :]
                out = apply_rotary_emb(x, t.cos().half(), t.sin().half())
                out.backward(torch.randn_like(out))
    assert len(keys) == 2 and {dict(m)["CONJUGATE"] for m, *_ in keys} == {False, True}


@pytest.mark.gpu
def test_rotary_kernel_compiles_once_per_direction_on_gpu():
    """flash_attn's test_compilation_count, written for culmen: clear ``rotary_kernel``'s cache (and culmen's
    plans, whose bound launches would skip Triton's dispatch), count Triton's compile hook over two sequence
    lengths and two batch sizes: two compilations (forward, backward)."""
    import triton
    from triton.runtime.jit import JITFunction

    from culmen.flash_attn.layers.rotary import apply_rotary_emb
    from culmen.flash_attn.ops.triton.rotary import rotary_kernel
    from culmen.ops.common.plans import clear_plans

    count = 0

    def hook(*args, **kwargs):
        nonlocal count
        count += 1
        return False

    knobs = getattr(triton, "knobs", None)
    holder, attr = (knobs.runtime, "jit_cache_hook") if knobs is not None else (JITFunction, "cache_hook")
    old = getattr(holder, attr)
    if hasattr(rotary_kernel, "cache"):
        rotary_kernel.cache.clear()
    else:
        for entry in rotary_kernel.device_caches.values():
            entry[0].clear()
    clear_plans()
    setattr(holder, attr, hook)
    try:
        for seqlen in (128, 256):
            for batch in (4, 32):
                x = torch.randn(batch, seqlen, 4, 128, dtype=torch.float16, device="cuda", requires_grad=True)
                t = torch.arange(seqlen, device="cuda", dtype=torch.float32)[:, None] * torch.rand(64, device="cuda")
                out = apply_rotary_emb(x, t.cos().half(), t.sin().half())
                out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
    finally:
        setattr(holder, attr, old)
    assert count == 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_internals_and_ring_step_on_gpu(dtype):
    """The internals on the GPU kernels at real sizes: a two-chunk causal ring step (GQA; the diagonal chunk
    causal) against float64 attention, errors within 3x those of the same math done in ``dtype``
    (``culmen.testing.attention.plain``)."""
    from culmen.testing import assert_close_tolerance
    from culmen.testing.attention import plain

    dev = torch.device("cuda")
    n, h, hk, d = 320, 8, 2, 128
    q, k, v = (torch.randn(2, 2 * n, m, d, device=dev, dtype=dtype, requires_grad=True) for m in (h, hk, hk))
    q1 = q[:, n:].detach()
    steps = [(k[:, n:].detach(), v[:, n:].detach(), True), (k[:, :n].detach(), v[:, :n].detach(), False)]
    parts = [fi._flash_attn_forward(q1, kc, vc, 0.0, None, c, -1, -1, 0.0, None, False)[:2] for kc, vc, c in steps]
    out, lse = _combine([(o.float(), l_) for o, l_ in parts])
    hi = plain(q, k, v, F64, causal=True)[:, n:]
    lo = plain(q, k, v, dtype, causal=True)[:, n:]
    assert_close_tolerance(out, hi.detach(), lo.detach(), factor=3.0, name="out")
    dout = torch.randn_like(q1)
    dq1 = torch.zeros_like(q1, dtype=F32)
    dk, dv = torch.zeros_like(k, dtype=F32), torch.zeros_like(v, dtype=F32)
    for (kc, vc, c), sl in zip(steps, (slice(n, None), slice(None, n))):
        dq_c, dk_c, dv_c = (torch.empty_like(t) for t in (q1, kc, vc))
        fi._flash_attn_backward(dout, q1, kc, vc, out.to(dtype), lse, dq_c, dk_c, dv_c, 0.0, d ** -0.5, c, -1, -1, 0.0,
                                None, False)
        dq1 += dq_c
        dk[:, sl] += dk_c
        dv[:, sl] += dv_c
    want = _ref_grads(hi, (q, k, v), dout)
    base = _grads(lo, (q, k, v), dout)
    for got, w, b, name in ((dq1, want[0][:, n:], base[0][:, n:], "dq"), (dk, want[1], base[1], "dk"),
                            (dv, want[2], base[2], "dv")):
        assert_close_tolerance(got, w, b, factor=3.0, name=name)
