"""``culmen.ops.rotary`` against a float64 oracle, on the reference path and the Triton interpreter.

Tolerance rule (DESIGN.md): the op's error against ``rotary_emb_ref`` on float64 copies must be at
most 2x the error of ``rotary_emb_ref`` run by PyTorch in the inputs' dtype (tables cast to it), plus
a small atol; for the output and for the gradient of x. New outputs are poisoned with NaN, so an
element the kernel forgets fails the check.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import triton
import triton.language as tl

from culmen.ops.backend import set_backend
from culmen.ops.rotary import rotary, rotary_emb_ref
from culmen.ops.rotary.kernels import _round_to
from culmen.testing import assert_close_tolerance, make_noncontiguous, poison_, poisoned_allocations, randn

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64


@pytest.fixture(params=["reference", "triton"])
def backend(request):
    request.getfixturevalue(f"{request.param}_backend")
    return request.param


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every output buffer the ops allocate (``torch.empty`` / ``empty_like`` / ``empty_strided``) starts
    as NaN."""
    strided = torch.empty_strided
    monkeypatch.setattr(torch, "empty_strided", lambda *a, **k: poison_(strided(*a, **k)))
    with poisoned_allocations():
        yield


def _tables(rows: int, width: int, dtype=F32) -> tuple[torch.Tensor, torch.Tensor]:
    """Angle tables like a model's (arbitrary angles, not only multiples of a base frequency)."""
    ang = torch.rand(rows, width, dtype=F64) * 6.3
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _per_token(tab: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rows ``tab[pos]`` for positions ``pos`` ``(B, S)``; positions past the table rotate by 0."""
    ok = (pos >= 0) & (pos < tab.shape[0])
    rows = tab[pos.clamp(0, tab.shape[0] - 1)]
    return rows, ok


def _oracle(x, cos, sin, pos, interleaved, full_table, dtype):
    """``rotary_emb_ref`` in ``dtype`` with per-token tables (identity rows outside the table)."""
    c, ok = _per_token(cos, pos)
    s, _ = _per_token(sin, pos)
    c = torch.where(ok[..., None], c.to(dtype), 1.0)
    s = torch.where(ok[..., None], s.to(dtype), 0.0)
    return rotary_emb_ref(x.to(dtype), c, s, interleaved, full_table)


def _check_fwd_bwd(fn, x, oracle, name=""):
    """Output and dx of ``fn(x)`` against ``oracle(x_any_dtype, dtype)`` under the tolerance rule."""
    xg = x.detach().clone().requires_grad_()
    y = fn(xg)
    g = randn(y.shape, x.dtype)
    y.backward(g)
    hi_x = x.detach().to(F64).requires_grad_()
    lo_x = x.detach().clone().requires_grad_()
    y_hi, y_lo = oracle(hi_x, F64), oracle(lo_x, x.dtype)
    assert_close_tolerance(y, y_hi, y_lo, name=f"{name} y")
    (dx_hi,) = torch.autograd.grad(y_hi, hi_x, g.to(F64))
    (dx_lo,) = torch.autograd.grad(y_lo, lo_x, g)
    assert_close_tolerance(xg.grad, dx_hi, dx_lo, name=f"{name} dx")
    return y


@dataclass(frozen=True)
class Case:
    shape: tuple[int, int, int, int]  # (B, S, H, D)
    rotary_dim: int
    dtype: torch.dtype = F32
    interleaved: bool = False
    full_table: bool = False
    offsets: str = "0"  # "0", an int, or "tensor"
    layout: str = ""  # "", "pad" (padded head rows), "sbhd" (memory laid out seq-first)

    def __str__(self) -> str:
        dt = {F32: "f32", F16: "f16", BF16: "bf16"}[self.dtype]
        parts = ["x".join(map(str, self.shape)), f"rd{self.rotary_dim}", dt]
        parts += ["gptj"] if self.interleaved else []
        parts += ["full"] if self.full_table else []
        parts += [f"off{self.offsets}"] if self.offsets != "0" else []
        parts += [self.layout] if self.layout else []
        return "-".join(parts)


CASES = [
    Case((2, 7, 3, 16), 16),
    Case((2, 7, 3, 16), 16, interleaved=True),
    Case((1, 5, 3, 24), 10, dtype=BF16),  # partial rotary, non-power-of-2 widths
    Case((2, 6, 5, 20), 12, dtype=F16, interleaved=True, offsets="3"),
    Case((3, 4, 2, 16), 8, dtype=BF16, full_table=True, offsets="tensor"),
    Case((2, 5, 3, 12), 12, interleaved=True, full_table=True, layout="pad"),
    Case((2, 9, 4, 32), 24, dtype=BF16, layout="sbhd", offsets="2"),
    Case((1, 1, 1, 2), 2),  # the smallest rotation
]


def _layout(x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "pad":
        out = make_noncontiguous(x, pad=5)
    elif how == "sbhd":
        out = x.transpose(0, 1).contiguous().transpose(0, 1)
    else:
        return x
    assert not out.is_contiguous()
    return out


@pytest.mark.parametrize("case", CASES, ids=str)
def test_tolerance_rule(backend, case):
    B, S, H, D = case.shape
    W = case.rotary_dim if case.full_table else case.rotary_dim // 2
    rows = S + 6
    cos, sin = _tables(rows, W)
    if case.offsets == "tensor":
        offs = torch.randint(0, 7, (B,), dtype=torch.int32)
        pos = torch.arange(S)[None] + offs.long()[:, None]
    else:
        offs = int(case.offsets)
        pos = (torch.arange(S) + offs)[None].expand(B, S)
    x = _layout(randn(case.shape, case.dtype), case.layout)

    def fn(t):
        return rotary(t, cos, sin, seqlen_offsets=offs, interleaved=case.interleaved, full_table=case.full_table)

    def oracle(t, dt):
        return _oracle(t, cos.to(F64), sin.to(F64), pos, case.interleaved, case.full_table, dt)

    y = _check_fwd_bwd(fn, x, oracle, str(case))
    assert y.shape == x.shape and y.dtype == x.dtype


def test_positions_past_the_table_pass_through(backend):
    """Per-batch offsets that run past the table: those positions are not rotated (flash_attn's rule)."""
    B, S, H, D = 2, 6, 2, 8
    cos, sin = _tables(8, D // 2)
    offs = torch.tensor([0, 5])
    x = randn((B, S, H, D))
    y = rotary(x, cos, sin, seqlen_offsets=offs)
    pos = torch.arange(S)[None] + offs[:, None]
    ref = _oracle(x.to(F64), cos.to(F64), sin.to(F64), pos, False, False, F64)
    assert_close_tolerance(y, ref, None)
    torch.testing.assert_close(y[1, 3:], x[1, 3:])  # positions 8..10 >= 8 rows


def test_varlen(backend):
    """Packed sequences: positions restart at each cu_seqlens entry (+ a per-sequence offset)."""
    lens = [5, 1, 7, 3]
    H, D, rd = 3, 20, 12
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    T = int(cu[-1])
    cos, sin = _tables(12, rd // 2)
    for offs, interleaved in ((0, False), (torch.tensor([1, 0, 2, 4]), True)):
        pos = torch.cat([torch.arange(n) + (offs[i] if isinstance(offs, torch.Tensor) else offs)
                         for i, n in enumerate(lens)])
        x = randn((T, H, D), BF16)

        def fn(t, offs=offs, interleaved=interleaved):
            return rotary(t, cos, sin, seqlen_offsets=offs, cu_seqlens=cu, max_seqlen=max(lens),
                          interleaved=interleaved)

        def oracle(t, dt, pos=pos, interleaved=interleaved):
            return _oracle(t[None], cos.to(F64), sin.to(F64), pos[None], interleaved, False, dt)[0]

        _check_fwd_bwd(fn, x, oracle, f"varlen offs={offs}")


def test_two_d(backend):
    """The 2-D form: columns [0, D/2) at the patch row, [D/2, D) at the patch column (full tables)."""
    B, ih, iw, H, D = 2, 3, 4, 2, 16
    S = ih * iw
    ch, sh = _tables(ih + 1, D // 2)
    cw, sw = _tables(iw + 2, D // 2)
    x = randn((B, S, H, D))
    r, c = torch.arange(S) // iw, torch.arange(S) % iw

    def fn(t):
        return rotary(t, ch, sh, cos2=cw, sin2=sw, full_table=True, img_w=iw)

    def oracle(t, dt):
        a = _oracle(t[..., :D // 2], ch.to(F64), sh.to(F64), r[None].expand(B, S), False, True, dt)
        b = _oracle(t[..., D // 2:], cw.to(F64), sw.to(F64), c[None].expand(B, S), False, True, dt)
        return torch.cat((a, b), -1)

    _check_fwd_bwd(fn, x, oracle, "2d")


@pytest.mark.parametrize("interleaved", [False, True])
def test_inplace_and_conjugate(backend, interleaved):
    """In place: the same tensor back, pass-through columns untouched; conjugate undoes the rotation;
    gradients flow through an in-place rotation of a view."""
    B, S, H, D, rd = 2, 5, 3, 14, 8
    cos, sin = _tables(S, rd // 2)
    base = randn((B, S, H + 1, D))
    x = base[:, :, 1:]  # a strided view
    keep = x[..., rd:].clone()
    want = rotary(x, cos, sin, interleaved=interleaved)
    out = rotary(x, cos, sin, interleaved=interleaved, inplace=True)
    assert out is x
    torch.testing.assert_close(x, want, rtol=0, atol=0)
    assert torch.equal(x[..., rd:], keep)
    back = rotary(x, cos, sin, interleaved=interleaved, conjugate=True)
    torch.testing.assert_close(back[..., rd:], keep, rtol=0, atol=0)

    # Autograd through an in-place rotation of a view of a non-leaf.
    leaf = randn((B, S, H + 1, D), requires_grad=True)
    h = leaf * 1.0
    rotary(h[:, :, 1:], cos, sin, interleaved=interleaved, inplace=True)
    g = randn(h.shape)
    h.backward(g)
    ref_leaf = leaf.detach().to(F64).requires_grad_()
    pos = torch.arange(S)[None].expand(B, S)
    rot = _oracle(ref_leaf[:, :, 1:], cos.to(F64), sin.to(F64), pos, interleaved, False, F64)
    ref = torch.cat((ref_leaf[:, :, :1], rot), 2)
    (dref,) = torch.autograd.grad(ref, ref_leaf, g.to(F64))
    assert_close_tolerance(leaf.grad, dref, None, name="dleaf")


def test_repeated_calls_reuse_the_plan(backend):
    """The second call with the same metadata skips the checks (cached plan): per-call values (offsets,
    data, non-unit-stride tables) must still be honoured, and a bad offset still raises."""
    B, S, H, D, rd = 2, 5, 3, 12, 8
    cos_w, sin_w = _tables(S + 4, rd)  # every other column: non-unit column stride
    cos, sin = cos_w[:, ::2], sin_w[:, ::2]
    assert cos.stride(1) == 2
    for offs in (0, 3, 4):
        x = randn((B, S, H, D), BF16)
        y = rotary(x, cos, sin, seqlen_offsets=offs)
        pos = (torch.arange(S) + offs)[None].expand(B, S)
        ref = _oracle(x.to(F64), cos.to(F64), sin.to(F64), pos, False, False, F64)
        lo = _oracle(x, cos.to(F64), sin.to(F64), pos, False, False, BF16)
        assert_close_tolerance(y, ref, lo, name=f"offset {offs}")
    with pytest.raises(ValueError, match=r"5 \+ 5"):
        rotary(x, cos, sin, seqlen_offsets=5)
    for _ in range(2):  # in place, twice: rotates twice
        z = x.clone()
        v = z._version
        assert rotary(z, cos, sin, inplace=True) is z
        assert z._version > v
    torch.testing.assert_close(z, rotary(x, cos, sin), rtol=0, atol=0)


def test_tables_and_offsets_of_any_strides(backend):
    """cos and sin with different row strides (one a slice of a wider table), and a strided offsets
    tensor: the plan copies what the kernel cannot address, on every call."""
    B, S, H, D, rd = 3, 5, 2, 8, 8
    c_full, s_full = _tables(S + 6, rd)
    cos, sin = c_full[:, : rd // 2], s_full.contiguous()[:, : rd // 2].contiguous()
    assert cos.stride(0) != sin.stride(0)
    offs_buf = torch.tensor([1, 9, 0, 9, 4, 9], dtype=torch.int32)
    offs = offs_buf[::2]
    assert offs.stride(0) == 2
    pos = torch.arange(S)[None] + offs.long()[:, None]
    for _ in range(2):  # the plan, then the cached plan
        x = randn((B, S, H, D), BF16)
        y = rotary(x, cos, sin, seqlen_offsets=offs)
        ref = _oracle(x.to(F64), cos.to(F64), sin.to(F64), pos, False, False, F64)
        lo = _oracle(x, cos.to(F64), sin.to(F64), pos, False, False, BF16)
        assert_close_tolerance(y, ref, lo, name="strided tables")


@pytest.mark.parametrize("layout", ["like", "contiguous", "swap01"])
def test_seq_first(backend, layout):
    """``seq_first`` (S, B, H, D) input equals the (B, S, H, D) computation on the transposed view; the
    output layouts are in x's own dim order."""
    S, B, H, D = 6, 3, 2, 16
    cos, sin = _tables(S, D)
    base = randn((S, B, H + 1, D))
    x = base[:, :, 1:]  # strided
    y = rotary(x, cos, sin, full_table=True, out_layout=layout, seq_first=True)
    want = rotary(x.transpose(0, 1), cos, sin, full_table=True).transpose(0, 1)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    if layout == "contiguous":
        assert y.is_contiguous()
    elif layout == "swap01":
        assert y.transpose(0, 1).is_contiguous()
    xg = x.detach().clone().requires_grad_()
    g = randn(y.shape)
    rotary(xg, cos, sin, full_table=True, out_layout=layout, seq_first=True).backward(g)
    xr = x.detach().transpose(0, 1).clone().requires_grad_()
    rotary(xr, cos, sin, full_table=True).backward(g.transpose(0, 1))
    torch.testing.assert_close(xg.grad, xr.grad.transpose(0, 1), rtol=0, atol=0)


def test_empty(backend):
    cos, sin = _tables(4, 4)
    x = torch.empty((0, 4, 2, 8))
    assert rotary(x, cos, sin).shape == x.shape
    cu = torch.tensor([0], dtype=torch.int32)
    assert rotary(torch.empty((0, 2, 8)), cos, sin, cu_seqlens=cu, max_seqlen=0).shape == (0, 2, 8)


@pytest.mark.parametrize("compile_backend", ["reference", "triton"])
def test_torch_compile_fullgraph(compile_backend, compile_fusion, monkeypatch):
    set_backend(compile_backend)
    torch._dynamo.reset()
    B, S, H, D = 2, 5, 2, 12
    cos, sin = _tables(S + 2, 4)
    offs = torch.tensor([0, 2])

    def fn(x, q):
        y = rotary(x, cos, sin, seqlen_offsets=offs, interleaved=True)
        h = q * 2.0
        rotary(h, cos, sin, seqlen_offsets=1, inplace=True)  # in place, with autograd
        with torch.no_grad():
            z = x.detach().clone()
            rotary(z, cos, sin, inplace=True)  # in place, no autograd (the mutating op)
        return y, h, z

    x, q = randn((B, S, H, D), requires_grad=True), randn((B, S, H, D), requires_grad=True)
    gy, gh = randn((B, S, H, D)), randn((B, S, H, D))

    def run(f):
        y, h, z = f(x, q)
        return (y, h, z, *torch.autograd.grad((y * gy).sum() + (h * gh).sum(), (x, q)))

    eager = run(fn)
    comp = run(torch.compile(fn, fullgraph=True, backend="aot_eager"))
    for e, c, name in zip(eager, comp, ("y", "h", "z", "dx", "dq")):
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6, msg=name)
    explained = torch._dynamo.explain(fn)(x, q)
    assert explained.graph_break_count == 0


@pytest.mark.parametrize("compile_backend", ["reference", "triton"])
def test_torch_compile_qkv_varlen_apex(compile_backend, compile_fusion):
    """The API forms under torch.compile (fullgraph): packed QKV with XPos keys (one op for both head
    groups, in place with autograd), packed sequences, and Apex's sbhd RoPE with angle tables."""
    from culmen.flash_attn.layers.rotary import apply_rotary_emb_qkv_
    from culmen.transformer.functional import fused_apply_rotary_pos_emb

    set_backend(compile_backend)
    torch._dynamo.reset()
    B, S, H, D = 2, 5, 2, 8
    cos, sin = _tables(S, D // 2)
    cos_k, sin_k = _tables(S, D // 2)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    freqs = torch.rand(S, 1, 1, D) * 5

    def fn(w, t, p):
        qkv = w * 1.0
        apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k)
        packed = rotary(t, cos, sin, cu_seqlens=cu, max_seqlen=4)
        return qkv, packed, fused_apply_rotary_pos_emb(p, freqs, True)

    w = randn((B, S, 3, H, D), requires_grad=True)
    t = randn((7, H, D), requires_grad=True)
    p = randn((S, B, H, D), requires_grad=True)
    cots = [randn(s) for s in ((B, S, 3, H, D), (7, H, D), (S, B, H, D))]

    def run(f):
        outs = f(w, t, p)
        loss = sum((o * c).sum() for o, c in zip(outs, cots))
        return (*outs, *torch.autograd.grad(loss, (w, t, p)))

    eager = run(fn)
    comp = run(torch.compile(fn, fullgraph=True, backend="aot_eager"))
    for e, c, name in zip(eager, comp, ("qkv", "packed", "apex", "dw", "dt", "dp")):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5, msg=name)


def test_bad_input():
    cos, sin = _tables(8, 4)
    x = randn((2, 4, 2, 8))
    with pytest.raises(TypeError, match="x must be a floating-point"):
        rotary(x.to(torch.int32), cos, sin)
    with pytest.raises(ValueError, match=r"rotary_dim \(10\) must be <= headdim \(8\)"):
        rotary(x, *_tables(8, 5))
    with pytest.raises(ValueError, match="must be even"):
        rotary(x, *_tables(8, 5), full_table=True)
    with pytest.raises(ValueError, match="same shape"):
        rotary(x, cos, sin[:, :2])
    with pytest.raises(ValueError, match=r"5 \+ 4"):
        rotary(x, cos, sin, seqlen_offsets=5)
    with pytest.raises(ValueError, match=r"shape \(batch,\) = \(2,\)"):
        rotary(x, cos, sin, seqlen_offsets=torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="seqlen_offsets"):
        rotary(x, cos, sin, seqlen_offsets=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="batch, seqlen, nheads, headdim"):
        rotary(x[0], cos, sin)
    with pytest.raises(ValueError, match="needs max_seqlen"):
        rotary(x[0], cos, sin, cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D int32/int64"):
        rotary(x[0], cos, sin, cu_seqlens=torch.tensor([0.0, 4.0]), max_seqlen=4)
    with pytest.raises(ValueError, match="out_layout"):
        rotary(x, cos, sin, out_layout="bshd")
    with pytest.raises(ValueError, match="need a 5-D x or nheads_q"):
        rotary(x, cos, sin, cos_k=cos, sin_k=sin)
    with pytest.raises(ValueError, match="cos_k and sin_k"):
        rotary(randn((2, 4, 2, 2, 8)), cos, sin, cos_k=cos)
    with pytest.raises(ValueError, match=r"\(batch, seqlen, 2, nheads, headdim\)"):
        rotary(randn((2, 4, 3, 2, 8)), cos, sin)
    with pytest.raises(ValueError, match=r"nheads_q must lie in \[1, nheads\)"):
        rotary(x, cos, sin, cos_k=cos, sin_k=sin, nheads_q=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_round_to_matches_torch_casts(triton_backend, dtype):
    """The kernel's 16-bit rounding (done on the bits, see ``_round_to``) equals PyTorch's fp32 -> 16-bit
    cast for normal, subnormal, overflowing, signed-zero, inf and NaN values."""
    g = torch.Generator().manual_seed(3)
    special = torch.tensor([65504.0, 65519.0, 65520.0, 65536.0, -65520.0, 3.0e38, 0.0, -0.0, float("inf"),
                            float("-inf"), float("nan"), 2.0 ** -14, 2.0 ** -24, 3 * 2.0 ** -25, 2.0 ** -25,
                            -(2.0 ** -26), 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11])
    x = torch.cat([torch.randn(4096, generator=g) * s for s in (1.0, 1e-5, 1e-7, 7e4)] + [special])
    y = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(),
                                                   DT=tl.float16 if dtype == torch.float16 else tl.bfloat16, BLOCK=1024)
    ref = x.to(dtype).float()
    same = (y.view(torch.int32) == ref.view(torch.int32)) | (y.isnan() & ref.isnan())
    assert same.all(), f"{int((~same).sum())} values differ, e.g. {x[~same][:4].tolist()}"


@triton.jit
def _round_kernel(X, Y, n, DT: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(Y + o, _round_to(tl.load(X + o, mask=m), DT), mask=m)
