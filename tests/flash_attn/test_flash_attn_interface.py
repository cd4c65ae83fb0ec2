"""culmen.flash_attn's attention interface: signatures, packed forms, varlen, modules, compile, errors."""

from __future__ import annotations

import inspect

import pytest
import torch

import culmen.flash_attn as fa
from culmen.flash_attn.modules.mha import FlashCrossAttention, FlashSelfAttention
from culmen.ops.attention import attention_ref

TAIL = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
        ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
SIGS = {
    "flash_attn_qkvpacked_func": ["qkv"],
    "flash_attn_kvpacked_func": ["q", "kv"],
    "flash_attn_func": ["q", "k", "v"],
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen"],
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"],
    "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"],
}


@pytest.mark.parametrize("name", sorted(SIGS))
def test_signatures_match_flash_attn(name):
    params = list(inspect.signature(getattr(fa, name)).parameters.values())
    tail = TAIL + ([("block_table", None)] if name == "flash_attn_varlen_func" else [])
    assert [p.name for p in params] == SIGS[name] + [n for n, _ in tail]
    assert all(p.default is inspect.Parameter.empty for p in params[:len(SIGS[name])])
    assert [p.default for p in params[len(SIGS[name]):]] == [d for _, d in tail]


def _qkv(B=2, sq=6, sk=9, h=4, hk=2, d=16, dtype=torch.float32, grad=True):
    return tuple(torch.randn(B, s, n, d, dtype=dtype).requires_grad_(grad)
                 for s, n in ((sq, h), (sk, hk), (sk, hk)))


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


def test_func_matches_reference_and_returns():
    q, k, v = _qkv()
    alibi = torch.rand(4)
    kw = dict(causal=True, window_size=(4, -1), softcap=3.0, alibi_slopes=alibi)
    out = fa.flash_attn_func(q, k, v, **kw)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    torch.testing.assert_close(out, ref)
    out2, lse, S = fa.flash_attn_func(q, k, v, **kw, return_attn_probs=True)
    assert torch.equal(out, out2) and lse.shape == (2, 4, 6) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, ref_lse)
    assert S.shape == (2, 4, 128, 128) and (S[:, :, :6, :9] >= 0).all() and (S[:, :, 6:] == 0).all()
    torch.testing.assert_close(S[:, :, :6, :9].sum(-1), torch.ones(2, 4, 6))


def test_qkvpacked_equals_unpacked():
    qkv = torch.randn(2, 7, 3, 4, 16, requires_grad=True)
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True, softmax_scale=0.3)
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(2))
    ref = fa.flash_attn_func(q, k, v, causal=True, softmax_scale=0.3)
    assert torch.equal(out, ref)
    dout = torch.randn_like(out)
    (dqkv,) = _grads(out, (qkv,), dout)
    assert torch.equal(dqkv, torch.stack(_grads(ref, (q, k, v), dout), dim=2))


def test_kvpacked_equals_unpacked_gqa():
    q, k, v = _qkv()
    kv = torch.stack((k.detach(), v.detach()), dim=2).requires_grad_()
    out = fa.flash_attn_kvpacked_func(q, kv, window_size=(2, 2))
    ref = fa.flash_attn_func(q, k, v, window_size=(2, 2))
    assert torch.equal(out, ref)
    dout = torch.randn_like(out)
    dq, dkv = _grads(out, (q, kv), dout)
    rq, rk, rv = _grads(ref, (q, k, v), dout)
    assert torch.equal(dq, rq) and torch.equal(dkv, torch.stack((rk, rv), dim=2))


def _varlen_data(h=4, hk=2, d=8):
    cu = torch.tensor([0, 4, 5, 11], dtype=torch.int32)
    return cu, 6, tuple(torch.randn(11, n, d, requires_grad=True) for n in (h, hk, hk))


def test_varlen_func_matches_padded_dense():
    cu, mx, (q, k, v) = _varlen_data()
    out, lse, _ = fa.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=True, return_attn_probs=True)
    assert out.shape == (11, 4, 8) and lse.shape == (4, 11)
    for b in range(3):
        s = slice(int(cu[b]), int(cu[b + 1]))
        ob = fa.flash_attn_func(q[s][None], k[s][None], v[s][None], causal=True)
        torch.testing.assert_close(out[s], ob[0])


def test_varlen_packed_equal_unpacked():
    cu, mx, (q, k, v) = _varlen_data(h=2, hk=2)
    ref = fa.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=True)
    qkv = torch.stack((q, k, v), dim=1)
    assert torch.equal(fa.flash_attn_varlen_qkvpacked_func(qkv, cu, mx, causal=True), ref)
    kv = torch.stack((k, v), dim=1)
    out = fa.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, mx, mx, causal=True)
    assert torch.equal(out, ref)
    dout = torch.randn_like(out)
    dq, dkv = _grads(out, (q, kv), dout)
    rq, rk, rv = _grads(ref, (q, k, v), dout)
    assert torch.equal(dq, rq) and torch.equal(dkv, torch.stack((rk, rv), dim=1))


def test_dropout_seeded_replay_and_eval():
    q, k, v = _qkv()
    torch.manual_seed(1)
    a = fa.flash_attn_func(q, k, v, 0.5)
    torch.manual_seed(1)
    b = fa.flash_attn_func(q, k, v, 0.5)
    c = fa.flash_attn_func(q, k, v, 0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)
    _, _, S = fa.flash_attn_func(q, k, v, 0.5, return_attn_probs=True)
    assert (S[:, :, :6, :9] < 0).any()  # dropped entries are negative


def test_modules_forward():
    torch.manual_seed(0)
    qkv = torch.randn(2, 5, 3, 4, 8)
    m = FlashSelfAttention(causal=True, attention_dropout=0.5).eval()
    torch.testing.assert_close(m(qkv), fa.flash_attn_qkvpacked_func(qkv, causal=True))
    torch.testing.assert_close(m(qkv, causal=False), fa.flash_attn_qkvpacked_func(qkv))
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    torch.testing.assert_close(m(qkv.reshape(10, 3, 4, 8), cu_seqlens=cu, max_seqlen=5),
                               m(qkv).reshape(10, 4, 8))
    m.train()
    assert not torch.equal(m(qkv), m.eval()(qkv))
    q, kv = torch.randn(2, 3, 4, 8), torch.randn(2, 5, 2, 2, 8)
    c = FlashCrossAttention(softmax_scale=0.5, window_size=(1, 1)).eval()
    torch.testing.assert_close(c(q, kv), fa.flash_attn_kvpacked_func(q, kv, softmax_scale=0.5, window_size=(1, 1)))
    cq, ck = torch.tensor([0, 3, 6], dtype=torch.int32), torch.tensor([0, 5, 10], dtype=torch.int32)
    out = c(q.reshape(6, 4, 8), kv.reshape(10, 2, 2, 8), cu_seqlens=cq, max_seqlen=3, cu_seqlens_k=ck,
            max_seqlen_k=5)
    torch.testing.assert_close(out, c(q, kv).reshape(6, 4, 8))
    assert list(inspect.signature(FlashSelfAttention).parameters) == [
        "causal", "softmax_scale", "attention_dropout", "window_size", "alibi_slopes", "deterministic"]


def test_compile_fullgraph_no_graph_break():
    torch._dynamo.reset()
    q, k, v = _qkv()
    alibi = torch.rand(2, 4)

    def f(q, k, v):
        return fa.flash_attn_func(q, k, v, 0.0, None, True, (3, -1), 2.0, alibi)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    ref = f(q, k, v)
    torch.testing.assert_close(out, ref)
    dout = torch.randn_like(out)
    for g, r in zip(_grads(out, (q, k, v), dout), _grads(ref, (q, k, v), dout)):
        torch.testing.assert_close(g, r)
    cu, mx, (vq, vk, vv) = _varlen_data()
    cf = torch.compile(lambda a, b, c: fa.flash_attn_varlen_func(a, b, c, cu, cu, mx, mx, causal=True),
                       fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(cf(vq, vk, vv), fa.flash_attn_varlen_func(vq, vk, vv, cu, cu, mx, mx, causal=True))


def test_compile_dynamic_no_recompiles():
    """Dense and varlen under torch.compile(dynamic=True): one graph each for every sequence length (and
    max_seqlen), results and gradients equal to eager. On CPU the traced plans run the reference (the
    interpreter's kernels cannot be traced), whose varlen form is loop-free for that reason."""

    def dense(q, k, v):
        return fa.flash_attn_func(q, k, v, causal=True, window_size=(5, -1), softcap=3.0)

    def varlen(q, k, v, cu, mx):
        return fa.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=True)

    for fn in (dense, varlen):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
        for s in (20, 33):
            if fn is dense:
                args, extra = _qkv(sq=s, sk=s + 3), ()
            else:
                lens = [s, s // 2, 3]
                cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
                args = tuple(torch.randn(sum(lens), n, 16, requires_grad=True) for n in (4, 2, 2))
                extra = (cu, max(lens))
            ref, out = fn(*args, *extra), compiled(*args, *extra)
            dout = torch.randn_like(ref)
            torch.testing.assert_close(out, ref)
            for g, r in zip(_grads(out, args, dout), _grads(ref, args, dout)):
                torch.testing.assert_close(g, r)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, fn.__name__


@pytest.mark.parametrize("d,dtype", [(256, torch.float16), (512, torch.bfloat16), (59, torch.float32)])
def test_head_dims_and_dtypes_accepted(d, dtype):
    q, k, v = _qkv(B=1, sq=3, sk=4, h=2, hk=1, d=d, dtype=dtype, grad=False)
    out = fa.flash_attn_func(q, k, v, causal=True)
    assert out.shape == q.shape and out.dtype == dtype and torch.isfinite(out).all()


def _bad_cases():
    q, k, v = _qkv(grad=False)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    pq, pk = torch.randn(6, 4, 16), torch.randn(6, 2, 16)
    F, V = fa.flash_attn_func, fa.flash_attn_varlen_func
    return {
        "dtype_k": (lambda: F(q, k.half(), v), TypeError, "k must have the dtype"),
        "dtype_v": (lambda: F(q, k, v.double()), TypeError, "v must have the dtype"),
        "int_q": (lambda: F(q.int(), k.int(), v.int()), TypeError, "q must be float"),
        "rank_q": (lambda: F(q[0], k, v), ValueError, "q must be 4-D"),
        "rank_k": (lambda: F(q, k[0], v), ValueError, "k must be 4-D"),
        "heads": (lambda: F(q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1)), ValueError,
                  "multiple of nheads"),
        "headdim_k": (lambda: F(q, k[..., :8], v), ValueError, "k head dim"),
        "headdim_v": (lambda: F(q, k, v[..., :8]), ValueError, "v head dim"),
        "headdim_max": (lambda: F(*_qkv(1, 2, 2, 1, 1, 513, grad=False)), ValueError, "head dim must be in"),
        "batch": (lambda: F(q, k[:1], v[:1]), ValueError, "k batch size"),
        "kv_shape": (lambda: F(q, k, v[:, :3]), ValueError, "v shape"),
        "dropout_hi": (lambda: F(q, k, v, 1.0), ValueError, "dropout_p"),
        "dropout_neg": (lambda: F(q, k, v, -0.1), ValueError, "dropout_p"),
        "window_lo": (lambda: F(q, k, v, window_size=(-2, 0)), ValueError, "window_size"),
        "window_len": (lambda: F(q, k, v, window_size=(1,)), ValueError, "window_size"),
        "softcap": (lambda: F(q, k, v, softcap=-1.0), ValueError, "softcap"),
        "alibi_shape": (lambda: F(q, k, v, alibi_slopes=torch.rand(3)), ValueError, "alibi_slopes"),
        "cu_int64": (lambda: V(pq, pk, pk, cu.long(), cu, 3, 3), TypeError, "cu_seqlens_q must be int32"),
        "cu_k_int64": (lambda: V(pq, pk, pk, cu, cu.long(), 3, 3), TypeError, "cu_seqlens_k must be int32"),
        "cu_len": (lambda: V(pq, pk, pk, cu, cu[:2], 3, 3), ValueError, "same length"),
        "varlen_rank": (lambda: V(q, k, v, cu, cu, 3, 3), ValueError, "q must be 3-D"),
        "max_seqlen": (lambda: V(pq, pk, pk, cu, cu, 3.0, 3), ValueError, "max_seqlen_q"),
        "qkv_packed": (lambda: fa.flash_attn_qkvpacked_func(q), ValueError, "qkv"),
        "block_table": (lambda: V(pq, pk, pk, cu, cu, 3, 3, block_table=cu), TypeError, "block_table must be"),
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_bad_inputs_raise_naming_argument(case):
    fn, exc, msg = _bad_cases()[case]
    with pytest.raises(exc, match=msg):
        fn()
