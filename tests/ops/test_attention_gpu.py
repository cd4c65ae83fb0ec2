"""The FlashAttention kernels on a real GPU at real sizes (run by ``scripts/gpu-check``).

flash_attn's rule: culmen's max error against a float64 oracle (``culmen.testing.attention.plain``)
is at most 2x the error of the same math done in the input precision (3x for the gradients), plus a
small atol. Odd head dims and sequence lengths, ``sq != sk`` both ways, every masking feature, GQA,
dropout with the replayed keep mask, varlen, determinism and fully masked rows.
"""

from __future__ import annotations

import pytest
import torch

from culmen.ops.attention import dropout_keep_mask, flash_attn, flash_attn_varlen
from culmen.ops.attention import op as attn_op
from culmen.testing import assert_close_tolerance
from culmen.testing.attention import grads as _grads
from culmen.testing.attention import plain

pytestmark = pytest.mark.gpu

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


def _inputs(B, sq, sk, h, hk, d, dtype):
    dev = torch.device("cuda")
    return tuple(torch.randn(B, s, n, d, device=dev, dtype=dtype).requires_grad_()
                 for s, n in ((sq, h), (sk, hk), (sk, hk)))


def check(B=2, sq=113, sk=203, h=4, hk=4, d=64, dtype=BF16, causal=False, window=(-1, -1), softcap=0.0,
          alibi=None, p=0.0, deterministic=False, monkeypatch=None):
    q, k, v = _inputs(B, sq, sk, h, hk, d, dtype)
    slopes = None if alibi is None else (torch.rand(*alibi, device="cuda") * 0.3)
    keep = None
    if p > 0:
        rng = torch.tensor([0x5EED_1234, 99], dtype=torch.int64, device="cuda")
        monkeypatch.setattr(attn_op, "_rng_state", lambda dp, dev: rng.clone())
        keep = dropout_keep_mask(rng, p, torch.arange(B, device="cuda"), h, sq, sk)
    out, lse, _ = flash_attn(q, k, v, p, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
                             deterministic=deterministic)
    assert out.dtype == dtype and lse.shape == (B, h, sq) and lse.dtype == F32
    dout = torch.randn_like(out)
    grads = _grads(out, dout, (q, k, v))
    f = dict(causal=causal, window=window, softcap=softcap, alibi=slopes, keep=keep, p=p)
    hi = plain(q, k, v, F64, **f)
    hi_g = _grads(hi, dout.double(), (q, k, v))
    lo = plain(q, k, v, dtype, **f)
    lo_g = _grads(lo, dout, (q, k, v))
    assert_close_tolerance(out, hi.detach(), lo.detach(), factor=2.0, name="out")
    for name, g, gh, gl in zip("qkv", grads, hi_g, lo_g):
        assert g.dtype == dtype and g.shape == (q, k, v)["qkv".index(name)].shape
        assert_close_tolerance(g, gh, gl, factor=3.0, name=f"d{name}")
    return out, lse, grads


SHAPES = [(113, 203), (203, 113), (1, 147), (147, 1), (257, 97), (1023, 1025), (2048, 2048)]


# Every head dim at the small shapes; the long sequences at the common head dims only (time).
DIM_CASES = [(d, sq, sk) for d in (59, 64, 111, 128, 256) for sq, sk in SHAPES if sq * sk <= 2**20 or d in (64, 128)]


@pytest.mark.parametrize("d,sq,sk", DIM_CASES)
def test_head_dims_and_seqlens(d, sq, sk):
    check(sq=sq, sk=sk, d=d, causal=(sq + d) % 2 == 0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_causal_both_dtypes(dtype, causal):
    check(B=1, sq=1025, sk=1023, h=2, hk=2, d=128, dtype=dtype, causal=causal)


FEATURES = {
    "window": dict(sq=517, sk=611, window=(64, 17)),
    "window_left_causal": dict(sq=700, sk=700, window=(100, -1), causal=True),
    "softcap": dict(sq=300, sk=333, softcap=15.0, d=128),
    "alibi_h": dict(sq=257, sk=400, alibi=(4,), causal=True),
    "alibi_bh": dict(sq=400, sk=257, alibi=(2, 4)),
    "gqa": dict(sq=333, sk=517, h=8, hk=2, causal=True, d=128),
    "mqa_window_softcap": dict(sq=259, sk=700, h=6, hk=1, window=(50, 10), softcap=20.0, d=96),
    "fp32": dict(sq=150, sk=170, dtype=F32, d=80, causal=True),
}


@pytest.mark.parametrize("case", list(FEATURES))
def test_features(case):
    check(**FEATURES[case])


def test_dropout_replays_mask_and_rate(monkeypatch):
    check(B=2, sq=301, sk=517, h=4, hk=2, d=64, causal=True, p=0.17, monkeypatch=monkeypatch)
    keep = dropout_keep_mask(torch.tensor([7, 0], device="cuda"), 0.17, torch.arange(4, device="cuda"), 8, 512, 512)
    assert abs(1 - keep.float().mean().item() - 0.17) < 0.003


def test_deterministic_backward_bitwise():
    q, k, v = _inputs(2, 1000, 1000, 8, 2, 128, BF16)
    dout = torch.randn_like(q)
    out = flash_attn(q, k, v, causal=True, deterministic=True)[0]
    g1 = _grads(out, dout, (q, k, v))
    g2 = _grads(flash_attn(q, k, v, causal=True, deterministic=True)[0], dout, (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_fully_masked_rows_zero_not_nan():
    out, lse, grads = check(B=1, sq=300, sk=100, h=2, hk=2, d=64, causal=True)
    assert torch.isinf(lse[:, :, :200]).all() and (lse[:, :, :200] > 0).all()
    assert torch.equal(out[:, :200], torch.zeros_like(out[:, :200]))
    assert torch.equal(grads[0][:, :200], torch.zeros_like(grads[0][:, :200]))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_dense_per_sequence(causal):
    lens_q = [1, 700, 0, 129, 1025, 64]
    lens_k = [5, 700, 3, 200, 1025, 1]
    h, hk, d = 8, 4, 128
    cu_q = torch.tensor([0, *lens_q], device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lens_k], device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=BF16, requires_grad=True)
    k = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=BF16, requires_grad=True)
    v = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=BF16, requires_grad=True)
    out, lse, _ = flash_attn_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
    dout = torch.randn_like(out)
    out.backward(dout)
    for b in range(len(lens_q)):
        q0, q1, k0, k1 = cu_q[b].item(), cu_q[b + 1].item(), cu_k[b].item(), cu_k[b + 1].item()
        if q1 == q0:
            continue
        qb, kb, vb = (t.detach()[s0:s1][None].requires_grad_() for t, s0, s1 in ((q, q0, q1), (k, k0, k1),
                                                                                  (v, k0, k1)))
        hi = plain(qb, kb, vb, F64, causal=causal)
        lo = plain(qb, kb, vb, BF16, causal=causal)
        assert_close_tolerance(out[q0:q1][None], hi.detach(), lo.detach(), name=f"out[{b}]")
        hi_g = _grads(hi, dout[q0:q1][None].double(), (qb, kb, vb))
        lo_g = _grads(lo, dout[q0:q1][None], (qb, kb, vb))
        for name, g, gh, gl in zip("qkv", (q.grad[q0:q1], k.grad[k0:k1], v.grad[k0:k1]), hi_g, lo_g):
            assert_close_tolerance(g[None], gh, gl, factor=3.0, name=f"d{name}[{b}]")


def test_head_dim_512_and_fp64_run():
    check(B=1, sq=130, sk=150, h=2, hk=1, d=512, causal=True)
    q, k, v = (torch.randn(1, 40, 2, 32, device="cuda", dtype=F64) for _ in range(3))
    out, _, _ = flash_attn(q, k, v, causal=True)
    torch.testing.assert_close(out, plain(q, k, v, F64, causal=True))


def test_kernels_run_by_default_on_cuda():
    from culmen.ops.attention import launch

    dev = torch.device("cuda")
    assert launch.use_kernels(dev, BF16, 64)
    try:
        launch.set_kernels_on_gpu(False)  # CULMEN_FLASH_TRITON=0
        assert not launch.use_kernels(dev, BF16, 64)
    finally:
        launch.set_kernels_on_gpu(True)


# ---------------------------------------------------------------------------- the call path


@pytest.fixture
def fresh_plans():
    from culmen.ops.common.plans import clear_plans

    clear_plans()
    yield
    clear_plans()


def _all_launches():
    from culmen.ops.attention.op import PLANS

    las = []
    for plan in PLANS.values():
        las += list(plan._fwd.values())
        for b in plan._bwd.values():
            las += [b.pre, *b.dkdv.values(), b.dq]
    return las


def _varlen_inputs(lens, h=8, hk=2, d=128, seed=3):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)
    n = sum(lens)
    return cu, max(lens), tuple(torch.randn(n, m, d, device="cuda", dtype=BF16, generator=g).requires_grad_()
                                for m in (h, hk, hk))


def _call_path_results(inp, monkeypatch):
    """Dense (dropout, window, GQA) and varlen forward + backward, and a no-grad forward, each run twice
    (the second call of a plan takes the direct launch path)."""
    rng = torch.tensor([0x5EED_4321, 12], dtype=torch.int64, device="cuda")
    monkeypatch.setattr(attn_op, "_rng_state", lambda dp, dev: rng.clone())
    (q, k, v), dout, (cu, mx, (vq, vk, vv)), vdout = inp
    res = []
    for _ in range(2):
        out, lse, _ = flash_attn(q, k, v, 0.1, causal=True, window_size=(300, -1))
        res = [out, lse, *_grads(out, dout, (q, k, v))]
        with torch.no_grad():
            res.append(flash_attn(q, k, v, causal=True)[0])
        vo, vlse, _ = flash_attn_varlen(vq, vk, vv, cu, cu, mx, mx, causal=True)
        res += [vo, vlse, *_grads(vo, vdout, (vq, vk, vv))]
    return res


def test_fast_launch_bitwise(fresh_plans, monkeypatch):
    """The direct launch path (second call of a plan) gives what Triton's own launch gives."""
    from culmen.ops.common.launch import set_fast_launch

    qkv = _inputs(2, 700, 517, 8, 2, 128, BF16)
    lens = [1, 700, 0, 129, 1025, 64]
    vin = _varlen_inputs(lens)
    inp = (qkv, torch.randn_like(qkv[0]), vin, torch.randn_like(vin[2][0]))
    results = {}
    try:
        for mode in (False, True):
            set_fast_launch(mode)  # drops the plans
            results[mode] = _call_path_results(inp, monkeypatch)
            launches = _all_launches()
            assert len(launches) >= 9
            for la in launches:
                if mode:
                    assert la._run is not None, f"{la.fn.__name__} never took the direct path: {la.error}"
                else:
                    assert la._run is None
    finally:
        set_fast_launch(True)
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b)


def test_non_current_device(fresh_plans, monkeypatch):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    qkv = _inputs(2, 300, 257, 4, 2, 64, BF16)
    q1, k1, v1 = (t.detach().to("cuda:1").requires_grad_() for t in qkv)
    dout = torch.randn_like(qkv[0])
    rng = torch.tensor([77, 5], dtype=torch.int64)
    monkeypatch.setattr(attn_op, "_rng_state", lambda dp, dev: rng.to(dev))
    for _ in range(2):  # the second call of each plan launches directly
        o0, _, _ = flash_attn(*qkv, 0.2, causal=True)
        g0 = _grads(o0, dout, qkv)
        o1, _, _ = flash_attn(q1, k1, v1, 0.2, causal=True)
        g1 = _grads(o1, dout.to("cuda:1"), (q1, k1, v1))
    assert torch.cuda.current_device() == 0 and o1.device == torch.device("cuda", 1)
    for a, b in zip((o0, *g0), (o1, *g1)):
        assert torch.equal(a, b.to("cuda:0"))


def _compiled_count(fn) -> int:
    """Kernels Triton holds compiled for ``fn`` in this process (its in-memory JIT cache)."""
    return sum(len(entry[0]) for entry in fn.device_caches.values())


def test_one_compile_per_configuration(fresh_plans):
    """24 random sequence lengths (and batch sizes) between 128 and 2048: each kernel compiles once for
    the dense path and once for the varlen path (the CPU twin: test_attention_specialize.py)."""
    import random

    from culmen.ops.attention import kernels as K
    from culmen.ops.attention import kernels_bwd as KB

    fns = (K._attn_fwd_kernel, KB._attn_bwd_preprocess_kernel, KB._attn_bwd_dkdv_kernel, KB._attn_bwd_dq_kernel)
    rnd = random.Random(7)
    kw = dict(causal=True, window_size=(123, -1), softcap=7.0)  # a configuration no other test compiles
    for phase in ("dense", "varlen"):
        before = [_compiled_count(f) for f in fns]
        for i in range(24):
            s = rnd.randint(128, 2048)
            if phase == "dense":
                q, k, v = _inputs(1 + i % 3, s, rnd.randint(128, 2048), 4, 4, 80, BF16)
                out = flash_attn(q, k, v, **kw)[0]
            else:
                lens = [rnd.randint(1, s) for _ in range(1 + i % 3)]
                cu, mx, (q, k, v) = _varlen_inputs(lens, h=4, hk=4, d=80, seed=i)
                out = flash_attn_varlen(q, k, v, cu, cu, mx, mx, **kw)[0]
            out.backward(torch.randn_like(out))
        new = [_compiled_count(f) - b for f, b in zip(fns, before)]
        # The kernels that depend on the configuration compile exactly once; the backward's preprocess kernel
        # does not depend on it, so an earlier test may already have compiled its one variant.
        msg = f"{phase}: compiles per kernel {dict(zip([f.__name__ for f in fns], new))}"
        assert new[0] == new[2] == new[3] == 1 and new[1] <= 1, msg


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_inductor(dynamic):
    """Under torch.compile (Inductor) the kernels are traced (triton_op + wrap_triton, backward through
    register_autograd): results and gradients equal eager's, no graph break, and with dynamic shapes new
    sequence lengths do not recompile."""
    from culmen.flash_attn import flash_attn_func, flash_attn_varlen_func

    def dense(q, k, v):
        return flash_attn_func(q, k, v, causal=True, window_size=(200, -1))

    def varlen(q, k, v, cu, mx):
        return flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=True)

    def make_dense(s):
        return _inputs(2, s, s + 13, 8, 2, 64, BF16), ()

    def make_varlen(s):
        cu, mx, qkv = _varlen_inputs([s, s // 3, 17], d=64, seed=s)
        return qkv, (cu, mx)

    for fn, make in ((dense, make_dense), (varlen, make_varlen)):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(fn, dynamic=dynamic, fullgraph=True)
        for s in (257, 400, 1000):
            qkv, extra = make(s)
            dout = None
            outs = []
            for f in (fn, compiled):
                o = f(*qkv, *extra)
                dout = torch.randn_like(o) if dout is None else dout
                outs.append((o, *torch.autograd.grad(o, qkv, dout)))
            for e, c in zip(*outs):
                assert c.dtype == e.dtype and c.shape == e.shape
                torch.testing.assert_close(c, e, rtol=1e-2, atol=1e-2)
        if dynamic:
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 1, fn.__name__
