"""Launchers of the GroupNorm kernels: view the input as ``(N, C, L)``, pick tiles and the schedule, launch.

Any input whose spatial dims collapse into one stride is taken as it is (NCHW, channels-last, a
batch slice of either ...); ``spatial_strides`` says which. ``TUNING`` holds the block and schedule
rules so a sweep can change them at run time.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from culmen.ops.backend import device_guard, num_programs_hint
from culmen.ops.common.launch import FastLauncher
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
    # then loop over several groups. 0 turns the cap off (one program per group).
    "fused_l2_budget": 32 << 20,
    # Split schedule: programs to aim for per multiprocessor, and the most chunks per group.
    "split_programs_per_sm": 4,
    "max_splits": 64,
    "num_warps": 8,
    # The final weight/bias-gradient reduction.
    "dwdb_block_c": 64,
    "dwdb_block_r": 32,
}


def _acc(x: Tensor):
    return tl.float64 if x.dtype == torch.float64 else tl.float32


def _dims(x: Tensor, G: int) -> tuple[int, int, int, int]:
    N, C = x.shape[0], x.shape[1]
    return N, C, math.prod(x.shape[2:]), C // G


def _blocks(D: int, L: int, channels_last: bool) -> tuple[int, int]:
    """``(BLOCK_D, BLOCK_L)``: the unit-stride axis gets the long side of the tile."""
    tile = TUNING["tile"]
    if channels_last:
        bd = min(triton.next_power_of_2(D), TUNING["max_block_d_cl"])
        bl = max(1, min(tile // bd, triton.next_power_of_2(L)))
    else:
        bl = min(triton.next_power_of_2(L), tile)
        bd = max(1, min(triton.next_power_of_2(D), tile // bl))
    return bd, bl


def _plan(N: int, G: int, L: int, block_l: int, dev: torch.device) -> tuple[int, int]:
    """``(S, Lc)``: chunks per group and chunk length; ``S == 1`` is the fused schedule."""
    groups = N * G
    sms = num_programs_hint(dev)
    if groups >= TUNING["fused_min_groups_per_sm"] * sms or L <= block_l:
        return 1, L
    want = max(1, min(TUNING["max_splits"], triton.cdiv(TUNING["split_programs_per_sm"] * sms, groups),
                      triton.cdiv(L, block_l)))
    lc = triton.cdiv(triton.cdiv(L, want), block_l) * block_l
    return triton.cdiv(L, lc), lc


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


def group_norm_fwd(x: Tensor, weight: Tensor | None, bias: Tensor | None, G: int, eps: float,
                   silu: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Forward: ``(y, mean, rstd)``; ``y`` like ``x`` (same dtype and memory format), ``mean``/``rstd``
    ``(N, G)`` fp32 (fp64 for fp64 ``x``)."""
    N, C, L, D = _dims(x, G)
    dev = x.device
    y = torch.empty_like(x)
    mean = torch.empty((N, G), device=dev, dtype=stats_dtype(x))
    rstd = torch.empty_like(mean)
    if x.numel() == 0:
        return y, mean.zero_(), rstd.fill_(float(eps) ** -0.5 if eps > 0 else float("inf"))
    sx, sy = _strides(x), _strides(y)
    bd, bl = _blocks(D, L, sx[1] == 1 and L > 1)
    S, lc = _plan(N, G, L, bl, dev)
    w = weight if weight is not None else x
    b = bias if bias is not None else x
    meta = {"D": D, "ACC": _acc(x), "HAS_W": weight is not None, "HAS_B": bias is not None, "SILU": bool(silu)}
    nw = TUNING["num_warps"]
    with device_guard(dev):
        if S == 1:
            progs = _fused_programs(N * G, D * L * x.element_size(), dev)
            _fwd_fused((progs,), (x, y, w, b, mean, rstd, N * G, G, L, *sx, *sy, float(eps)),
                       {**meta, "BLOCK_D": bd, "BLOCK_L": bl}, num_warps=nw)
        else:
            part = torch.empty((N * G, S, 2), device=dev, dtype=mean.dtype)
            _stats((N * G, S), (x, part, G, L, lc, *sx), {"D": D, "ACC": meta["ACC"], "BLOCK_D": bd, "BLOCK_L": bl},
                   num_warps=nw)
            _fwd_split((N * G, S), (x, y, w, b, part, mean, rstd, G, L, lc, *sx, *sy, float(eps)),
                       {**meta, "BLOCK_S": triton.next_power_of_2(S), "BLOCK_D": bd, "BLOCK_L": bl}, num_warps=nw)
    return y, mean, rstd


def group_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor,
                   G: int, silu: bool, need_dw: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Backward: ``(dx, dweight, dbias)``; ``dx`` like ``x``, ``dweight``/``dbias`` in the parameter dtypes
    (``None`` without the parameter or when ``need_dw`` is false)."""
    N, C, L, D = _dims(x, G)
    dev = x.device
    dx = torch.empty_like(x)
    store_dw = need_dw and (weight is not None or bias is not None)
    dw = torch.empty_like(weight) if (store_dw and weight is not None) else None
    db = torch.empty_like(bias) if (store_dw and bias is not None) else None
    if x.numel() == 0:
        return dx, (dw.zero_() if dw is not None else None), (db.zero_() if db is not None else None)
    sd, sx, sg = _strides(dy), _strides(x), _strides(dx)
    bd, bl = _blocks(D, L, sx[1] == 1 and L > 1)
    S, lc = _plan(N, G, L, bl, dev)
    acc_dtype = stats_dtype(x)
    pw = torch.empty((N * S, C), device=dev, dtype=acc_dtype) if store_dw else mean
    pb = torch.empty((N * S, C), device=dev, dtype=acc_dtype) if store_dw else mean
    w = weight if weight is not None else x
    b = bias if bias is not None else x
    meta = {"D": D, "ACC": _acc(x), "HAS_W": weight is not None, "HAS_B": bias is not None, "SILU": bool(silu)}
    nw = TUNING["num_warps"]
    with device_guard(dev):
        if S == 1:
            progs = _fused_programs(N * G, D * L * (x.element_size() + dy.element_size()), dev)
            _bwd_fused((progs,), (dy, x, dx, w, b, mean, rstd, pw, pb, N * G, G, L, C, *sd, *sx, *sg),
                       {**meta, "STORE_DW": store_dw, "BLOCK_D": bd, "BLOCK_L": bl}, num_warps=nw)
        else:
            pc = torch.empty((N * G, S, 2), device=dev, dtype=acc_dtype)
            _bwd_reduce((N * G, S), (dy, x, w, b, mean, rstd, pw, pb, pc, G, L, lc, C, *sd, *sx),
                        {**meta, "STORE_DW": store_dw, "BLOCK_D": bd, "BLOCK_L": bl}, num_warps=nw)
            _bwd_dx((N * G, S), (dy, x, dx, w, b, mean, rstd, pc, G, L, lc, *sd, *sx, *sg),
                    {**meta, "BLOCK_S": triton.next_power_of_2(S), "BLOCK_D": bd, "BLOCK_L": bl}, num_warps=nw)
        if store_dw:
            bc = min(TUNING["dwdb_block_c"], triton.next_power_of_2(C))
            br = min(TUNING["dwdb_block_r"], triton.next_power_of_2(N * S))
            _dwdb((triton.cdiv(C, bc),), (pw, pb, dw if dw is not None else pw, db if db is not None else pb, N * S, C),
                  {"HAS_W": dw is not None, "HAS_B": db is not None, "BLOCK_R": br, "BLOCK_C": bc}, num_warps=4)
    return dx, dw, db
