"""Plans of the warp-specialized Gluon forward (``kernels_ws.py``): which calls it takes, and its launch.

``ws_config(...)`` returns the tile config for a call the Gluon kernel handles, else ``None`` (the Triton
forward runs). ``WsForward`` is a plan's launcher (its ``Launch`` from ``ws_launch`` and the integer arguments).
``WS_TUNING`` holds the switches and the per-(head dim, causal) tiles swept on the GPU
(``bench/notes/attention.md`` v10).
"""

from __future__ import annotations

import os

import torch

from culmen.ops.attention import kernels_ws
from culmen.ops.attention.kernels import LOG2E_F
from culmen.ops.backend import num_programs_hint
from culmen.ops.common.launch import Launch, cdiv

# (head dim, causal) -> (BLOCK_N, STAGES, consumer warpgroups, ping-pong); BLOCK_M is 64 per consumer warpgroup.
# Swept on an H200 and an H100 (bench/notes/attention.md v10, v15): d128 two ping-ponged warpgroups over 128-key
# blocks, causal too since s14 (the kernel of v13 on: H100 ms 128x3x2p / 64x3x3p, s2k 0.343 / 0.386, s4k 0.575 /
# 0.666, s8k 1.066 / 1.106; H200 the same order); d64 three warpgroups (192 query rows) without mask, two
# ping-ponged with the causal mask (three spill there).
WS_TUNING: dict = {
    "on": True,
    # one program per SM looping over tiles, heaviest first (else one program per tile): +3-15%
    "persistent": True,
    "l2_bytes": 20 << 20,
    "tiles": {(64, False): (128, 3, 3, False), (64, True): (128, 3, 2, True),
              (128, False): (128, 3, 2, True), (128, True): (128, 3, 2, True),
              # d256 without mask, two ping-ponged warpgroups over 64-key blocks (the one tile that fits in
              # shared memory and registers): H200 s13, ms Gluon / Triton, s2k 0.615 / 0.643, s4k 1.132 / 1.207
              # (cuDNN 0.438 / 0.839). Causal d256 stays on Triton (s4k 0.701 / 0.693).
              (256, False): (64, 2, 2, True)},
    # (head dim, causal) -> (keys, tile): from that many keys on, this tile instead of ``tiles``'. d128 causal
    # (H100 s14, ms 128x3x2p / 64x3x3p): s8k 1.045 / 1.118, s16k 2.365 / 2.125 (cuDNN 0.970 / 1.905); 12k splits it.
    "tiles_long": {(128, True): (12288, (64, 3, 3, True))},
    # float8_e4m3fn Q/K/V (bf16 output, V through the transposed copy). H100, 16k tokens, s8k, TFLOP/s against
    # the Triton FP8 forward: d128 full 847-863 vs 731 (3 warpgroups; 2 ping-ponged 781), causal 677-681 vs
    # 637; d64 full 587 vs 446, causal 461 vs 422 (bench/results/h100/2026-11-28-s11-fp8-*.log)
    "fp8": True,
    "tiles_fp8": {(64, False): (128, 3, 3, False), (64, True): (128, 3, 3, False),
                  (128, False): (128, 3, 3, False), (128, True): (128, 3, 2, True)},
    # how many of every 4 exponentials the softmax computes on the FMA pipe instead of MUFU (kernels_ws
    # ``_exp2_asm``), per (FP8, d). Off: it lost everywhere on the H100 (FP8 d128 full 847 -> 767 / 652
    # TFLOP/s with 1 / 2 of 4; bf16 +-2%), and even no exponential at all (-1, an ablation) gave FP8 only
    # 921: MUFU is not what limits these kernels
    "exp_poly": {},
    # least work (B * h * sq * sk) per (head dim, causal) for the bf16/fp16 Gluon forward; below it the Triton
    # forward is faster (H200, s12 `scripts/ws_threshold.py`, ms Gluon / Triton: d64 causal B8 h12 s1k 0.074 /
    # 0.064, B8 h8 s512 0.029 / 0.021, but B32 h32 s512 0.198 / 0.216; d64 full B16 h32 s1k 0.410 / 0.398, B8 h32
    # s2k 0.662 / 0.748). d128 wins from the smallest case measured (B4 h16 s2k causal 0.219 / 0.218).
    "min_work": {(64, True): 1 << 28, (64, False): 1 << 30},
    # Two Q buffers where shared memory holds them (``q_buffers``): the loader then loads the next tile's Q and its
    # first K/V blocks while the consumers still read this tile's Q, instead of after they release it (short
    # sequences pay that wait once a tile: d128 s2k runs 16 key blocks a tile, s8k 64). Written and compiled for
    # sm_90 without a GPU (s12). Measured (s13, H200, d128 16k tokens, ms): bitwise equal, no faster (s2k full
    # 0.549 one buffer / 0.558 two, causal 0.351 / 0.350; s8k full 1.910 / 1.911): the per-tile cost is not the
    # loader's wait for Q. Off.
    "q_double": False,
    # Calls traced by torch.compile that the Gluon forward would take run as opaque custom ops calling the eager
    # plans (op.py ``_ws_under_compile``; else the triton_ops, whose Triton kernels Inductor launches itself).
    # Same eligibility as eager, the ``min_work`` floor included. Before the floor existed the d64 calls of LLaMA
    # d768 took it and lost (H200 A/B 18.18 -> 21.44 ms a step, s12: 24 small host-bound calls); with the floor
    # those stay on the traced Triton kernels and LLaMA 1b (d128, B4 s2k h16) gains: H200 A/B (s13) 127.62 ->
    # 124.95 ms a step (torch.compile 119.09). CULMEN_WS_COMPILE=0 turns it off.
    "compile": os.environ.get("CULMEN_WS_COMPILE", "1") != "0",
}
# Registers per thread of a consumer / the loader, by consumer count: the kernel's warps (consumers plus the
# loader warp rounded up to a warpgroup) share 64K registers, re-split by setmaxnreg.
WS_REGS = {2: (240, 24), 3: (160, 32)}
_DTYPES = (torch.bfloat16, torch.float16)
_FP8 = getattr(torch, "float8_e4m3fn", None)


def ws_config(q, k, v, *, causal: bool, extras: bool, on_gpu: bool, hopper: bool,
              min_work: bool = True) -> tuple | None:
    """``(BLOCK_N, STAGES, consumer warpgroups, ping-pong)`` when the Gluon forward takes this dense call, else
    ``None``.

    ``extras``: any feature the Gluon kernel lacks (dropout, window, softcap, ALiBi, qv, varlen, split V
    head dim, KV-cache ranges, torch.compile tracing; FP8 unless ``ws_fp8_ok``). Inputs must be 16-byte
    aligned in their row and head strides (TMA), ``d`` one of the tiles' head dims, and causal calls need ``sq <= sk``;
    ``min_work``: bf16/fp16 calls also need ``WS_TUNING["min_work"]`` of work (the backward asks without). FP8
    (``WS_TUNING["fp8"]``) reads V through its transposed copy, so only q and k need the TMA layout."""
    if not (WS_TUNING["on"] and kernels_ws.AVAILABLE and on_gpu and hopper) or extras:
        return None
    fp8 = q.dtype == _FP8 and WS_TUNING["fp8"]
    if (q.dtype not in _DTYPES and not fp8) or k.dtype != q.dtype or v.dtype != q.dtype or q.dim() != 4:
        return None
    d = q.shape[-1]
    tile = WS_TUNING["tiles_fp8" if fp8 else "tiles"].get((int(d), bool(causal)))
    if tile is None or k.shape[-1] != d or v.shape[-1] != d:
        return None
    long = None if fp8 else WS_TUNING["tiles_long"].get((int(d), bool(causal)))
    if long is not None and k.shape[1] >= long[0]:
        tile = long[1]
    if causal and q.shape[1] > k.shape[1]:
        return None
    if min_work and not fp8 and q.shape[0] * q.shape[1] * q.shape[2] * k.shape[1] < WS_TUNING["min_work"].get(
            (int(d), bool(causal)), 0):
        return None
    if 0 in q.shape[:3] or k.shape[1] == 0:  # a tile with no key block would wait forever
        return None
    if fp8 and k.shape[1] % 16:  # the transposed V copy's rows (one byte a key) must be 16-byte aligned
        return None
    for t in (q, k) if fp8 else (q, k, v):
        if not ws_layout_ok(t):
            return None
    return tile


def ws_layout_ok(t) -> bool:
    """Whether ``t`` ``(B, s, h, d)`` reads as one 2-D TMA view ``(B * s, h * d)``: unit head-dim stride, heads
    packed (head stride ``d``), batches packed (batch stride ``s`` rows, or one batch), 16-byte aligned rows."""
    B, s, h, d = t.shape
    st = t.stride()
    return (st[3] == 1 and (st[2] == d or h == 1) and (st[0] == s * st[1] or B == 1)
            and (st[1] * t.element_size()) % 16 == 0)


def ws_launch(dtype: torch.dtype, d: int, causal: bool, tile: tuple, grid: int, device,
              persistent: bool, descale: bool = False) -> Launch:
    """A ``Launch`` of ``_attn_fwd_ws_kernel`` for one config and grid (a plan keeps its own). ``dtype``
    float8_e4m3fn: the FP8 kernel (V transposed; ``descale``: with per-(batch, KV head) descales)."""
    from triton.experimental.gluon import language as gl

    fp8 = dtype == _FP8
    gdt = gl.float8e4nv if fp8 else gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    bn, stages, nwg, pingpong = tile
    creg, lreg = WS_REGS[nwg]
    meta = dict(PERSISTENT=persistent, CAUSAL=causal, HEAD_D=d, BLOCK_N=bn, STAGES=stages, NUM_WG=nwg,
                PINGPONG=pingpong, FP8=fp8, DESCALE=bool(descale) and fp8, Q_BUFS=q_buffers(d, tile, fp8),
                EXP_ASM=_exp_asm(WS_TUNING["exp_poly"].get((fp8, d), 0)), CONSUMER_REGS=creg, LOADER_REGS=lreg,
                q_layout=gl.NVMMASharedLayout.get_default_for([64, d], gdt),
                kv_layout=gl.NVMMASharedLayout.get_default_for([bn, d], gdt),
                vt_layout=gl.NVMMASharedLayout.get_default_for([d, bn], gdt),
                p_layout=gl.NVMMASharedLayout.get_default_for([64, bn], gdt))
    return Launch(kernels_ws._attn_fwd_ws_kernel, (grid,), meta, 4, 1, device=device,
                  options={"maxnreg": (creg * nwg + lreg) // (nwg + 1)})


_SMEM_BYTES = 227 * 1024  # an sm_90 block's shared memory


def q_buffers(d: int, tile: tuple, fp8: bool = False) -> int:
    """How many Q buffers the Gluon forward of this config gets: 2 with ``WS_TUNING["q_double"]`` when they fit
    beside the K/V stages (and FP8's P tiles) with 8 KB to spare for barriers and layout conversions, else 1."""
    if not WS_TUNING["q_double"]:
        return 1
    bn, stages, nwg, _ = tile
    es = 1 if fp8 else 2
    used = 2 * nwg * 64 * d * es + 2 * stages * bn * d * es + (2 * nwg * 64 * bn if fp8 else 0)
    return 2 if used + 8 * 1024 <= _SMEM_BYTES else 1


def _exp_asm(n_poly: int) -> str:
    """The consumers' ``EXP_ASM``: empty for MUFU's ``exp2`` alone, else ``kernels_ws._exp2_asm(n_poly)``."""
    return kernels_ws._exp2_asm(n_poly) if n_poly else ""


class WsForward:
    """The Gluon forward of one call signature: ``(stream, q, k, v, out, lse[, qd, kd, vd])`` launches it,
    writing ``out`` (contiguous ``(B, sq, h, d)``) and ``lse`` (fp32 ``(B, h, sq)``, contiguous). Pointers
    must be 16-byte aligned (the caller checks). FP8 (``dtype`` float8_e4m3fn): ``v`` is the transposed copy
    ``(B, hk, d, sk)`` (its row stride in ``row_strides``), ``out`` bf16, ``qd``/``kd``/``vd`` the fp32
    ``(B, hk)`` descales when ``descale``."""

    __slots__ = ("launch", "ints")

    def __init__(self, q_shape, k_shape, dtype: torch.dtype, device, causal: bool, tile: tuple,
                 scale_log2: float, row_strides: tuple, descale: bool = False) -> None:
        B, sq, H, d = (int(x) for x in q_shape)
        sk, hk = int(k_shape[1]), int(k_shape[2])
        num_m = cdiv(sq, 64 * tile[2])
        grid = num_m * B * H
        persistent = WS_TUNING["persistent"]
        if persistent:
            grid = min(grid, num_programs_hint(torch.device(device)))
        self.launch = ws_launch(dtype, d, causal, tile, grid, device, persistent, descale)
        # causal tiles in flight cover (batch, head) pairs whose K and V (bf16, shared by GQA groups) fit in
        # this many bytes of L2
        bh_group = max(1, min(B * H, WS_TUNING["l2_bytes"] * (H // hk) // max(sk * d * 4, 1)))
        # row strides of q, k, v, out; lse strides; sizes; the scale
        self.ints = (*row_strides, H * d, sq * H, sq, B, H, H // hk, bh_group, sq, sk, num_m, scale_log2)

    def __call__(self, stream, q, k, v, out, lse, qd=None, kd=None, vd=None) -> None:
        # without descales the kernel never reads its descale pointers: lse stands in
        self.launch(stream, True, q, k, v, out, lse, lse if qd is None else qd, lse if kd is None else kd,
                    lse if vd is None else vd, *self.ints)


def ws_forward(q, k, v, out, lse, scale_log2: float, causal: bool, tile: tuple, stream) -> None:
    """Run the Gluon forward once (diagnostics and tuning; plans keep a ``WsForward``)."""
    WsForward(q.shape, k.shape, q.dtype, q.device, causal, tile, scale_log2,
              (q.stride(1), k.stride(1), v.stride(1)))(stream, q, k, v, out, lse)



# ------------------------------------------------------------------------------------------------ backward
# head dim -> (BLOCK_M, STAGES) of the Gluon backward (kernels_ws_bwd): two consumer warpgroups of 64 keys each
# (BLOCK_N 128), each adding half of every dQ tile's columns into the fp32 accumulator by one TMA bulk reduce.
# The scores are transposed (S^T = K Q^T, dP^T = V dO^T), so P^T and dS^T feed dV's and dK's GEMMs from
# registers (FA3's register-A form). Against the untransposed form it replaced (P and dS through shared memory),
# H200 s14, 16k tokens, backward ms, untransposed / transposed / transposed with 3 Q/dO stages (fits at d128
# only without the P buffer): d128 s2k full 1.640 / 1.625 / 1.693, causal 1.077 / 1.027 / 1.023; s8k full
# 5.538 / 5.385 / 6.078, causal 3.099 / 2.988 / 3.229; d64 s2k full 2.140 / 1.925 / 1.974, causal 1.284 / 1.192 /
# 1.210; s8k full 7.497 / 6.805 / 7.042, causal 3.897 / 3.584 / 3.812 (H100: the same order, 0-10%;
# bench/results/h{100,200}/2026-11-28-s14-tune-bwd-st.log).
WS_BWD_TUNING: dict = {
    "on": True,
    "tiles": {64: (64, 2), 128: (64, 2)},
    # one program per SM walking the tiles (else one program per tile)
    "persistent": True,
    # the tiles in flight cover (batch, KV head) pairs whose Q, dO and dQ accumulator fit in this many bytes
    "l2_bytes": 20 << 20,
    # shortest key sequence per head dim: below it the Triton backward is as fast or faster. d64 with the
    # transposed form (H100 s14, backward ms Gluon / Triton): s1k full 1.181 / 1.186, causal 0.848 / 0.907; s4k
    # full 3.577 / 4.115. Before it (s10): s1k 1.67 vs 1.73 ms fwd+bwd, s2k within 1-3% both ways.
    "min_sk": {64: 1024},
}
WS_BWD_REGS = (240, 24)


def ws_bwd_config(q, k, v, *, causal: bool, extras: bool, on_gpu: bool, hopper: bool) -> tuple | None:
    """``(BLOCK_M, STAGES, persistent)`` when the Gluon backward takes this dense call (the forward's
    conditions, ``ws_config``), else ``None``. The caller also needs dout TMA-readable and non-deterministic
    mode."""
    if not WS_BWD_TUNING["on"] or ws_config(q, k, v, causal=causal, extras=extras, on_gpu=on_gpu,
                                            hopper=hopper, min_work=False) is None:
        return None
    d = int(q.shape[-1])
    if k.shape[1] < WS_BWD_TUNING["min_sk"].get(d, 0):
        return None
    tile = WS_BWD_TUNING["tiles"].get(d)
    # the switch is read here, when the forward plans the call, so its backward runs what was asked then
    return None if tile is None else (*tile[:2], bool(WS_BWD_TUNING["persistent"]))


def ws_bwd_launch(dtype: torch.dtype, d: int, causal: bool, tile: tuple, grid: int, device,
                  persistent: bool) -> Launch:
    """A ``Launch`` of ``_attn_bwd_ws_kernel`` for one ``(BLOCK_M, STAGES)`` tile and grid."""
    from triton.experimental.gluon import language as gl

    from culmen.ops.attention import kernels_ws_bwd

    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    bm, stages = tile
    creg, lreg = WS_BWD_REGS
    meta = dict(CAUSAL=causal, HEAD_D=d, BLOCK_M=bm, STAGES=stages, NUM_WG=2, PERSISTENT=persistent,
                CONSUMER_REGS=creg, LOADER_REGS=lreg,
                q_layout=gl.NVMMASharedLayout.get_default_for([bm, d], gdt),
                kv_layout=gl.NVMMASharedLayout.get_default_for([128, d], gdt),
                ds_layout=gl.NVMMASharedLayout.get_default_for([128, bm], gdt),  # dS^T: keys by queries
                dq_layout=gl.NVMMASharedLayout.get_default_for([bm, d // 2], gl.float32))
    return Launch(kernels_ws_bwd._attn_bwd_ws_kernel, (grid,), meta, 4, 1, device=device,
                  options={"maxnreg": (creg * 2 + lreg) // 3})


class WsBackward:
    """The Gluon backward of one call signature: ``(stream, q, k, v, dout, lse, delta, dq, dk, dv)`` writes dQ,
    dK, dV (any strides; dK/dV's heads and batches by their strides, dQ by a copy from the fp32 accumulator).
    ``delta`` is ``rowsum(dout * out)`` fp32 ``(B, H, sq)`` laid out like ``lse``."""

    __slots__ = ("launch", "ints", "acc_shape", "sq")

    def __init__(self, q_shape, k_shape, dtype: torch.dtype, device, causal: bool, tile: tuple, scale: float,
                 row_strides: tuple, lse_strides: tuple) -> None:
        B, sq, H, d = (int(x) for x in q_shape)
        sk, hk = int(k_shape[1]), int(k_shape[2])
        num_n = cdiv(sk, 128)
        grid = (cdiv(num_n, 2) if causal else num_n) * B * hk  # causal work units pair key blocks n, num_n-1-n
        bm, stages, persistent = tile  # ws_bwd_config's tile and switch
        if persistent:
            grid = min(grid, num_programs_hint(torch.device(device)))
        self.launch = ws_bwd_launch(dtype, d, causal, (bm, stages), grid, device, persistent)
        # (batch, KV head) pairs per tile group: their Q, dO (bf16) and dQ accumulator (fp32) stay in L2
        group_bytes = (H // hk) * sq * d * 8
        bh_group = max(1, min(B * hk, WS_BWD_TUNING["l2_bytes"] // max(group_bytes, 1)))
        # row strides of q, k, v, dout; lse strides; sizes; scales (dk/dv strides come per call)
        self.ints = (row_strides, lse_strides,
                     (B, H, H // hk, bh_group, sq, sk, num_n, scale * LOG2E_F, scale))
        self.acc_shape = (B, cdiv(sq, bm) * bm, H, d)
        self.sq = sq

    def __call__(self, stream, q, k, v, dout, lse, delta, dq, dk, dv) -> None:
        rows, lse_st, sizes = self.ints
        acc = torch.zeros(self.acc_shape, dtype=torch.float32, device=q.device)
        self.launch(stream, True, q, k, v, dout, dk, dv, acc, lse, delta, *rows,
                    dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
                    *lse_st, *sizes)
        dq.copy_(acc[:, :self.sq])
