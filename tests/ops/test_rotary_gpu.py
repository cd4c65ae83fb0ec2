"""Rotary embedding on a real GPU at real sizes (run by ``scripts/gpu-check``).

Same tolerance rule as ``test_rotary.py``: the kernel's error against the float64 oracle (computed on
the GPU) must be at most 2x PyTorch's own error in the input dtype, plus a small atol, for the
output and the gradient. Covers the Llama shape in both styles, partial rotary with per-batch
offsets, packed sequences, Apex's sbhd / thd / 2-D forms, in-place packed QKV, int64 indexing past
2^31 elements and ``torch.compile`` with inductor.
"""

from __future__ import annotations

import pytest
import torch

from culmen.flash_attn.layers.rotary import apply_rotary_emb, apply_rotary_emb_qkv_
from culmen.ops.rotary import rotary, rotary_emb_ref
from culmen.testing import assert_close_tolerance, randn
from culmen.transformer.functional import (
    fused_apply_rotary_pos_emb,
    fused_apply_rotary_pos_emb_2d,
    fused_apply_rotary_pos_emb_thd,
)

pytestmark = pytest.mark.gpu

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
DEV = torch.device("cuda")


def _tables(rows: int, half: int, dtype=F32, dev=DEV):
    inv = 1.0 / 10000.0 ** (torch.arange(0, 2 * half, 2, device=dev, dtype=F64) / (2 * half))
    f = torch.outer(torch.arange(rows, device=dev, dtype=F64), inv)
    return f.cos().to(dtype), f.sin().to(dtype)


def _check(fn, x, oracle, name):
    xg = x.detach().clone().requires_grad_()
    y = fn(xg)
    g = randn(y.shape, x.dtype, DEV)
    y.backward(g)
    hi, lo = x.detach().to(F64).requires_grad_(), x.detach().clone().requires_grad_()
    y_hi, y_lo = oracle(hi, F64), oracle(lo, x.dtype)
    assert_close_tolerance(y, y_hi, y_lo, name=f"{name} y")
    (d_hi,) = torch.autograd.grad(y_hi, hi, g.to(F64))
    (d_lo,) = torch.autograd.grad(y_lo, lo, g)
    assert_close_tolerance(xg.grad, d_hi, d_lo, name=f"{name} dx")
    return y


def _rows(tab, pos):
    return tab[pos]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_llama_shape(interleaved, dtype):
    B, S, H, D = 4, 4096, 32, 128
    cos, sin = _tables(S, D // 2, dtype)
    x = randn((B, S, H, D), dtype, DEV)
    _check(lambda t: apply_rotary_emb(t, cos, sin, interleaved=interleaved), x,
           lambda t, dt: rotary_emb_ref(t, cos.to(F64), sin.to(F64), interleaved), f"llama {dtype}")


@pytest.mark.parametrize("interleaved", [False, True])
def test_partial_rotary_with_batch_offsets(interleaved):
    B, S, H, D, rd = 3, 2000, 16, 128, 64
    cos, sin = _tables(S + 300, rd // 2)
    offs = torch.tensor([0, 17, 300], device=DEV, dtype=torch.int32)
    pos = torch.arange(S, device=DEV)[None] + offs.long()[:, None]
    x = randn((B, S, H, D), F16, DEV)
    _check(lambda t: rotary(t, cos, sin, seqlen_offsets=offs, interleaved=interleaved), x,
           lambda t, dt: rotary_emb_ref(t, _rows(cos.to(F64), pos), _rows(sin.to(F64), pos), interleaved),
           "partial+offsets")


def test_varlen_packed():
    lens = torch.randint(1, 3000, (12,)).tolist()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    T, H, D = int(cu[-1]), 8, 128
    cos, sin = _tables(max(lens) + 8, D // 2, BF16)
    offs = torch.randint(0, 8, (12,), device=DEV)
    pos = torch.cat([torch.arange(n, device=DEV) + offs[i] for i, n in enumerate(lens)])
    x = randn((T, H, D), BF16, DEV)
    _check(lambda t: rotary(t, cos, sin, seqlen_offsets=offs, cu_seqlens=cu, max_seqlen=max(lens)), x,
           lambda t, dt: rotary_emb_ref(t, _rows(cos.to(F64), pos), _rows(sin.to(F64), pos)), "varlen")


def _apex_oracle(t, cos, sin):
    d2 = cos.shape[-1]
    c, s = cos.to(t.dtype), sin.to(t.dtype)
    x1, x2 = t[..., :d2].chunk(2, -1)
    return torch.cat((t[..., :d2] * c + torch.cat((-x2, x1), -1) * s, t[..., d2:]), -1)


@pytest.mark.parametrize("transpose", [False, True])
def test_apex_sbhd(transpose):
    S, B, H, D = 4096, 2, 32, 128
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2, device=DEV, dtype=F32) / D)
    f = torch.outer(torch.arange(S, device=DEV, dtype=F32), inv)
    freqs = torch.cat((f, f), -1)[:, None, None, :]
    t = randn((S, B, H, D), BF16, DEV)
    y = _check(lambda x: fused_apply_rotary_pos_emb(x, freqs, transpose), t,
               lambda x, dt: _apex_oracle(x, freqs.to(F64).cos(), freqs.to(F64).sin()), "apex sbhd")
    assert (y.transpose(0, 1) if transpose else y).is_contiguous()


def test_apex_thd_and_2d():
    lens = [1000, 37, 2500, 1]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    H, D = 16, 128
    freqs = torch.rand(max(lens), 1, 1, 96, device=DEV) * 100
    pos = torch.cat([torch.arange(n, device=DEV) for n in lens])
    fp = freqs.reshape(-1, 96).to(F64)[pos][:, None, :]
    t = randn((int(cu[-1]), H, D), BF16, DEV)
    _check(lambda x: fused_apply_rotary_pos_emb_thd(x, cu, freqs), t, lambda x, dt: _apex_oracle(x, fp.cos(), fp.sin()),
           "apex thd")

    b, ih, iw, h, d = 2, 32, 48, 16, 64
    ah = torch.rand(1, ih, 1, d // 2, device=DEV, dtype=F64) * 6
    aw = torch.rand(1, iw, 1, d // 2, device=DEV, dtype=F64) * 6
    tabs = [a.to(F32) for a in (ah.cos(), ah.sin(), aw.cos(), aw.sin())]
    r, c = torch.arange(ih * iw, device=DEV) // iw, torch.arange(ih * iw, device=DEV) % iw
    t2 = randn((b, ih * iw, h, d), BF16, DEV)

    def oracle(x, dt):
        top = _apex_oracle(x[..., :d // 2], tabs[0].to(F64)[0, r], tabs[1].to(F64)[0, r])
        return torch.cat((top, _apex_oracle(x[..., d // 2:], tabs[2].to(F64)[0, c], tabs[3].to(F64)[0, c])), -1)

    _check(lambda x: fused_apply_rotary_pos_emb_2d(x, ih, iw, *tabs), t2, oracle, "apex 2d")


def test_inplace_qkv():
    B, S, H, D = 2, 2048, 32, 128
    cos, sin = _tables(S, D // 2, BF16)
    w = randn((B, S, 3, H, D), BF16, DEV, requires_grad=True)
    qkv = w * 1.0
    apply_rotary_emb_qkv_(qkv, cos, sin)
    g = randn(qkv.shape, BF16, DEV)
    qkv.backward(g)
    wr = w.detach().to(F64).requires_grad_()
    rot = [rotary_emb_ref(wr[:, :, i], cos.to(F64), sin.to(F64)) for i in range(2)]
    ref = torch.stack((*rot, wr[:, :, 2]), 2)
    assert_close_tolerance(qkv, ref, None, name="qkv")
    (dref,) = torch.autograd.grad(ref, wr, g.to(F64))
    assert_close_tolerance(w.grad, dref, None, name="dqkv")


def test_int64_indexing_past_2_31_elements():
    B, S, H, D = 2, 65537, 128, 128  # 2.15e9 elements: offsets past 2^31 must not wrap
    cos, sin = _tables(S, D // 2, BF16)
    x = randn((B, S, H, D), BF16, DEV)
    y = rotary(x, cos, sin)
    tail = slice(S - 64, S)
    ref = rotary_emb_ref(x[1:, tail].to(F64), cos[tail].to(F64), sin[tail].to(F64))
    assert_close_tolerance(y[1:, tail], ref, rotary_emb_ref(x[1:, tail], cos[tail], sin[tail]), name="tail")


N_FORMS = 6


def _forms(S_max, D, dev=DEV):
    """The call forms of the family: ``{name: (fn, make)}``; ``make(B, S, H)`` draws fresh inputs
    ``(x, *extra)`` for ``fn(x, *extra)``, which returns the outputs whose gradients the tests take.
    The tables are built once (for sequences up to ``S_max``, on ``dev``): only the inputs change with the
    size. Everything is deterministic but the inputs."""
    from culmen.transformer.functional import fused_apply_rotary_pos_emb_cached

    cos, sin = _tables(S_max + 16, D // 2, BF16, dev)
    cos_k, sin_k = _tables(S_max + 16, D // 2, F32, dev)
    offs = torch.tensor([3, 16], device=dev, dtype=torch.int32)

    def leaf(shape, dtype=BF16):
        return randn(shape, dtype, dev, requires_grad=True)

    def freqs(S):
        inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2, device=dev, dtype=F32) / D)
        f = torch.outer(torch.arange(S, device=dev, dtype=F32), inv)
        return torch.cat((f, f), -1)[:, None, None, :]

    def packed(B, S, H):
        lens = [S - 5, 4][:B]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev, dtype=torch.int32)
        return leaf((int(cu[-1]), H, D)), cu, max(lens)

    def qkv_xpos(w):
        qkv = w * 1.0
        apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, seqlen_offsets=offs)
        return (qkv,)

    def apex_cached(t, f):
        return (fused_apply_rotary_pos_emb_cached(t, f.cos(), f.sin()),)

    return {
        "neox+offsets": (lambda x: (apply_rotary_emb(x, cos, sin, seqlen_offsets=offs),),
                         lambda B, S, H: (leaf((B, S, H, D)),)),
        "gptj-partial": (lambda x: (rotary(x, cos[:, :D // 4], sin[:, :D // 4], interleaved=True, seqlen_offsets=7),),
                         lambda B, S, H: (leaf((B, S, H, D), F16),)),
        "qkv-xpos": (qkv_xpos, lambda B, S, H: (leaf((B, S, 3, H, D)),)),
        "varlen": (lambda x, cu, m: (rotary(x, cos, sin, cu_seqlens=cu, max_seqlen=m),), packed),
        "apex-sbhd-transposed": (lambda t, f: (fused_apply_rotary_pos_emb(t, f, True),),
                                 lambda B, S, H: (leaf((S, B, H, D)), freqs(S))),
        "apex-cached": (apex_cached, lambda B, S, H: (leaf((S, B, H, D)), freqs(S))),
    }


def _fwd_bwd(fn, x, *extra):
    outs = fn(x, *extra)
    gen = torch.Generator(x.device).manual_seed(0)
    cots = [torch.randn(o.shape, generator=gen, device=x.device, dtype=F32).to(o.dtype) for o in outs]
    (dx,) = torch.autograd.grad(outs, (x,), cots)
    return (*[o.detach().clone() for o in outs], dx)


def _all_launches():
    """Every ``Launch`` of every cached rotary plan (the op's and Apex's)."""
    from culmen.ops.rotary.launch import PLANS
    from culmen.transformer.functional.fused_rope import _PLANS

    out = []
    for plan in list(PLANS.values()) + list(_PLANS.values()):
        entries = ([plan._fwd] if plan._fwd is not None else []) + list(plan._bwd.values())
        out += [la for la, _ in entries]
    return out


@pytest.fixture
def fresh_plans():
    from culmen.ops.common.plans import clear_plans

    clear_plans()
    yield
    clear_plans()


def test_fast_launch_bitwise(fresh_plans):
    """The direct launch path (the compiled kernel's C launcher, from the second call of a plan on) gives
    bit for bit what Triton's own launch gives, for every call form, forward and backward."""
    from culmen.ops.common.launch import set_fast_launch

    B, S, H, D = 2, 300, 8, 128
    forms = _forms(S, D)
    assert len(forms) == N_FORMS
    inputs = {name: make(B, S, H) for name, (_, make) in forms.items()}
    results = {}
    try:
        for mode in (False, True):
            set_fast_launch(mode)  # (drops every plan)
            for name, (fn, _) in forms.items():
                results[name, mode] = [_fwd_bwd(fn, *inputs[name]) for _ in range(3)][-1]
            launches = _all_launches()
            assert launches
            for la in launches:
                if mode:
                    assert la._run is not None, f"a rotary launch never took the direct path: {la.error}"
                else:
                    assert la._run is None
    finally:
        set_fast_launch(True)
    for name in forms:
        for a, c in zip(results[name, False], results[name, True]):
            assert torch.equal(a, c), name


def test_non_current_device(fresh_plans):
    """Tensors on a GPU that is not the current one: the plans launch on the tensors' device (Triton's own
    launch there), with results equal to the current device's."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    assert torch.cuda.current_device() == 0
    dev1 = torch.device("cuda", 1)
    forms0, forms1 = _forms(200, 128), _forms(200, 128, dev1)
    for name, (fn0, make) in forms0.items():
        args0 = make(2, 200, 8)
        args1 = [a.detach().to(dev1).requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                 for a in args0]
        r0 = [_fwd_bwd(fn0, *args0) for _ in range(2)][-1]
        r1 = [_fwd_bwd(forms1[name][0], *args1) for _ in range(2)][-1]
        assert torch.cuda.current_device() == 0
        for a, c in zip(r0, r1):
            assert c.device == dev1 and torch.equal(a, c.to(DEV)), name


def test_qkv_is_one_launch_per_direction(fresh_plans):
    """``apply_rotary_emb_qkv_`` rotates Q and K with one launch (also with XPos tables for K)."""
    from torch.profiler import ProfilerActivity, profile

    fn, make = _forms(256, 128)["qkv-xpos"]
    w = make(2, 256, 8)
    _fwd_bwd(fn, *w)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _fwd_bwd(fn, *w)
        torch.cuda.synchronize()
    n = sum(e.count for e in prof.key_averages() if "_rotary_kernel" in e.key)
    assert n == 2, [(e.key, e.count) for e in prof.key_averages()]


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_inductor(dynamic):
    """Under torch.compile (Inductor) the kernel is traced (triton_op + wrap_triton) for every call form:
    results and gradients equal eager's, no graph break (fullgraph), and with dynamic shapes new sequence
    lengths do not recompile."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    H, D = 8, 128
    forms = _forms(130, D)
    compiled = {name: torch.compile(fn, dynamic=dynamic, fullgraph=True) for name, (fn, _) in forms.items()}
    # (Lengths unequal to every other size of the test: dynamo gives equal sizes one symbol, so a length
    # equal to, say, the head dim would be specialized with it.)
    for S in (97, 113, 130):
        for name, (fn, make) in forms.items():
            args = make(2, S, H)
            eager, comp = _fwd_bwd(fn, *args), _fwd_bwd(compiled[name], *args)
            for e, c in zip(eager, comp):
                assert c.dtype == e.dtype and c.shape == e.shape, name
                torch.testing.assert_close(c, e, rtol=0, atol=1e-2, msg=f"{name} S={S}")
    if dynamic:
        # One graph per call form (each is its own frame), none more for a new sequence length.
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= N_FORMS


def test_torch_compile_inplace_no_grad():
    """The mutating op (in place, no autograd: inference with a KV cache) under Inductor, on a view."""
    B, S, H, D = 2, 97, 8, 128
    cos, sin = _tables(S + 8, D // 2, BF16)

    def fn(qkv, offs):
        apply_rotary_emb_qkv_(qkv, cos, sin, seqlen_offsets=offs)
        return qkv

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    base = randn((B, S, 3, H, D), BF16, DEV)
    offs = torch.tensor([0, 8], device=DEV, dtype=torch.int32)
    with torch.no_grad():
        want, got = fn(base.clone(), offs), compiled(base.clone(), offs)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2)
    assert torch.equal(got[:, :, 2], base[:, :, 2])  # V untouched


def test_repeated_calls_fast_launch():
    """From the second call of a signature on, the plan and the compiled kernel are reused (direct
    launch): every call, forward and backward, must still match the oracle, with new data, new
    offsets, another pointer alignment and the sbhd (seq_first) path."""
    B, S, H, D = 2, 1000, 8, 128
    cos, sin = _tables(S + 16, D // 2, BF16)
    for i, offs in enumerate((0, 16, 1)):
        pos = torch.arange(S, device=DEV) + offs
        _check(lambda t, offs=offs: apply_rotary_emb(t, cos, sin, seqlen_offsets=offs), randn((B, S, H, D), BF16, DEV),
               lambda t, dt, pos=pos: rotary_emb_ref(t, _rows(cos.to(F64), pos), _rows(sin.to(F64), pos)),
               f"repeat {i}")
    n = B * S * H * D
    buf = randn((n + 8,), BF16, DEV)
    for start in (8, 1, 8, 1):  # 16-byte aligned, misaligned, then each again (cached)
        x = buf[start:start + n].view(B, S, H, D)
        y = apply_rotary_emb(x, cos, sin, seqlen_offsets=5)
        pos = torch.arange(S, device=DEV) + 5
        ref = rotary_emb_ref(x.to(F64), _rows(cos.to(F64), pos), _rows(sin.to(F64), pos))
        assert_close_tolerance(y, ref, rotary_emb_ref(x, _rows(cos, pos), _rows(sin, pos)), name=f"start {start}")
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2, device=DEV, dtype=F32) / D)
    f = torch.outer(torch.arange(S, device=DEV, dtype=F32), inv)
    freqs = torch.cat((f, f), -1)[:, None, None, :]
    for transpose in (False, False, True, True):
        t = randn((S, B, H, D), BF16, DEV)
        _check(lambda x, tr=transpose: fused_apply_rotary_pos_emb(x, freqs, tr), t,
               lambda x, dt: _apex_oracle(x, freqs.to(F64).cos(), freqs.to(F64).sin()), f"apex {transpose}")
