"""``TUNING["tma_dq"]``: the backward whose dK/dV kernel also adds each dQ tile into an fp32 buffer, by one
TMA bulk reduce-add through a per-head tensor descriptor (``desc.atomic_add``) instead of element atomics.

Triton 3.9's CPU interpreter has no descriptor reduce (``InterpreterBuilder.create_descriptor_reduce`` is
missing), so the plan falls back to element atomics there (tested as such). The ``interp_reduce`` fixture
adds the missing builder method (the reduce as a masked fp32 atomic add over the descriptor's in-bounds
elements, which is what the TMA instruction does) so the descriptor path itself (bounds per sequence and
head, GQA heads, odd lengths, padded head dims) runs on CPU. GPU tests (``-m gpu``) run the real TMA reduce.
"""

from __future__ import annotations

import pytest
import torch

import culmen
from culmen.ops.attention import flash_attn, flash_attn_varlen, launch, launch_ws
from culmen.ops.attention import op as attn_op
from culmen.ops.backend import set_backend
from culmen.ops.common.launch import Launch
from culmen.testing import assert_close_tolerance
from culmen.testing.attention import grads as _grads
from tests.ops.test_attention_gpu import check as gpu_check
from tests.ops.test_attention_triton import check


@pytest.fixture
def interp_reduce(monkeypatch):
    """Give the interpreter the descriptor reduce-add it lacks (see the module docstring). Returns a list that
    collects, per reduce, the byte addresses it added into (the in-bounds elements of the tile)."""
    from triton._C.libtriton import ir
    from triton.runtime import interpreter as ti

    writes = []

    def create_descriptor_reduce(self, kind, desc, value, indices):
        assert kind == ir.DESCRIPTOR_REDUCE_KIND.ADD
        ptrs, mask = desc.materialize_pointers(indices)  # elements outside the descriptor's shape: masked off
        writes.append(ptrs.data[mask.data].copy())
        return self.create_atomic_rmw(ir.ATOMIC_OP.FADD, ptrs, value, mask, ir.MEM_SEMANTIC.RELAXED,
                                      ir.MEM_SYNC_SCOPE.GPU)

    monkeypatch.setattr(ti.InterpreterBuilder, "create_descriptor_reduce", create_descriptor_reduce, raising=False)
    return writes


@pytest.fixture
def launches(monkeypatch):
    """``TUNING["tma_dq"]`` on; records ``(kernel, ATOMIC_DQ, TMA_DQ)`` of every launch."""
    monkeypatch.setitem(launch.TUNING, "tma_dq", True)
    seen = []
    real = Launch.__call__

    def spy(self, stream, aligned, *args):
        seen.append((self.fn.__name__, self.meta.get("ATOMIC_DQ"), self.meta.get("TMA_DQ")))
        return real(self, stream, aligned, *args)

    monkeypatch.setattr(Launch, "__call__", spy)
    return seen


def _path(seen) -> str:
    """Which dQ path the recorded backward took: "tma", "atomic" (element atomics) or "kernel" (deterministic)."""
    dkdv = [(a, t) for name, a, t in seen if name == "_attn_bwd_dkdv_kernel"]
    has_dq = any(name == "_attn_bwd_dq_kernel" for name, _, _ in seen)
    assert len(dkdv) == 1, seen
    atomic, tma = dkdv[0]
    assert has_dq == (not atomic), seen  # the dQ kernel runs exactly when dQ is not summed by the dK/dV kernel
    return "tma" if tma else "atomic" if atomic else "kernel"


TMA_CASES = {
    "full_odd": dict(B=2, sq=37, sk=29),
    "causal_gqa": dict(B=1, sq=21, sk=33, h=4, hk=2, causal=True),
    "causal_sq>sk_mqa": dict(B=2, sq=40, sk=9, h=3, hk=1, causal=True),  # rows that see no key: dq = 0
    "d40_window_softcap": dict(B=1, sq=26, sk=35, d=40, window=(7, 3), softcap=3.0),  # BLOCK_D 64 > D
    "seqlen1": dict(B=1, sq=1, sk=1),
}


@pytest.mark.parametrize("case", list(TMA_CASES))
def test_tma_dq_matches_float64(triton_backend, interp_reduce, launches, case):
    check(**TMA_CASES[case])
    assert _path(launches) == "tma"


def test_tma_dq_dropout_and_low_precision(triton_backend, interp_reduce, launches, monkeypatch):
    check(B=2, sq=21, sk=26, h=4, hk=2, causal=True, p=0.3, monkeypatch=monkeypatch)
    assert _path(launches) == "tma"
    launches.clear()
    check(B=1, sq=19, sk=23, h=2, hk=1, d=32, dtype=torch.bfloat16, causal=True, factor=3.0)
    assert _path(launches) == "tma"


def test_tma_dq_varlen_rows_stay_in_their_sequence(triton_backend, interp_reduce, launches, monkeypatch):
    """Per-sequence descriptors: a tile that runs past its sequence must not add into the next one's rows
    (an empty sequence and a length-1 one among blocks of 16). Such rows would only receive zeros (their dS is
    0), invisible in the values, so every reduce's addresses are checked against the fp32 dQ buffer's rows:
    one sequence, one head, head-dim columns only."""
    lq, lk = [5, 0, 23, 1, 17], [9, 3, 20, 1, 30]
    h, hk, d = 4, 2, 24
    cu_q = torch.tensor([0, *lq]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lk]).cumsum(0).to(torch.int32)
    q, dout = torch.randn(sum(lq), h, d), torch.randn(sum(lq), h, d)
    k, v = torch.randn(sum(lk), hk, d), torch.randn(sum(lk), hk, d)
    rng = torch.tensor([0x2468_ACE0, 77], dtype=torch.int64)
    monkeypatch.setattr(attn_op, "_rng_state", lambda dp, dev: rng.clone())

    def run(dt, causal, p):
        ts = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        out = flash_attn_varlen(*ts, cu_q, cu_k, max(lq), max(lk), dropout_p=p, causal=causal)[0]
        out.backward(dout.to(dt))
        return out, [t.grad for t in ts]

    bufs = []
    zeros = torch.zeros

    def spy_zeros(*a, **kw):  # the plan's fp32 dQ accumulator
        t = zeros(*a, **kw)
        if t.dtype == torch.float32 and t.shape == q.shape:
            bufs.append(t)
        return t

    seq = torch.repeat_interleave(torch.arange(len(lq)), torch.tensor(lq))  # the sequence of each packed row
    for causal, p in ((True, 0.0), (False, 0.2)):
        launches.clear()
        interp_reduce.clear()
        with monkeypatch.context() as m:
            m.setattr(torch, "zeros", spy_zeros)
            out, grads = run(torch.float32, causal, p)
        assert _path(launches) == "tma" and len(bufs) == 1 and interp_reduce
        base = bufs.pop().data_ptr()
        for addr in interp_reduce:
            elem = torch.from_numpy((addr - base).astype("int64")) // 4
            assert elem.numel() and (elem >= 0).all() and (elem < q.numel()).all()
            rows, heads, cols = elem // (h * d), elem // d % h, elem % d
            assert (seq[rows] == seq[rows[0]]).all() and (heads == heads[0]).all() and cols.max() < d
        set_backend("reference")
        hi, lo = run(torch.float64, causal, p), run(torch.float32, causal, p)
        set_backend("triton")
        assert_close_tolerance(out, hi[0], lo[0], name="out")
        for name, g, gh, gl in zip("qkv", grads, hi[1], lo[1]):
            assert_close_tolerance(g, gh, gl, name=f"d{name}")


def test_interpreter_without_reduce_falls_back_to_element_atomics(triton_backend, launches):
    """Triton's interpreter (3.9) cannot run descriptor atomic_add: the plan keeps the element atomics."""
    from triton.runtime.interpreter import InterpreterBuilder

    if hasattr(InterpreterBuilder, "create_descriptor_reduce"):
        pytest.fail("this Triton's interpreter has descriptor reduce: run the TMA tests without the shim")
    check(B=1, sq=21, sk=33, h=4, hk=2, causal=True)
    assert _path(launches) == "atomic"


def test_unaligned_head_dim_falls_back(triton_backend, interp_reduce, launches):
    """d = 18: fp32 dQ rows of 72 bytes are not 16-byte aligned, so no descriptor: element atomics."""
    check(B=1, sq=23, sk=19, h=2, hk=1, d=18, causal=True)
    assert _path(launches) == "atomic"


def test_deterministic_never_takes_tma_dq(triton_backend, interp_reduce, launches):
    """flash_attn(deterministic=True) and culmen.set_deterministic(True) both keep the dQ kernel; the TMA path
    gives the same gradients up to summation order."""
    q, k, v = (torch.randn(1, 20, 2, 16, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 20, 2, 16)
    g_tma = _grads(flash_attn(q, k, v, causal=True)[0], dout, (q, k, v))
    assert _path(launches) == "tma"
    launches.clear()
    g_det = _grads(flash_attn(q, k, v, causal=True, deterministic=True)[0], dout, (q, k, v))
    assert _path(launches) == "kernel"
    launches.clear()
    culmen.set_deterministic(True)
    try:
        g_det2 = _grads(flash_attn(q, k, v, causal=True)[0], dout, (q, k, v))
    finally:
        culmen.set_deterministic(False)
    assert _path(launches) == "kernel"
    for a, b, c in zip(g_tma, g_det, g_det2):
        torch.testing.assert_close(a, b)
        assert torch.equal(b, c)


# ---------------------------------------------------------------------------------------------- GPU
GPU_CASES = {
    "d128_causal": dict(B=2, sq=1025, sk=1023, h=4, hk=4, d=128, causal=True),
    "d64_full_odd": dict(B=2, sq=203, sk=113, h=4, hk=4, d=64),
    "gqa4_d128": dict(B=1, sq=517, sk=700, h=8, hk=2, d=128, causal=True),
    "d40_window": dict(B=1, sq=333, sk=257, h=2, hk=1, d=40, window=(50, 10)),
    "d96_softcap_f16": dict(B=1, sq=300, sk=333, h=2, hk=2, d=96, softcap=15.0, dtype=torch.float16),
    "d256": dict(B=1, sq=130, sk=150, h=2, hk=1, d=256, causal=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_tma_dq_matches_float64(launches, case, monkeypatch):
    # the Triton backward's dQ path is under test: the Gluon kernels (Hopper, d128 above their min_sk) stay off
    monkeypatch.setitem(launch_ws.WS_TUNING, "on", False)
    gpu_check(**GPU_CASES[case])
    assert _path(launches) == ("tma" if torch.cuda.get_device_capability()[0] >= 9 else "atomic")


@pytest.mark.gpu
def test_gpu_tma_dq_dropout_and_varlen(launches, monkeypatch):
    gpu_check(B=2, sq=301, sk=517, h=4, hk=2, d=64, causal=True, p=0.17, monkeypatch=monkeypatch)
    lens_q, lens_k = [1, 700, 0, 129, 1025, 64], [5, 700, 3, 200, 1025, 1]
    cu_q = torch.tensor([0, *lens_q], device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lens_k], device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    dout = torch.randn_like(q)
    g_tma = _grads(flash_attn_varlen(q, k, v, cu_q, cu_k, 1025, 1025, causal=True)[0], dout, (q, k, v))
    g_det = _grads(flash_attn_varlen(q, k, v, cu_q, cu_k, 1025, 1025, causal=True, deterministic=True)[0], dout,
                   (q, k, v))
    for name, a, b in zip("qkv", g_tma, g_det):  # same math, another summation order (fp32 sums, bf16 result)
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=f"d{name}")
