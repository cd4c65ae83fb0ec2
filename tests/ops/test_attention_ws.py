"""The warp-specialized Gluon forward and backward (``kernels_ws.py``, ``kernels_ws_bwd.py``, ``launch_ws.py``).

On CPU: which calls they take (everything else keeps the Triton kernels; the backward also needs
non-deterministic mode) and that both kernels compile for sm_90 in every shipped configuration with their
register spills bounded (Triton's bundled ptxas, no GPU needed). On a Hopper GPU: flash_attn's rule against a
float64 oracle (output 2x, gradients 3x the error of the same math in the input precision), odd shapes, GQA,
causal with ``sq < sk``, a packed-qkv view, the persistent grids with several tiles per program and partial
L2 groups, agreement with the Triton kernels, and the deterministic switch taking the Triton backward.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from culmen.ops.attention import flash_attn, kernels_ws, launch_ws
from culmen.ops.attention import launch as attn_launch
from culmen.ops.attention.tma import nvidia_hopper
from culmen.ops.common.plans import clear_plans
from culmen.testing import assert_close_tolerance
from culmen.testing.attention import grads as _grads
from culmen.testing.attention import plain

BF16, F16, F64 = torch.bfloat16, torch.float16, torch.float64


@pytest.fixture(autouse=True)
def _no_work_floor(monkeypatch):
    """The Gluon forward at any size: these tests' shapes are far below ``WS_TUNING["min_work"]``
    (``test_small_calls_keep_the_triton_forward`` checks the floor itself)."""
    monkeypatch.setitem(launch_ws.WS_TUNING, "min_work", {})


def _cfg(q, k, v, causal=False, extras=False):
    return launch_ws.ws_config(q, k, v, causal=causal, extras=extras, on_gpu=True, hopper=True)


def _t(B, s, h, d, dtype=BF16):
    return torch.empty(B, s, h, d, dtype=dtype)


def test_eligible_calls_get_the_tuned_tile():
    q, k = _t(2, 100, 8, 128), _t(2, 100, 2, 128)
    assert _cfg(q, k, k) == launch_ws.WS_TUNING["tiles"][(128, False)]
    assert _cfg(q, k, k, causal=True) == launch_ws.WS_TUNING["tiles"][(128, True)]
    q64 = _t(1, 7, 4, 64, F16)
    assert _cfg(q64, q64, q64, causal=True) == launch_ws.WS_TUNING["tiles"][(64, True)]
    # q as the head slice of a packed (B, s, h + 2 hk, d) projection: batches and heads still packed
    qkv = _t(2, 33, 12, 64)
    assert _cfg(qkv[:, :, :8], qkv[:, :, 8:10], qkv[:, :, 10:]) is not None


def test_long_keys_switch_the_tile(monkeypatch):
    """``tiles_long``: from its key count on (not below), the causal call gets the long-sequence tile; calls
    without the mask keep theirs."""
    monkeypatch.setitem(launch_ws.WS_TUNING, "tiles_long", {(128, True): (1000, (64, 3, 3, True))})
    short, at = _t(1, 999, 2, 128), _t(1, 1000, 2, 128)
    assert _cfg(short, short, short, causal=True) == launch_ws.WS_TUNING["tiles"][(128, True)]
    assert _cfg(at, at, at, causal=True) == (64, 3, 3, True)
    assert _cfg(short[:, :10], at, at, causal=True) == (64, 3, 3, True)  # keys decide, not queries
    assert _cfg(at, at, at) == launch_ws.WS_TUNING["tiles"][(128, False)]


def test_small_calls_keep_the_triton_forward(monkeypatch):
    floor = {(64, True): 1 << 28, (64, False): 1 << 30}
    monkeypatch.setitem(launch_ws.WS_TUNING, "min_work", floor)
    small, large = _t(8, 1024, 12, 64), _t(8, 2048, 32, 64)  # B*h*sq*sk: 2^30 * 3/32 and 2^30
    assert _cfg(small, small, small, causal=True) is None
    assert _cfg(small, small, small) is None
    assert _cfg(large, large, large, causal=True) == launch_ws.WS_TUNING["tiles"][(64, True)]
    assert _cfg(large, large, large) == launch_ws.WS_TUNING["tiles"][(64, False)]
    # the floor counts keys: one query row over a long cache is little work
    q1, kl = _t(4, 1, 32, 64), _t(4, 1 << 20, 32, 64)
    assert _cfg(q1, kl, kl) is None
    # d128 has no floor; the backward asks without it (it has its own min_sk)
    q128 = _t(1, 7, 4, 128)
    assert _cfg(q128, q128, q128, causal=True) == launch_ws.WS_TUNING["tiles"][(128, True)]
    assert launch_ws.ws_config(small, small, small, causal=True, extras=False, on_gpu=True, hopper=True,
                               min_work=False) is not None
    # FP8 keeps its own tiles and no floor
    if launch_ws._FP8 is not None and launch_ws.WS_TUNING["fp8"]:
        f8 = _t(1, 64, 4, 64, launch_ws._FP8)
        assert _cfg(f8, f8, f8) == launch_ws.WS_TUNING["tiles_fp8"][(64, False)]


@pytest.mark.parametrize("case", ["fp32", "d96", "dv", "causal_sq_gt_sk", "extras", "cpu", "off", "heads_strided",
                                  "batch_strided", "transposed", "empty", "mixed_dtype"])
def test_ineligible_calls_keep_the_triton_forward(case, monkeypatch):
    q = k = v = _t(2, 64, 4, 64)
    kw = dict(causal=False, extras=False, on_gpu=True, hopper=True)
    if case == "fp32":
        q = k = v = _t(2, 64, 4, 64, torch.float32)
    elif case == "d96":
        q = k = v = _t(2, 64, 4, 96)
    elif case == "dv":
        v = _t(2, 64, 4, 128)
    elif case == "causal_sq_gt_sk":
        q, kw["causal"] = _t(2, 65, 4, 64), True
    elif case == "extras":
        kw["extras"] = True
    elif case == "cpu":
        kw["hopper"] = False
    elif case == "off":
        monkeypatch.setitem(launch_ws.WS_TUNING, "on", False)
    elif case == "heads_strided":
        q = _t(2, 64, 4, 128)[..., :64]
    elif case == "batch_strided":
        q = _t(3, 64, 4, 64)[::2]
    elif case == "transposed":
        q = torch.empty(2, 4, 64, 64, dtype=BF16).transpose(1, 2)
    elif case == "empty":
        q = _t(2, 0, 4, 64)
    elif case == "mixed_dtype":
        k = _t(2, 64, 4, 64, F16)
    assert launch_ws.ws_config(q, k, v, **kw) is None


def test_fp8_forward_is_a_switch(monkeypatch):
    """float8 Q/K/V take the Gluon forward only with ``WS_TUNING["fp8"]`` (on since measured on the H100), with
    their own tiles, and only when the transposed V copy's rows (one byte a key) are 16-byte aligned."""
    f8 = torch.float8_e4m3fn
    q, k = _t(2, 100, 8, 128, f8), _t(2, 128, 2, 128, f8)
    monkeypatch.setitem(launch_ws.WS_TUNING, "fp8", False)
    assert _cfg(q, k, k) is None
    monkeypatch.setitem(launch_ws.WS_TUNING, "fp8", True)
    assert _cfg(q, k, k) == launch_ws.WS_TUNING["tiles_fp8"][(128, False)]
    assert _cfg(q, k, k, causal=True) == launch_ws.WS_TUNING["tiles_fp8"][(128, True)]
    k_odd = _t(2, 120, 2, 128, f8)
    assert _cfg(q, k_odd, k_odd) is None
    # V is read through its contiguous transposed copy: its own layout does not matter
    v_strided = torch.empty(2, 128, 2, 256, dtype=f8)[..., :128]
    assert _cfg(q, k, v_strided) is not None
    assert _cfg(q, k, _t(2, 128, 2, 128)) is None  # mixed dtypes


def test_plans_on_cpu_never_take_it():
    q = torch.randn(1, 16, 2, 64, dtype=BF16)
    plan = attn_launch.AttnPlan("dense", q, q, q, None)
    assert plan.ws is None and plan.ws_bwd is None


def _bwd_cfg(q, k, v, causal=False, extras=False):
    return launch_ws.ws_bwd_config(q, k, v, causal=causal, extras=extras, on_gpu=True, hopper=True)


def test_backward_takes_the_forwards_calls(monkeypatch):
    q, k = _t(2, 100, 8, 128), _t(2, 100, 2, 128)
    persistent = launch_ws.WS_BWD_TUNING["persistent"]
    assert _bwd_cfg(q, k, k) == (*launch_ws.WS_BWD_TUNING["tiles"][128], persistent)
    assert _bwd_cfg(q, k, k, causal=True) == (*launch_ws.WS_BWD_TUNING["tiles"][128], persistent)
    q64 = _t(1, 2048, 4, 64, F16)
    assert _bwd_cfg(q64, q64, q64) == (*launch_ws.WS_BWD_TUNING["tiles"][64], persistent)
    # the switch as it is when the forward plans the call travels with the tile
    monkeypatch.setitem(launch_ws.WS_BWD_TUNING, "persistent", not persistent)
    assert _bwd_cfg(q, k, k)[2] == (not persistent)
    monkeypatch.setitem(launch_ws.WS_BWD_TUNING, "persistent", persistent)
    # d256: the Gluon forward without the causal mask, never the Gluon backward
    q256 = _t(1, 300, 2, 256)
    assert _cfg(q256, q256, q256) is not None and _cfg(q256, q256, q256, causal=True) is None
    assert _bwd_cfg(q256, q256, q256) is None
    # d64 below min_sk keys keeps the Triton backward (as fast there)
    n = launch_ws.WS_BWD_TUNING["min_sk"][64]
    short, at = _t(1, n - 1, 4, 64, F16), _t(1, n, 4, 64, F16)
    assert _bwd_cfg(short, short, short) is None
    assert _bwd_cfg(at, at, at) is not None
    # whatever the forward refuses, the backward refuses too
    assert _bwd_cfg(q, k, k, extras=True) is None
    assert _bwd_cfg(_t(2, 65, 4, 64), _t(2, 64, 4, 64), _t(2, 64, 4, 64), causal=True) is None
    assert _bwd_cfg(_t(2, 64, 4, 96), _t(2, 64, 4, 96), _t(2, 64, 4, 96)) is None
    monkeypatch.setitem(launch_ws.WS_BWD_TUNING, "on", False)
    assert _bwd_cfg(q, k, k) is None


@pytest.mark.skipif(not kernels_ws.AVAILABLE, reason="this Triton has no Gluon")
def test_q_buffers_double_only_where_they_fit(monkeypatch):
    monkeypatch.setitem(launch_ws.WS_TUNING, "q_double", False)
    assert launch_ws.q_buffers(64, (64, 3, 3, True)) == 1
    monkeypatch.setitem(launch_ws.WS_TUNING, "q_double", True)
    assert launch_ws.q_buffers(128, (64, 3, 3, True)) == 2  # 96 KB of Q, 96 KB of K/V
    assert launch_ws.q_buffers(128, (128, 3, 2, True)) == 1  # 64 KB of Q would not fit beside 192 KB of K/V
    assert launch_ws.q_buffers(128, (128, 2, 2, True)) == 2
    assert launch_ws.q_buffers(128, (128, 3, 3, False), fp8=True) == 2  # one byte an element, P tiles included


def test_backward_compiles_for_sm90_with_two_and_three_stages():
    """The backward compiles for sm_90 at d64 and d128, causal or not, with two and with three Q/dO stages
    (three fit at d128 only because P stays in registers; measured slower, kept as a tuning option), with its
    register A operands and the loader's lse/delta vectors."""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "ws_regs.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, script, "--bwd-stages"], capture_output=True, text=True, env=env,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    bwd = [ln[4:] for ln in res.stdout.splitlines() if ln.startswith("bwd d=")]
    assert len(bwd) == 4 * len(launch_ws.WS_BWD_TUNING["tiles"]), res.stdout
    for ln in bwd:
        f = dict(kv.split("=") for kv in ln.split())
        assert f["ptx"] == "setmaxnreg,wgmma,tma,tma_reduce", ln
        assert int(f["shared"]) <= 232448, ln
        assert 0 <= int(f["stack"]) <= 512, ln


@pytest.mark.parametrize("q_double", [False, True])
def test_kernels_compile_for_sm90_with_bounded_spills(q_double):
    """Every shipped forward and backward config through ``scripts/ws_regs.py`` (a subprocess: Gluon does not
    compile under the interpreter the CPU tests run in), with one or (``q_double``, where they fit) two Q
    buffers."""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "ws_regs.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, script] + (["--q-double"] if q_double else []), capture_output=True,
                         text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    fwd = [ln for ln in res.stdout.splitlines() if ln.startswith("d=")]
    fp8 = [ln[4:] for ln in res.stdout.splitlines() if ln.startswith("fp8 d=")]
    bwd = [ln[4:] for ln in res.stdout.splitlines() if ln.startswith("bwd d=")]
    assert len(fwd) == len(launch_ws.WS_TUNING["tiles"]) + len(launch_ws.WS_TUNING["tiles_long"]), res.stdout
    assert len(fp8) == len(launch_ws.WS_TUNING["tiles_fp8"]), res.stdout
    assert len(bwd) == 2 * len(launch_ws.WS_BWD_TUNING["tiles"]), res.stdout
    fwd += fp8
    for ln in fwd + bwd:
        f = dict(kv.split("=") for kv in ln.split())
        # producer/consumer partitions with re-split registers, asynchronous wgmma, TMA loads (and the
        # backward's dQ by TMA bulk reduce-add)
        assert f["ptx"] == ("setmaxnreg,wgmma,tma,tma_reduce" if ln in bwd else "setmaxnreg,wgmma,tma"), ln
        assert int(f["shared"]) <= 232448, ln  # Hopper's 227 KiB of shared memory per block
        # a forward consumer spilling in its key loop ran 2x slower; the shipped tiles spill at most 72 bytes.
        # The backward's d128 consumers run at the 240-register cap (two 64x128 fp32 accumulators): 144-184
        # bytes of stack under Triton 3.9, no spill ops in the d128 loops under 3.6.
        assert 0 <= int(f["stack"]) <= (512 if ln in bwd else 256), ln


# ---------------------------------------------------------------------------------------------- GPU
@pytest.fixture
def fresh_plans():
    clear_plans()
    yield
    clear_plans()


def _hopper():
    return torch.cuda.is_available() and nvidia_hopper(torch.device("cuda"))


CASES = [  # B, sq, sk, h, hk, d, causal
    (2, 1000, 1000, 4, 4, 128, False), (2, 1000, 1000, 4, 4, 128, True), (1, 777, 1531, 8, 2, 128, True),
    (3, 300, 300, 2, 1, 64, True), (1, 129, 65, 2, 2, 64, False), (2, 2048, 2048, 8, 2, 64, True),
    (1, 1, 4000, 4, 4, 128, True), (40, 512, 512, 8, 8, 64, False), (2, 1000, 777, 4, 2, 256, False),
    (1, 129, 300, 2, 2, 256, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_ws_forward_and_grads_within_flash_attn_rule(case, dtype, fresh_plans):
    if not _hopper():
        pytest.skip("the Gluon forward runs on Hopper-class NVIDIA GPUs")
    B, sq, sk, h, hk, d, causal = case
    torch.manual_seed(sq * 7 + sk + d)
    qkv = torch.randn(B, sq, h + 2 * hk, d, device="cuda", dtype=dtype)
    q = qkv[:, :, :h].detach().requires_grad_()  # a strided leaf view: the Gluon kernel reads it in place
    k = torch.randn(B, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    plan = attn_launch.AttnPlan("dense", q, k, v, None, causal=causal)
    assert plan.ws is not None
    out, lse, _ = flash_attn(q, k, v, 0.0, causal=causal)
    dout = torch.randn_like(out)
    g = _grads(out, dout, (q, k, v))
    hi = plain(q, k, v, F64, causal=causal)
    hi_g = _grads(hi, dout.double(), (q, k, v))
    lo = plain(q, k, v, dtype, causal=causal)
    lo_g = _grads(lo, dout, (q, k, v))
    assert_close_tolerance(out, hi.detach(), lo.detach(), factor=2.0, name="out")
    for name, a, b, c in zip("qkv", g, hi_g, lo_g):
        assert_close_tolerance(a, b, c, factor=3.0, name=f"d{name}")
    # lse against float64 logsumexp of the scaled scores
    s = torch.einsum("bihd,bjhd->bhij", q.double(), k.double().repeat_interleave(h // hk, 2)) * d ** -0.5
    if causal:
        i = torch.arange(sq, device="cuda")[:, None]
        s = s.masked_fill(torch.arange(sk, device="cuda")[None] > i + sk - sq, float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), atol=2e-3, rtol=0)


def _f32(lit: str) -> float:
    """A PTX fp32 literal (``0fXXXXXXXX``) as a float."""
    import struct

    return struct.unpack("<f", bytes.fromhex(lit[2:])[::-1])[0]


def test_polynomial_exp2_literals_reach_fp32_accuracy():
    """The FMA-pipe exponential of ``kernels_ws._exp2_asm`` evaluated step by step in fp32 from the very PTX
    literals it emits: relative error below 1e-4 (bf16 rounds at 3.9e-3) for scores from -126 to 0, and
    exactly 0 for masked (``-inf``) scores, which the clamp at -127 sends below fp32's normal range."""
    c1, c2, c3, one, m127, magic = (torch.tensor(_f32(x), dtype=torch.float32) for x in (
        kernels_ws._C1, kernels_ws._C2, kernels_ws._C3, kernels_ws._ONE, kernels_ws._M127, kernels_ws._MAGIC))
    assert (one, m127, magic) == (1.0, -127.0, 12582912.0)
    x = torch.cat([torch.linspace(-126, 0, 200_001), torch.tensor([float("-inf"), -1e30, -127.5])])
    t = torch.maximum(x, m127)
    y = torch.floor(t) + magic  # add.rm: rounding down onto the integer grid of 1.5 * 2^23
    f = t - (y - magic)
    p = ((f * c3 + c2) * f + c1) * f + one
    bits = (y.view(torch.int32).to(torch.int64) * (1 << 23) + p.view(torch.int32).to(torch.int64)) & 0xFFFFFFFF
    r = bits.to(torch.int32).view(torch.float32)
    r = torch.where(r.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(r), r)  # .ftz
    want = torch.exp2(x.double())
    fin = x > -126.5
    assert ((r[fin].double() - want[fin]).abs() / want[fin]).max().item() < 1e-4
    assert (r[~fin] == 0).all()
    assert kernels_ws._exp2_asm(1).count("ex2.approx") == 3 and kernels_ws._exp2_asm(3).count("ex2.approx") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("case", [(40, 512, 512, 8, 8, 64, False), (2, 1000, 1000, 4, 4, 128, True),
                                  (1, 777, 1531, 8, 2, 64, True), (3, 300, 300, 2, 1, 64, True)])
def test_ws_q_double_equals_single(case, fp8, fresh_plans, monkeypatch):
    """``WS_TUNING["q_double"]`` only changes which shared buffer each tile's Q sits in: the persistent programs
    (several tiles each, consecutive tiles in alternating buffers) give bitwise the output and lse of one
    buffer."""
    if not _hopper():
        pytest.skip("the Gluon forward runs on Hopper-class NVIDIA GPUs")
    B, sq, sk, h, hk, d, causal = case
    torch.manual_seed(sq + d)
    q = torch.randn(B, sq, h, d, device="cuda", dtype=BF16)
    k, v = (torch.randn(B, sk, hk, d, device="cuda", dtype=BF16) for _ in range(2))
    if fp8:
        from culmen.flash_attn_3 import flash_attn_func as fa3
        from culmen.flash_attn_3 import quantize_fp8

        if sk % 16:
            pytest.skip("the FP8 Gluon forward needs sk % 16 == 0")
        monkeypatch.setitem(launch_ws.WS_TUNING, "fp8", True)
        q, k, v, qd, kd, vd = quantize_fp8(q, k, v)
        run = lambda: fa3(q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,  # noqa: E731
                          return_attn_probs=True)[:2]
        plan_kw = dict(descale=True, fa3=True)
    else:
        run = lambda: flash_attn(q, k, v, 0.0, causal=causal)[:2]  # noqa: E731
        plan_kw = {}
    # the d128 causal case runs a tile with room for two Q buffers (the shipped 128x3x2p has none)
    monkeypatch.setitem(launch_ws.WS_TUNING, "tiles", {**launch_ws.WS_TUNING["tiles"], (128, True): (64, 3, 3, True)})
    runs = []
    for double in (False, True):
        monkeypatch.setitem(launch_ws.WS_TUNING, "q_double", double)
        clear_plans()
        plan = attn_launch.AttnPlan("dense", q, k, v, None, causal=causal, **plan_kw)
        assert plan.ws is not None and plan.ws.launch.meta["Q_BUFS"] == (2 if double else 1)
        runs.append(run())
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.gpu
@pytest.mark.parametrize("poly", [1, 3])
@pytest.mark.parametrize("case", [(2, 1000, 1000, 4, 4, 128, True), (1, 777, 1531, 8, 2, 64, False)])
def test_ws_polynomial_exp2_within_flash_attn_rule(case, poly, fresh_plans, monkeypatch):
    """``WS_TUNING["exp_poly"]``: with 1 or 3 of every 4 exponentials on the FMA pipe the forward stays within
    flash_attn's rule against float64, and its lse within 2e-3."""
    if not _hopper():
        pytest.skip("the Gluon forward runs on Hopper-class NVIDIA GPUs")
    B, sq, sk, h, hk, d, causal = case
    monkeypatch.setitem(launch_ws.WS_TUNING, "exp_poly", {(False, d): poly})
    torch.manual_seed(poly + d)
    q = torch.randn(B, sq, h, d, device="cuda", dtype=BF16)
    k, v = (torch.randn(B, sk, hk, d, device="cuda", dtype=BF16) for _ in range(2))
    assert attn_launch.AttnPlan("dense", q, k, v, None, causal=causal).ws is not None
    out, lse, _ = flash_attn(q, k, v, 0.0, causal=causal)
    hi = plain(q, k, v, F64, causal=causal)
    assert_close_tolerance(out, hi, plain(q, k, v, BF16, causal=causal), factor=2.0, name="out")
    monkeypatch.setitem(launch_ws.WS_TUNING, "exp_poly", {})
    clear_plans()
    _, lse_mufu, _ = flash_attn(q, k, v, 0.0, causal=causal)
    torch.testing.assert_close(lse, lse_mufu, atol=2e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [True, False])
def test_ws_matches_triton_forward(persistent, fresh_plans, monkeypatch):
    if not _hopper():
        pytest.skip("the Gluon forward runs on Hopper-class NVIDIA GPUs")
    monkeypatch.setitem(launch_ws.WS_TUNING, "persistent", persistent)
    q, k, v = (torch.randn(4, 1037, 8, 128, device="cuda", dtype=BF16) for _ in range(3))
    o_ws, l_ws, _ = flash_attn(q, k, v, 0.0, causal=True)
    monkeypatch.setitem(launch_ws.WS_TUNING, "on", False)
    clear_plans()
    o_tr, l_tr, _ = flash_attn(q, k, v, 0.0, causal=True)
    torch.testing.assert_close(o_ws, o_tr, atol=2e-2, rtol=0)
    torch.testing.assert_close(l_ws, l_tr, atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("l2_bytes", [20 << 20, 300_000])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(5, 1000, 1100, 6, 3, 128), (2, 2000, 2100, 4, 2, 64)])
def test_ws_backward_matches_triton_backward(shape, persistent, l2_bytes, causal, fresh_plans, monkeypatch):
    """The Gluon backward against the deterministic Triton backward on the same forward outputs: one program
    per tile or per SM, L2 groups of one and several (batch, KV head) pairs with a partial last group, and
    causal units pairing key blocks with an odd count (sk 1100 / 2100: 9 / 17 key blocks of 128)."""
    if not _hopper():
        pytest.skip("the Gluon backward runs on Hopper-class NVIDIA GPUs")
    monkeypatch.setitem(launch_ws.WS_BWD_TUNING, "persistent", persistent)
    monkeypatch.setitem(launch_ws.WS_BWD_TUNING, "l2_bytes", l2_bytes)
    torch.manual_seed(3)
    _gluon_vs_triton_grads(shape, causal, monkeypatch)


def _gluon_vs_triton_grads(shape, causal, monkeypatch):
    """Gradients of one bf16 call through the Gluon backward (as ``WS_BWD_TUNING`` stands) and through the
    deterministic Triton backward on the same forward outputs, checked against each other; returns
    ``(q, k, v, dout, gluon grads)``."""
    B, sq, sk, h, hk, d = shape
    q = torch.randn(B, sq, h, d, device="cuda", dtype=BF16, requires_grad=True)
    k = torch.randn(B, sk, hk, d, device="cuda", dtype=BF16, requires_grad=True)
    v = torch.randn(B, sk, hk, d, device="cuda", dtype=BF16, requires_grad=True)
    out, _, _ = flash_attn(q, k, v, 0.0, causal=causal)
    dout = torch.randn_like(out)
    plan = attn_launch.AttnPlan("dense", q, k, v, None, causal=causal)
    assert plan.ws_bwd is not None
    g_ws = _grads(out, dout, (q, k, v))
    monkeypatch.setitem(launch_ws.WS_BWD_TUNING, "on", False)
    clear_plans()
    out2, _, _ = flash_attn(q, k, v, 0.0, causal=causal)
    g_tr = _grads(out2, dout, (q, k, v))
    for name, a, b in zip("qkv", g_ws, g_tr):
        scale = b.abs().max().item()
        torch.testing.assert_close(a, b, atol=2e-2 * scale, rtol=0, msg=f"d{name}")
    return q, k, v, dout, g_ws


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(5, 1000, 1100, 6, 3, 128), (2, 2000, 2100, 4, 2, 64), (1, 129, 300, 2, 1, 128)])
def test_ws_backward_stages_within_flash_attn_rule(shape, causal, stages, fresh_plans, monkeypatch):
    """The Gluon backward with two and three Q/dO stages (three fit at d128 because P^T stays in registers)
    against the deterministic Triton backward on the same forward outputs, and within flash_attn's rule
    against float64."""
    if not _hopper():
        pytest.skip("the Gluon backward runs on Hopper-class NVIDIA GPUs")
    monkeypatch.setitem(launch_ws.WS_BWD_TUNING, "tiles", {64: (64, stages), 128: (64, stages)})
    torch.manual_seed(5)
    q, k, v, dout, g_ws = _gluon_vs_triton_grads(shape, causal, monkeypatch)
    hi = _grads(plain(q, k, v, F64, causal=causal), dout.double(), (q, k, v))
    lo = _grads(plain(q, k, v, BF16, causal=causal), dout, (q, k, v))
    for name, g, gh, gl_ in zip("qkv", g_ws, hi, lo):
        assert_close_tolerance(g, gh, gl_, factor=3.0, name=f"d{name}")


@pytest.mark.gpu
def test_deterministic_backward_keeps_the_triton_kernels(fresh_plans):
    """``deterministic=True`` (and torch's switch) take the Triton backward: bitwise reproducible."""
    if not _hopper():
        pytest.skip("the Gluon backward runs on Hopper-class NVIDIA GPUs")
    from culmen.flash_attn import flash_attn_func

    q, k, v = (torch.randn(2, 777, 4, 128, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 777, 4, 128, device="cuda", dtype=BF16)
    runs = [_grads(flash_attn_func(q, k, v, causal=True, deterministic=True), dout, (q, k, v)) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert attn_launch.AttnPlan("dense", q, k, v, None, causal=True, deterministic=True).ws_bwd is None
    assert attn_launch.AttnPlan("dense", q, k, v, None, causal=True).ws_bwd is not None
    # torch's switch, checked per call: the same plan runs the Triton backward while it is on
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        runs = [_grads(flash_attn_func(q, k, v, causal=True), dout, (q, k, v)) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def _fp8_ws_against_triton(B, sq, sk, h, hk, d, causal, monkeypatch, descale=True):
    """Gluon FP8 forward and Triton FP8 forward of one case, each held to float64 attention of the dequantized
    inputs (P rounds to float8 in both kernels, but a row max that differs in its last bit moves P across float8
    steps, 6% apart: the kernels agree to FP8's error, not bitwise)."""
    from culmen.flash_attn_3 import flash_attn_func as fa3
    from culmen.flash_attn_3 import quantize_fp8

    q, k, v = (torch.randn(B, s, n, d, device="cuda", dtype=BF16) for s, n in ((sq, h), (sk, hk), (sk, hk)))
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
    if not descale:  # raw float8 values, no scales: FA3's default
        q8, k8, v8 = (t.float().clamp(-8, 8).to(torch.float8_e4m3fn) for t in (q, k, v))
        qd = kd = vd = torch.ones(B, hk, device="cuda")
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd) if descale else {}
    monkeypatch.setitem(launch_ws.WS_TUNING, "fp8", True)
    plan = attn_launch.AttnPlan("dense", q8, k8, v8, None, causal=causal, descale=descale, fa3=True)
    assert plan.ws is not None
    o_ws, lse_ws = fa3(q8, k8, v8, causal=causal, return_attn_probs=True, **kw)
    monkeypatch.setitem(launch_ws.WS_TUNING, "fp8", False)
    clear_plans()
    o_tr, lse_tr = fa3(q8, k8, v8, causal=causal, return_attn_probs=True, **kw)
    assert o_ws.dtype == BF16
    torch.testing.assert_close(lse_ws, lse_tr, atol=1e-3, rtol=0)
    deq = [(t.float() * sc.repeat_interleave(t.shape[2] // sc.shape[1], 1)[:, None, :, None]).to(BF16)
           for t, sc in ((q8, qd), (k8, kd), (v8, vd))]
    ref = plain(*deq, F64, causal=causal)
    e_ws, e_tr = (o_ws.double() - ref).abs(), (o_tr.double() - ref).abs()
    assert e_ws.max().item() <= 1.25 * e_tr.max().item() + 1e-2
    assert e_ws.mean().item() <= 1.1 * e_tr.mean().item() + 1e-5
    assert e_ws.max().item() < 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("poly", [0, 2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_ws_fp8_forward_matches_triton_fp8(d, causal, poly, fresh_plans, monkeypatch):
    """The Gluon FP8 forward (``WS_TUNING["fp8"]``) against the Triton FP8 forward on the same quantized inputs
    and descales (both bf16 out), each within FP8's error of float64 attention of the dequantized inputs; with
    2 of every 4 exponentials by the FMA-pipe polynomial too."""
    if not _hopper():
        pytest.skip("the Gluon forward runs on Hopper-class NVIDIA GPUs")
    torch.manual_seed(d + causal)
    monkeypatch.setitem(launch_ws.WS_TUNING, "exp_poly", {(True, d): poly})
    _fp8_ws_against_triton(3, 1000, 1040, 8, 2, d, causal, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(2, 1, 4000, 8, 1, 128, False), (2, 1, 4000, 8, 1, 128, True),
                                  (40, 64, 64, 4, 4, 64, True), (1, 77, 4000, 4, 2, 128, True),
                                  (2, 300, 304, 16, 1, 64, False), (3, 129, 4096, 2, 2, 128, False)])
@pytest.mark.parametrize("descale", [True, False])
def test_ws_fp8_edge_shapes(case, descale, fresh_plans, monkeypatch):
    """The FP8 Gluon forward on the shapes that broke the bf16 one before: one query row with batch > 1 (row
    strides), many small batches, causal with ``sq`` far below ``sk``, GQA 16:1, and without descales."""
    if not _hopper():
        pytest.skip("the Gluon forward runs on Hopper-class NVIDIA GPUs")
    torch.manual_seed(sum(case))
    _fp8_ws_against_triton(*case, monkeypatch, descale=descale)
