"""Launchers of the GroupNorm kernels: view the input as ``(N, C, L)``, pick tiles and the schedule, launch.

Any input whose spatial dims collapse into one stride is taken as it is (NCHW, channels-last, a
batch slice of either ...); ``spatial_strides`` says which. ``TUNING`` holds the block and schedule
rules so a sweep can change them at run time.

Host cost: a fwd+bwd of a small activation (8x1280x32x32) is over in tens of microseconds on the GPU,
so the Python around the launches decides the wall time. Everything that depends only on the input's
geometry (shape, strides, dtypes, flags, ``TUNING``) is computed once into a ``_Plan``; the plan's
``BoundLaunch`` objects (``culmen.ops.common.launch``) keep the compiled kernel after the first
call and launch it directly. A call then costs the plan lookup, the output allocations and one
``CompiledKernel.run`` per kernel.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl
from torch import Tensor

from culmen.ops.backend import device_guard, num_programs_hint
from culmen.ops.common.launch import BoundLaunch as _Launch
from culmen.ops.common.launch import FastLauncher
from culmen.ops.common.launch import aligned_16 as _aligned
from culmen.ops.common.launch import raw_stream as _stream
from culmen.ops.group_norm.kernels import (
    _gn_bwd_dx_kernel,
    _gn_bwd_fused_kernel,
    _gn_bwd_reduce_kernel,
    _gn_dwdb_kernel,
    _gn_fwd_fused_kernel,
    _gn_fwd_split_kernel,
    _gn_stats_kernel,
)
from culmen.ops.group_norm.reference import spatial_strides, stats_dtype

_fwd_fused = FastLauncher(_gn_fwd_fused_kernel)
_stats = FastLauncher(_gn_stats_kernel)
_fwd_split = FastLauncher(_gn_fwd_split_kernel)
_bwd_fused = FastLauncher(_gn_bwd_fused_kernel)
_bwd_reduce = FastLauncher(_gn_bwd_reduce_kernel)
_bwd_dx = FastLauncher(_gn_bwd_dx_kernel)
_dwdb = FastLauncher(_gn_dwdb_kernel)

TUNING = {
    # Elements of one (channels x positions) tile.
    "tile": 4096,
    # Channels-last: the widest block of a group's channels (the unit-stride axis).
    "max_block_d_cl": 64,
    # One program per group (the fused schedule) once there are this many groups per multiprocessor.
    "fused_min_groups_per_sm": 1.0,
    # Fused schedule: bytes of groups in flight (programs x bytes each re-reads) to keep within L2, so
    # the second pass over a group hits L2; fewer programs (never fewer than one per multiprocessor)
    # then loop over several groups. 0 turns the cap off (one program per group): measured faster on an
    # H100 at every Stable-Diffusion shape (parallelism matters more than the L2 hits).
    "fused_l2_budget": 0,
    # Split schedule: programs to aim for per multiprocessor, and the most chunks per group.
    "split_programs_per_sm": 4,
    "max_splits": 64,
    "num_warps": 8,
    # Warps of a fused program when there are at most ``few_groups_per_sm`` groups per multiprocessor:
    # each of the few programs then needs more bytes in flight (H100: 16 warps 10-40% faster at 256
    # groups, 8 faster at 512).
    "num_warps_few": 16,
    "few_groups_per_sm": 2.0,
    # The backward moves two inputs per element: its fused-schedule tile is ``bwd_tile_mult`` times larger.
    "bwd_tile_mult": 2,
    # The final weight/bias-gradient reduction.
    "dwdb_block_c": 64,
    "dwdb_block_r": 32,
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``); plain ints (``triton.next_power_of_2`` costs
    microseconds of host time per call)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _acc(x: Tensor):
    return tl.float64 if x.dtype == torch.float64 else tl.float32


def _blocks(D: int, L: int, channels_last: bool, tile: int) -> tuple[int, int]:
    """``(BLOCK_D, BLOCK_L)`` of a ``tile``-element tile: the unit-stride axis gets the long side."""
    if channels_last:
        bd = min(_pow2(D), TUNING["max_block_d_cl"])
        bl = max(1, min(tile // bd, _pow2(L)))
    else:
        bl = min(_pow2(L), tile)
        bd = max(1, min(_pow2(D), tile // bl))
    return bd, bl


def _plan(N: int, G: int, L: int, block_l: int, dev: torch.device) -> tuple[int, int]:
    """``(S, Lc)``: chunks per group and chunk length; ``S == 1`` is the fused schedule."""
    groups = N * G
    sms = num_programs_hint(dev)
    if groups >= TUNING["fused_min_groups_per_sm"] * sms or L <= block_l:
        return 1, L
    want = max(1, min(TUNING["max_splits"], _cdiv(TUNING["split_programs_per_sm"] * sms, groups),
                      _cdiv(L, block_l)))
    lc = _cdiv(_cdiv(L, want), block_l) * block_l
    return _cdiv(L, lc), lc


def _fused_programs(groups: int, group_bytes: int, dev: torch.device) -> int:
    """Programs of the fused schedule: one per group, capped so that their groups fit the L2 budget."""
    budget = TUNING["fused_l2_budget"]
    if budget <= 0:
        return groups
    return max(1, min(groups, max(num_programs_hint(dev), budget // max(group_bytes, 1))))


def _strides(t: Tensor) -> tuple[int, int, int]:
    s = spatial_strides(t)
    assert s is not None, "the op layer passes tensors whose spatial dims collapse"
    return s


def _num_warps(S: int, groups: int, dev: torch.device) -> int:
    if S == 1 and groups <= TUNING["few_groups_per_sm"] * num_programs_hint(dev):
        return TUNING["num_warps_few"]
    return TUNING["num_warps"]


_PLANS: dict = {}


def _geometry(x: Tensor, G: int) -> tuple[int, int, int, int]:
    N, C = x.shape[0], x.shape[1]
    return N, C, math.prod(x.shape[2:]), C // G


class _FwdPlan:
    __slots__ = ("N", "G", "stats", "split", "part_shape", "launches")

    def __init__(self, x: Tensor, has_w: bool, has_b: bool, G: int, silu: bool):
        N, C, L, D = _geometry(x, G)
        dev = x.device
        self.N, self.G, self.stats = N, G, stats_dtype(x)
        sx = _strides(x)
        sy = _strides(torch.empty_like(x))  # the strides every later y = empty_like(x) gets
        bd, bl = _blocks(D, L, sx[1] == 1 and L > 1, TUNING["tile"])
        S, lc = _plan(N, G, L, bl, dev)
        meta = {"D": D, "ACC": _acc(x), "HAS_W": has_w, "HAS_B": has_b, "SILU": bool(silu)}
        nw = _num_warps(S, N * G, dev)
        self.split = S > 1
        self.part_shape = (N * G, S, 2)
        # args after the tensors: per launch
        if S == 1:
            progs = _fused_programs(N * G, D * L * x.element_size(), dev)
            self.launches = ((_Launch(_fwd_fused, (progs,), {**meta, "BLOCK_D": bd, "BLOCK_L": bl}, nw),
                              (N * G, G, L, *sx, *sy)),)
        else:
            self.launches = (
                (_Launch(_stats, (N * G, S), {"D": D, "ACC": meta["ACC"], "BLOCK_D": bd, "BLOCK_L": bl}, nw),
                 (G, L, lc, *sx)),
                (_Launch(_fwd_split, (N * G, S), {**meta, "BLOCK_S": _pow2(S), "BLOCK_D": bd, "BLOCK_L": bl}, nw),
                 (G, L, lc, *sx, *sy)),
            )


class _BwdPlan:
    __slots__ = ("N", "G", "C", "S", "stats", "store_dw", "launches", "dwdb")

    def __init__(self, dy: Tensor, x: Tensor, has_w: bool, has_b: bool, G: int, silu: bool, need_dw: bool):
        N, C, L, D = _geometry(x, G)
        dev = x.device
        self.N, self.G, self.C, self.stats = N, G, C, stats_dtype(x)
        sd, sx = _strides(dy), _strides(x)
        sg = _strides(torch.empty_like(x))
        cl = sx[1] == 1 and L > 1
        bd, bl = _blocks(D, L, cl, TUNING["tile"] * TUNING["bwd_tile_mult"])
        S, lc = _plan(N, G, L, bl, dev)
        if S > 1:  # the split schedule keeps the forward's tile (H100, 1x640x64x64: 21.5 vs 24.1 us)
            bd, bl = _blocks(D, L, cl, TUNING["tile"])
            S, lc = _plan(N, G, L, bl, dev)
        self.S = S
        self.store_dw = store_dw = need_dw and (has_w or has_b)
        meta = {"D": D, "ACC": _acc(x), "HAS_W": has_w, "HAS_B": has_b, "SILU": bool(silu)}
        nw = _num_warps(S, N * G, dev)
        if S == 1:
            progs = _fused_programs(N * G, D * L * (x.element_size() + dy.element_size()), dev)
            self.launches = ((_Launch(_bwd_fused, (progs,), {**meta, "STORE_DW": store_dw, "BLOCK_D": bd,
                                                             "BLOCK_L": bl}, nw),
                              (N * G, G, L, C, *sd, *sx, *sg)),)
        else:
            self.launches = (
                (_Launch(_bwd_reduce, (N * G, S), {**meta, "STORE_DW": store_dw, "BLOCK_D": bd, "BLOCK_L": bl}, nw),
                 (G, L, lc, C, *sd, *sx)),
                (_Launch(_bwd_dx, (N * G, S), {**meta, "BLOCK_S": _pow2(S), "BLOCK_D": bd, "BLOCK_L": bl}, nw),
                 (G, L, lc, *sd, *sx, *sg)),
            )
        self.dwdb = None
        if store_dw:
            bc = min(TUNING["dwdb_block_c"], _pow2(C))
            br = min(TUNING["dwdb_block_r"], _pow2(N * S))
            self.dwdb = (_Launch(_dwdb, (_cdiv(C, bc),), {"HAS_W": has_w, "HAS_B": has_b, "BLOCK_R": br,
                                                          "BLOCK_C": bc}, 4), (N * S, C))


def _key(kind: str, x: Tensor, *rest) -> tuple:
    return (kind, x.shape, x.stride(), x.dtype, x.device, *rest, *TUNING.values())


def group_norm_fwd(x: Tensor, weight: Tensor | None, bias: Tensor | None, G: int, eps: float,
                   silu: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Forward: ``(y, mean, rstd)``; ``y`` like ``x`` (same dtype and memory format), ``mean``/``rstd``
    ``(N, G)`` fp32 (fp64 for fp64 ``x``)."""
    key = _key("f", x, G, silu, None if weight is None else weight.dtype, None if bias is None else bias.dtype)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) > 512:
            _PLANS.clear()
        plan = _PLANS[key] = _FwdPlan(x, weight is not None, bias is not None, G, silu)
    dev = x.device
    y = torch.empty_like(x)
    mean = torch.empty((plan.N, G), device=dev, dtype=plan.stats)
    rstd = torch.empty((plan.N, G), device=dev, dtype=plan.stats)
    if x.numel() == 0:
        return y, mean.zero_(), rstd.fill_(float(eps) ** -0.5 if eps > 0 else float("inf"))
    w = weight if weight is not None else x
    b = bias if bias is not None else x
    aligned = _aligned(x, w, b)
    eps = float(eps)
    with device_guard(dev):
        stream = _stream(dev)
        if not plan.split:
            (launch, tail), = plan.launches
            launch((x, y, w, b, mean, rstd, *tail, eps), aligned, stream)
        else:
            part = torch.empty(plan.part_shape, device=dev, dtype=plan.stats)
            (l1, t1), (l2, t2) = plan.launches
            l1((x, part, *t1), aligned, stream)
            l2((x, y, w, b, part, mean, rstd, *t2, eps), aligned, stream)
    return y, mean, rstd


def group_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor,
                   G: int, silu: bool, need_dw: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Backward: ``(dx, dweight, dbias)``; ``dx`` like ``x``, ``dweight``/``dbias`` in the parameter dtypes
    (``None`` without the parameter or when ``need_dw`` is false)."""
    key = _key("b", x, dy.stride(), dy.dtype, G, silu, need_dw, None if weight is None else weight.dtype,
               None if bias is None else bias.dtype)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) > 512:
            _PLANS.clear()
        plan = _PLANS[key] = _BwdPlan(dy, x, weight is not None, bias is not None, G, silu, need_dw)
    dev = x.device
    dx = torch.empty_like(x)
    store_dw = plan.store_dw
    dw = torch.empty_like(weight) if (store_dw and weight is not None) else None
    db = torch.empty_like(bias) if (store_dw and bias is not None) else None
    if x.numel() == 0:
        return dx, (dw.zero_() if dw is not None else None), (db.zero_() if db is not None else None)
    # Per-(row, channel) partial sums of the weight gradient, then of the bias gradient: one buffer, the
    # kernels find the second plane at ``plane`` elements.
    pw = torch.empty((2, plan.N * plan.S, plan.C), device=dev, dtype=plan.stats) if store_dw else mean
    plane = plan.N * plan.S * plan.C if store_dw else 0
    w = weight if weight is not None else x
    b = bias if bias is not None else x
    aligned = _aligned(dy, x, w, b, mean, rstd)
    with device_guard(dev):
        stream = _stream(dev)
        if plan.S == 1:
            (launch, tail), = plan.launches
            launch((dy, x, dx, w, b, mean, rstd, pw, plane, *tail), aligned, stream)
        else:
            pc = torch.empty((plan.N * plan.G, plan.S, 2), device=dev, dtype=plan.stats)
            (l1, t1), (l2, t2) = plan.launches
            l1((dy, x, w, b, mean, rstd, pw, plane, pc, *t1), aligned, stream)
            l2((dy, x, dx, w, b, mean, rstd, pc, *t2), aligned, stream)
        if store_dw:
            launch, tail = plan.dwdb
            launch((pw, dw if dw is not None else pw, db if db is not None else pw, *tail), aligned, stream)
    return dx, dw, db
