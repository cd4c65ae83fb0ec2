"""Launchers of the GroupNorm kernels: view the input as ``(N, C, L)``, pick the kernel, tiles and chunks, launch.

Any input whose spatial dims collapse into one stride is taken as it is (NCHW, channels-last, a
batch slice of either ...); ``spatial_strides`` says which. Channels-last inputs (unit channel stride)
with at most ``TUNING["max_block_c"]`` (padded) channels take the ``cl`` kernels (a chunk = whole
contiguous positions), everything else the ``rows`` kernels (a chunk = a block of one group). One
launch per direction: see ``kernels.py`` for the look-back schedule.

Host cost: a fwd+bwd of a small activation (8x1280x32x32) takes tens of microseconds on the GPU, so
the Python around the launches decides the wall time. Everything that depends only on the input's
geometry (shape, strides, dtypes, flags, ``TUNING``) is computed once into a plan (``FwdPlan``,
``BwdPlan``) whose ``BoundLaunch`` keeps the compiled kernel after the first call and launches it
directly. A call then costs the output and workspace allocations (one workspace per direction: the
statistics and every partial) and one ``CompiledKernel.run``. The counters of the schedule live in a
zeroed buffer kept per (device, stream) that the kernels leave zeroed again; inside CUDA-graph capture
a fresh zeroed buffer is made per call instead (its memset is part of the graph).
"""

from __future__ import annotations

import math

import torch
import triton.language as tl
from torch import Tensor

from culmen.ops.backend import device_guard, num_programs_hint
from culmen.ops.common.launch import BoundLaunch as _Launch
from culmen.ops.common.launch import FastLauncher, PlanTuning, cdiv, next_pow2
from culmen.ops.common.launch import aligned_16 as _aligned
from culmen.ops.common.launch import raw_stream as _stream
from culmen.ops.group_norm.kernels import (
    _gn_bwd_cl_kernel,
    _gn_bwd_rows_kernel,
    _gn_fwd_cl_kernel,
    _gn_fwd_rows_kernel,
)
from culmen.ops.group_norm.reference import spatial_strides, stats_dtype

_fwd_rows = FastLauncher(_gn_fwd_rows_kernel)
_fwd_cl = FastLauncher(_gn_fwd_cl_kernel)
_bwd_rows = FastLauncher(_gn_bwd_rows_kernel)
_bwd_cl = FastLauncher(_gn_bwd_cl_kernel)

_PLANS: dict = {}
# Bumped whenever TUNING changes: plans (and the op layer's per-call entries) built before are stale.
VERSION = [0]


def _tuning_changed() -> None:
    _PLANS.clear()
    VERSION[0] += 1


TUNING = PlanTuning({
    # Per kernel family (rows: no prefix; channels-last: ``cl_``) and direction (backward: ``bwd_``):
    # elements of one tile (rows: BLOCK_D x BLOCK_L; cl: BLOCK_P positions x BLOCK_C channels), elements of one
    # chunk (one program's share of a row; chunks shrink, never below one tile, until there are
    # ``min_programs_per_sm`` programs per multiprocessor) and warps per program.
    # H100 sweep (2026-11-22, scripts/tune_group_norm.py --select over 4 shapes x 2 layouts, device time):
    # rows forward 2048-element tiles x 4 warps in 8192-element chunks, cl forward 4096 x 4 warps, cl backward
    # 4096 x 4 warps; the rest are the register-count defaults (ptxas, sm_90a, Triton 3.6: 3-5 resident
    # programs per multiprocessor; 4096 x 8 warps needs up to 170 registers in the cl backward: one program
    # per multiprocessor, which a waiting program would stall). The cl chunks are larger: a sample's last
    # chunk merges S x G partials while the sample's readers wait, so S is kept small.
    "tile": 2048,
    "chunk": 8192,
    "num_warps": 4,
    "bwd_tile": 2048,
    "bwd_chunk": 16384,
    "bwd_num_warps": 4,
    "cl_tile": 4096,
    "cl_chunk": 32768,
    "cl_num_warps": 4,
    "cl_bwd_tile": 4096,
    "cl_bwd_chunk": 32768,
    "cl_bwd_num_warps": 4,
    "min_programs_per_sm": 4,
    # Channels-last inputs take the cl kernels up to this many channels (padded to a power of two).
    "max_block_c": 4096,
    # The cl kernels regroup per-channel sums into groups with tl.gather (else a scratch round trip).
    "gather": True,
    # At most this many chunks per row (the row's last chunk merges all their partials, and its readers
    # wait for that merge).
    "max_chunks": 128,
    # Partials (chunks x groups) per step of that merge.
    "merge_block": 512,
    # The weight/bias-gradient tail (sums the per-sample partials): channels per tail program, samples per step.
    "tail_block_c": 64,
    "tail_block_r": 64,
}, _tuning_changed)


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _fold(x: Tensor, block_l: int) -> int:
    """Positions the rows kernels' accumulators fold: one thread's 16-byte vector of ``x``."""
    return max(1, min(block_l, 16 // x.element_size()))


def _strides(t: Tensor) -> tuple[int, int, int]:
    s = spatial_strides(t)
    assert s is not None, "the op layer passes tensors whose spatial dims collapse"
    return s


def _even(total: int, size: int, unit: int) -> tuple[int, int]:
    """``(pieces, piece size)``: ``total`` cut into pieces of at most ``size`` (a multiple of ``unit``), evened out."""
    pieces = cdiv(total, size)
    size = cdiv(cdiv(total, pieces), unit) * unit
    return cdiv(total, size), size


def _target(total: int, chunk: int, tile: int, dev: torch.device) -> int:
    """Elements per chunk: ``chunk``, fewer when that leaves under ``min_programs_per_sm`` programs per SM."""
    want = TUNING["min_programs_per_sm"] * num_programs_hint(dev)
    return max(tile, min(chunk, total // max(want, 1)))


def rows_layout(N: int, G: int, D: int, L: int, tile: int, chunk: int, dev: torch.device
                ) -> tuple[int, int, int, int, int, int]:
    """``(BLOCK_D, BLOCK_L, Dc, Lc, S, Sl)`` of the rows kernels: tiles, chunk size (``Dc`` channels x ``Lc``
    positions), chunks per group ``S`` and position chunks ``Sl`` (``S = Sd * Sl``)."""
    bl = min(next_pow2(L), tile)
    bd = min(next_pow2(D), max(1, tile // bl))
    while bd > 1 and D % bd:  # a divisor of D: no half-masked channel blocks
        bd //= 2
    target = max(_target(N * G * D * L, chunk, bd * bl, dev), cdiv(D * L, TUNING["max_chunks"]))
    if D * bl <= target:  # every channel of the group, several position tiles
        dc, lc = D, bl * max(1, target // (D * bl))
    else:
        dc, lc = bd * max(1, target // (bd * bl)), bl
    sl, lc = _even(L, lc, bl)
    sd, dc = _even(D, dc, bd)
    return bd, bl, dc, lc, sd * sl, sl


def cl_layout(N: int, C: int, L: int, tile: int, chunk: int, dev: torch.device) -> tuple[int, int, int, int]:
    """``(BLOCK_P, BLOCK_C, Lc, S)`` of the cl kernels: tile, positions per chunk, chunks per sample."""
    bc = next_pow2(C)
    bp = min(max(1, tile // bc), next_pow2(L))
    lc = max(bp * max(1, _target(N * C * L, chunk, bp * C, dev) // (C * bp)), cdiv(L, TUNING["max_chunks"]))
    s, lc = _even(L, lc, bp)
    return bp, bc, lc, s


def _use_cl(sx: tuple[int, int, int], C: int, L: int) -> bool:
    return sx[1] == 1 and L > 1 and next_pow2(C) <= TUNING["max_block_c"]


# ---------------------------------------------------------------------------------------------- counters

_COUNTERS: dict = {}


def _counters(dev: torch.device, stream, need: int) -> Tensor:
    """A zeroed int32 buffer of at least ``need`` counters for kernels on ``stream`` (they leave it zeroed)."""
    key = (dev, stream)
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= need:
        return buf
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(need, device=dev, dtype=torch.int32)  # the graph zeroes it at every replay
    buf = torch.zeros(max(need, 4096), device=dev, dtype=torch.int32)
    _COUNTERS[key] = buf
    return buf


# -------------------------------------------------------------------------------------------------- plans


class FwdPlan:
    """Everything a forward launch needs that depends only on the input's geometry.

    ``packed``: the statistics and partials share one workspace ``[mean (N G) | rstd (N G) | partials]``
    (the autograd path); else ``mean``, ``rstd`` and the partials are separate tensors (the custom op)."""

    __slots__ = ("N", "G", "NG", "cl", "stats", "part_numel", "ws_numel", "cnt_numel", "launch", "ints", "offs",
                 "version")

    def __init__(self, x: Tensor, has_w: bool, has_b: bool, G: int, silu: bool, packed: bool):
        N, C = x.shape[0], x.shape[1]
        L = math.prod(x.shape[2:])
        D = C // G
        dev = x.device
        self.N, self.G, self.NG = N, G, N * G
        self.stats = stats_dtype(x)
        self.version = VERSION[0]
        sx = _strides(x)
        sy = _strides(torch.empty_like(x))  # the strides every later y = empty_like(x) gets
        meta = {"D": D, "ACC": _acc(x.dtype), "HAS_W": has_w, "HAS_B": has_b, "SILU": bool(silu)}
        self.cl = _use_cl(sx, C, L)
        pre = "cl_" if self.cl else ""
        tile, chunk, nw = TUNING[pre + "tile"], TUNING[pre + "chunk"], TUNING[pre + "num_warps"]
        if self.cl:
            bp, bc, lc, S = cl_layout(N, C, L, tile, chunk, dev)
            bg = next_pow2(G)
            gather = bool(TUNING["gather"])
            self.part_numel = N * S * G * 2 + (0 if gather else N * S * bc)
            rows = N
            meta.update(USE_GATHER=gather, BLOCK_P=bp, BLOCK_C=bc, BLOCK_G=bg, BLOCK_D=next_pow2(D),
                        BLOCK_M=max(1, min(next_pow2(S), TUNING["merge_block"] // bg)))
            self.launch = _Launch(_fwd_cl, ((N + 1) * S,), meta, nw)
            self.ints = (N, G, C, L, lc, S, *sx, *sy)
        else:
            bd, bl, dc, lc, S, sl = rows_layout(N, G, D, L, tile, chunk, dev)
            self.part_numel = N * G * S * 2
            rows = N * G
            meta.update(BLOCK_D=bd, BLOCK_L=bl, FOLD=_fold(x, bl), BLOCK_M=min(next_pow2(S), TUNING["merge_block"]))
            self.launch = _Launch(_fwd_rows, ((rows + 1) * S,), meta, nw)
            self.ints = (rows, G, L, lc, dc, sl, S, *sx, *sy)
        self.cnt_numel = 2 + rows
        self.ws_numel = 2 * self.NG + self.part_numel
        # (rstd offset, partials offset) in the packed workspace; 0, 0 for separate tensors.
        self.offs = (self.NG, 2 * self.NG) if packed else (0, 0)

    def run(self, x: Tensor, y: Tensor, w: Tensor | None, b: Tensor | None, eps: float, mean: Tensor, rstd: Tensor,
            part: Tensor) -> None:
        """Launch on the current stream; ``mean``, ``rstd`` and ``part`` are one tensor when packed."""
        dev = x.device
        w = w if w is not None else x
        b = b if b is not None else x
        aligned = _aligned(x, w, b)
        with device_guard(dev):
            stream = _stream(dev)
            cnt = _counters(dev, stream, self.cnt_numel)
            roff, poff = self.offs
            self.launch((x, y, w, b, mean, rstd, roff, part, poff, cnt, *self.ints, eps), aligned, stream)


class BwdPlan:
    """Everything a backward launch needs that depends only on the geometry of ``dy`` and ``x``.

    ``packed``: ``mean`` and ``rstd`` are the forward's packed workspace (``rstd`` at ``N G``)."""

    __slots__ = ("G", "cl", "stats", "ws_numel", "cnt_numel", "store_dw", "launch", "ints", "roff", "version")

    def __init__(self, dy: Tensor, x: Tensor, has_w: bool, has_b: bool, G: int, silu: bool, need_dw: bool,
                 packed: bool):
        N, C = x.shape[0], x.shape[1]
        L = math.prod(x.shape[2:])
        D = C // G
        dev = x.device
        self.G = G
        self.stats = stats_dtype(x)
        self.version = VERSION[0]
        sd, sx = _strides(dy), _strides(x)
        sg = _strides(torch.empty_like(x))
        self.store_dw = store_dw = bool(need_dw and (has_w or has_b))
        meta = {"D": D, "ACC": _acc(x.dtype), "HAS_W": has_w, "HAS_B": has_b, "SILU": bool(silu),
                "STORE_DW": store_dw}
        self.cl = _use_cl(sx, C, L)
        pre = "cl_bwd_" if self.cl else "bwd_"
        tile, chunk, nw = TUNING[pre + "tile"], TUNING[pre + "chunk"], TUNING[pre + "num_warps"]
        if self.cl:
            bp, bc, lc, S = cl_layout(N, C, L, tile, chunk, dev)
            bg = next_pow2(G)
            gather = bool(TUNING["gather"])
            rows, rw = N, N * S
            pc = N * S * G * 2 + N * G * 2 + (0 if gather else N * S * bc)
            meta.update(USE_GATHER=gather, BLOCK_P=bp, BLOCK_C=bc, BLOCK_G=bg, BLOCK_D=next_pow2(D),
                        BLOCK_M=max(1, min(next_pow2(S), TUNING["merge_block"] // bg)))
        else:
            bd, bl, dc, lc, S, sl = rows_layout(N, G, D, L, tile, chunk, dev)
            rows, rw = N * G, N * sl
            pc = rows * S * 2 + rows * 2
            meta.update(BLOCK_D=bd, BLOCK_L=bl, FOLD=_fold(x, bl), BLOCK_M=min(next_pow2(S), TUNING["merge_block"]))
        E = 0
        if store_dw:
            # the readers of a row each sum a slice of its partial rows: (partial rows, slice width)
            nrows, ncols = (S, C) if self.cl else (sl, D)
            bct = min(TUNING["tail_block_c"], next_pow2(C))
            E = cdiv(C, bct)
            meta.update(BLOCK_RR=next_pow2(nrows), BLOCK_CC=next_pow2(cdiv(ncols, S)),
                        BLOCK_R=min(TUNING["tail_block_r"], next_pow2(N)), BLOCK_CT=bct)
        else:
            meta.update(BLOCK_RR=1, BLOCK_CC=1, BLOCK_R=1, BLOCK_CT=1)
        self.ws_numel = (2 * (rw + N) * C if store_dw else 0) + pc
        self.cnt_numel = 2 + rows
        grid = ((rows + 1) * S + E,)
        if self.cl:
            self.launch = _Launch(_bwd_cl, grid, meta, nw)
            self.ints = (N, G, C, L, lc, S, E, *sd, *sx, *sg)
        else:
            self.launch = _Launch(_bwd_rows, grid, meta, nw)
            self.ints = (rows, G, C, L, lc, dc, sl, S, E, *sd, *sx, *sg)
        self.roff = N * G if packed else 0

    def run(self, dy: Tensor, x: Tensor, dx: Tensor, w: Tensor | None, b: Tensor | None, mean: Tensor, rstd: Tensor,
            dw: Tensor | None, db: Tensor | None) -> None:
        """Launch on the current stream (``mean`` and ``rstd`` are one tensor when packed)."""
        dev = x.device
        ws = torch.empty(self.ws_numel, device=dev, dtype=self.stats)
        w = w if w is not None else x
        b = b if b is not None else x
        aligned = _aligned(dy, x, w, b, mean, rstd)
        with device_guard(dev):
            stream = _stream(dev)
            cnt = _counters(dev, stream, self.cnt_numel)
            self.launch((dy, x, dx, w, b, mean, rstd, self.roff, ws, cnt, dw if dw is not None else ws,
                         db if db is not None else ws, *self.ints), aligned, stream)


def _wkey(t: Tensor | None):
    return None if t is None else t.dtype


def fwd_plan(x: Tensor, weight: Tensor | None, bias: Tensor | None, G: int, silu: bool, packed: bool) -> FwdPlan:
    """The cached ``FwdPlan`` of this geometry."""
    key = ("f", x.shape, x.stride(), x.dtype, x.device, G, silu, _wkey(weight), _wkey(bias), packed)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) > 512:
            _PLANS.clear()
        plan = _PLANS[key] = FwdPlan(x, weight is not None, bias is not None, G, silu, packed)
    return plan


def bwd_plan(dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, G: int, silu: bool, need_dw: bool,
             packed: bool) -> BwdPlan:
    """The cached ``BwdPlan`` of this geometry."""
    key = ("b", x.shape, x.stride(), x.dtype, x.device, dy.stride(), dy.dtype, G, silu, need_dw, _wkey(weight),
           _wkey(bias), packed)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) > 512:
            _PLANS.clear()
        plan = _PLANS[key] = BwdPlan(dy, x, weight is not None, bias is not None, G, silu, need_dw, packed)
    return plan


def _empty_stats(mean: Tensor, rstd: Tensor, eps: float) -> None:
    """The statistics of empty groups (an empty batch or spatial size): mean 0, rstd ``eps ** -0.5``."""
    mean.zero_()
    rstd.fill_(float(eps) ** -0.5 if eps > 0 else float("inf"))


def group_norm_fwd(x: Tensor, weight: Tensor | None, bias: Tensor | None, G: int, eps: float,
                   silu: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Forward: ``(y, mean, rstd)``; ``y`` like ``x`` (same dtype and memory format), ``mean``/``rstd``
    ``(N, G)`` fp32 (fp64 for fp64 ``x``), separate tensors."""
    dev = x.device
    N = x.shape[0]
    y = torch.empty_like(x)
    mean = torch.empty((N, G), device=dev, dtype=stats_dtype(x))
    rstd = torch.empty((N, G), device=dev, dtype=stats_dtype(x))
    if x.numel() == 0:
        _empty_stats(mean, rstd, eps)
        return y, mean, rstd
    plan = fwd_plan(x, weight, bias, G, silu, packed=False)
    part = torch.empty(plan.part_numel, device=dev, dtype=plan.stats)
    plan.run(x, y, weight, bias, float(eps), mean, rstd, part)
    return y, mean, rstd


def group_norm_fwd_packed(x: Tensor, weight: Tensor | None, bias: Tensor | None, G: int, eps: float, silu: bool,
                          plan: FwdPlan | None = None) -> tuple[Tensor, Tensor]:
    """Forward for the autograd path: ``(y, ws)``; ``ws[:N G]`` holds the mean and ``ws[N G : 2 N G]`` the rstd
    (then the partials). ``plan``: ``fwd_plan(..., packed=True)`` of these arguments when the caller has it."""
    y = torch.empty_like(x)
    if x.numel() == 0:
        NG = x.shape[0] * G
        ws = torch.empty(2 * NG, device=x.device, dtype=stats_dtype(x))
        _empty_stats(ws[:NG], ws[NG:], eps)
        return y, ws
    if plan is None:
        plan = fwd_plan(x, weight, bias, G, silu, packed=True)
    ws = torch.empty(plan.ws_numel, device=x.device, dtype=plan.stats)
    plan.run(x, y, weight, bias, eps, ws, ws, ws)
    return y, ws


def group_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor,
                   G: int, silu: bool, need_dw: bool, packed: bool = False, plan: BwdPlan | None = None
                   ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Backward: ``(dx, dweight, dbias)``; ``dx`` like ``x``, ``dweight``/``dbias`` in the parameter dtypes
    (``None`` without the parameter or when ``need_dw`` is false). ``packed``: ``mean`` and ``rstd`` are both
    the forward's packed workspace. ``plan``: ``bwd_plan`` of these arguments when the caller has it."""
    dx = torch.empty_like(x)
    store_dw = need_dw and (weight is not None or bias is not None)
    dw = torch.empty_like(weight) if (store_dw and weight is not None) else None
    db = torch.empty_like(bias) if (store_dw and bias is not None) else None
    if x.numel() == 0:
        return dx, (dw.zero_() if dw is not None else None), (db.zero_() if db is not None else None)
    if plan is None:
        plan = bwd_plan(dy, x, weight, bias, G, silu, need_dw, packed)
    plan.run(dy, x, dx, weight, bias, mean, rstd, dw, db)
    return dx, dw, db
