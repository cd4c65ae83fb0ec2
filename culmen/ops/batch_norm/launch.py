"""Launchers of the batch-norm kernels: allocate, pick blocks and splits, launch.

Inputs come in one of two canonical contiguous layouts (see ``kernels.py``): ``(N, C, L)`` for NCHW
(``channel_last=False``) and ``(M, C)`` for channel-last. ``TUNING`` holds the block rules so a sweep
can change them at run time.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from culmen.ops.backend import device_guard
from culmen.ops.batch_norm.kernels import (
    _bn_bwd_finalize_kernel,
    _bn_bwd_nchw_kernel,
    _bn_bwd_nhwc_kernel,
    _bn_bwd_reduce_nchw_kernel,
    _bn_bwd_reduce_nhwc_kernel,
    _bn_combine_kernel,
    _bn_fwd_nchw_kernel,
    _bn_fwd_nhwc_kernel,
    _bn_stats_nchw_kernel,
    _bn_stats_nhwc_kernel,
)
from culmen.ops.common.launch import FastLauncher

_stats_nchw = FastLauncher(_bn_stats_nchw_kernel)
_stats_nhwc = FastLauncher(_bn_stats_nhwc_kernel)
_combine = FastLauncher(_bn_combine_kernel)
_fwd_nchw = FastLauncher(_bn_fwd_nchw_kernel)
_fwd_nhwc = FastLauncher(_bn_fwd_nhwc_kernel)
_bwd_reduce_nchw = FastLauncher(_bn_bwd_reduce_nchw_kernel)
_bwd_reduce_nhwc = FastLauncher(_bn_bwd_reduce_nhwc_kernel)
_bwd_finalize = FastLauncher(_bn_bwd_finalize_kernel)
_bwd_nchw = FastLauncher(_bn_bwd_nchw_kernel)
_bwd_nhwc = FastLauncher(_bn_bwd_nhwc_kernel)

TUNING = {
    # Elements of one tile of the elementwise kernels and of the reductions.
    "elem_tile": 4096,
    "reduce_tile": 2048,
    # Programs the reductions aim for (split until about this many), per device type.
    "reduce_programs_cuda": 512,
    "reduce_programs_cpu": 16,
    # Largest per-rank payload (bytes) of split statistics sent as they are; above, merged locally first.
    "max_gather_bytes": 1 << 17,
    # Most splits of one channel (partials rows): bounds the combine's serial work.
    "max_splits": 512,
    # Widest channel block of the channel-last kernels.
    "max_block_c": 64,
    "num_warps": 4,
}




def _block_l(L: int) -> int:
    """Width of the NCHW tiles along ``L``: the widest power of two that wastes at most ~15% of a row."""
    if L <= 64:
        return triton.next_power_of_2(max(L, 1))
    best, best_waste = 64, None
    for bl in (1024, 512, 256, 128, 64):
        waste = triton.cdiv(L, bl) * bl / L
        if waste <= 1.15:
            return bl
        if best_waste is None or waste < best_waste:
            best, best_waste = bl, waste
    return best


def _block_c(C: int) -> int:
    return min(TUNING["max_block_c"], triton.next_power_of_2(max(C, 1)))


def _target_programs(dev: torch.device) -> int:
    """Programs a reduction aims for. A constant per device type (not the multiprocessor count), so that
    every rank of a process group splits its statistics the same way (see ``stats_rows``)."""
    return TUNING["reduce_programs_cuda"] if dev.type == "cuda" else TUNING["reduce_programs_cpu"]


def _nchw_reduce_plan(N: int, C: int, L: int, dev: torch.device, fixed: bool = False):
    """Blocks and splits of the NCHW reductions: grid ``(C, S_r * S_l)``. With ``fixed`` the number of
    splits does not depend on ``N`` (splits past the batch are empty)."""
    block_l = min(_block_l(L), TUNING["reduce_tile"])
    block_r = max(1, min(TUNING["reduce_tile"] // block_l, triton.next_power_of_2(N)))
    want = max(1, min(TUNING["max_splits"], triton.cdiv(_target_programs(dev), C)))
    col_blocks = triton.cdiv(L, block_l)
    if fixed:
        s_l = max(1, min(want, col_blocks))
        cols_per = triton.cdiv(col_blocks, s_l) * block_l
        s_l = triton.cdiv(L, cols_per) if L else 1
        s_r = triton.cdiv(want, s_l)
        rows_per = max(1, triton.cdiv(N, s_r))
        return block_r, block_l, rows_per, s_r, cols_per, s_l
    row_blocks = triton.cdiv(N, block_r)
    s_r = min(want, row_blocks)
    rows_per = triton.cdiv(row_blocks, s_r) * block_r
    s_r = triton.cdiv(N, rows_per)
    s_l = max(1, min(triton.cdiv(want, s_r), col_blocks))
    cols_per = triton.cdiv(col_blocks, s_l) * block_l
    s_l = triton.cdiv(L, cols_per)
    return block_r, block_l, rows_per, s_r, cols_per, s_l


def _nhwc_reduce_plan(M: int, C: int, dev: torch.device, fixed: bool = False):
    """Blocks and splits of the channel-last reductions: grid ``(C / BLOCK_C, S)``. With ``fixed`` the
    number of splits does not depend on ``M``."""
    block_c = _block_c(C)
    block_m = max(1, min(TUNING["reduce_tile"] // block_c, triton.next_power_of_2(M)))
    col_programs = triton.cdiv(C, block_c)
    want = max(1, min(TUNING["max_splits"], triton.cdiv(_target_programs(dev), col_programs)))
    if fixed:
        return block_m, block_c, max(1, triton.cdiv(M, want)), want
    row_blocks = triton.cdiv(M, block_m)
    s = min(want, row_blocks)
    rows_per = triton.cdiv(row_blocks, s) * block_m
    return block_m, block_c, rows_per, triton.cdiv(M, rows_per)


def _stats_splits(C: int, L: int, channel_last: bool, dev: torch.device) -> int:
    if channel_last:
        return _nhwc_reduce_plan(1, C, dev, fixed=True)[3]
    plan = _nchw_reduce_plan(1, C, L, dev, fixed=True)
    return plan[3] * plan[5]


def stats_rows(C: int, L: int, channel_last: bool, dev: torch.device) -> int:
    """Rows of packed statistics ``bn_stats`` returns for ``C`` channels (of ``L`` elements per sample,
    NCHW): the per-split partials themselves when they are few (the all-gather carries them and the
    combine merges every rank's splits at once, one launch less), else one row merged locally. It
    depends on the shape's ``C``/``L`` and the device type only, never on the batch size, so every rank
    of a group (whatever its share of the batch) sends the same number of rows."""
    S = _stats_splits(C, L, channel_last, dev)
    return S if S * (2 * C + 2) * 4 <= TUNING["max_gather_bytes"] else 1


def _packed(rows: int, C: int, dev: torch.device) -> tuple[Tensor, Tensor]:
    """A ``(rows, 2C + 2)`` fp32 buffer of packed statistics and its int64 view."""
    buf = torch.empty((rows, 2 * C + 2), device=dev, dtype=torch.float32)
    return buf, buf.view(torch.int64)


def _dims(x: Tensor, channel_last: bool) -> tuple[int, int, int]:
    """``(N, C, L)`` of an NCHW input, ``(M, C, 1)`` of a channel-last one."""
    if channel_last:
        return x.shape[0], x.shape[1], 1
    return x.shape[0], x.shape[1], x.shape[2]


def bn_stats(x: Tensor, channel_last: bool) -> Tensor:
    """Per-channel ``(mean, M2, count)`` of this process's ``x``: ``(stats_rows(...), 2C + 2)`` fp32 packed rows
    (partials of disjoint parts of the batch, merged by ``bn_combine``).

    ``x``: ``(N, C, L)`` (NCHW) or ``(M, C)`` (channel-last), contiguous, fp16/bf16/fp32, non-empty.
    """
    dev = x.device
    N, C, L = _dims(x, channel_last)
    with device_guard(dev):
        if channel_last:
            block_m, block_c, rows_per, S = _nhwc_reduce_plan(N, C, dev, fixed=True)
            part, part64 = _packed(S, C, dev)
            _stats_nhwc((triton.cdiv(C, block_c), S), (x, part, part64, N, C, part.stride(0), part64.stride(0),
                                                       rows_per),
                        dict(BLOCK_M=block_m, BLOCK_C=block_c), TUNING["num_warps"])
        else:
            block_r, block_l, rows_per, s_r, cols_per, s_l = _nchw_reduce_plan(N, C, L, dev, fixed=True)
            S = s_r * s_l
            part, part64 = _packed(S, C, dev)
            _stats_nchw((C, S), (x, part, part64, N, C, L, part.stride(0), part64.stride(0), rows_per, cols_per,
                                 s_l),
                        dict(BLOCK_R=block_r, BLOCK_L=block_l), TUNING["num_warps"])
        if S == 1 or stats_rows(C, L, channel_last, dev) == S:
            return part
        out, out64 = _packed(1, C, dev)
        _launch_combine(part, part64, C, out=out, out64=out64)
    return out


def _launch_combine(part, part64, C, *, out=None, out64=None, mean=None, invstd=None, cnt=None, running_mean=None,
                    running_var=None, momentum=0.0, eps=0.0):
    R = part.shape[0]
    block_c = min(128, triton.next_power_of_2(C))
    block_r = max(1, min(32, triton.next_power_of_2(R)))
    final = mean is not None
    update = running_mean is not None
    _combine((triton.cdiv(C, block_c),),
             (part, part64, R, C, part.stride(0), part64.stride(0), out, out64, mean, invstd, cnt, running_mean,
              running_var, float(momentum), float(eps)),
             dict(FINAL=final, UPDATE_RUNNING=update, BLOCK_R=block_r, BLOCK_C=block_c), 4)


def bn_combine(stats: Tensor, running_mean: Tensor | None, running_var: Tensor | None, momentum: float,
               eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Merge packed statistics ``stats`` ``(R, 2C + 2)`` (one row per rank) into the batch's.

    Returns ``(mean, invstd, count)``: ``(C,)`` fp32, ``(C,)`` fp32 with ``invstd = 1/sqrt(var + eps)`` of
    the biased variance, and the int64 element count per channel ``(1,)``. When ``running_mean`` /
    ``running_var`` are given they are updated in place with ``momentum`` (the variance unbiased).
    """
    dev = stats.device
    C = (stats.shape[1] - 2) // 2
    stats = stats.contiguous()
    out = torch.empty((2 * C + 2,), device=dev, dtype=torch.float32)  # one allocation for the three
    mean, invstd, cnt = out[:C], out[C:2 * C], out[2 * C:].view(torch.int64)
    with device_guard(dev):
        _launch_combine(stats, stats.view(torch.int64), C, mean=mean, invstd=invstd, cnt=cnt,
                        running_mean=running_mean, running_var=running_var, momentum=momentum, eps=eps)
    return mean, invstd, cnt


def _elem_plan_nchw(NC: int, L: int):
    block_l = _block_l(L)
    while triton.cdiv(L, block_l) > 65535:
        block_l *= 2
    block_r = max(1, min(TUNING["elem_tile"] // block_l, triton.next_power_of_2(NC)))
    return block_r, block_l


def _elem_plan_nhwc(M: int, C: int):
    block_c = _block_c(C)
    block_m = max(1, min(TUNING["elem_tile"] // block_c, triton.next_power_of_2(M)))
    return block_m, block_c


def bn_fwd(x: Tensor, z: Tensor | None, mean: Tensor, invstd: Tensor, weight: Tensor | None, bias: Tensor | None,
           fuse_relu: bool, channel_last: bool) -> Tensor:
    """``y = relu?((x - mean) * invstd * weight + bias + z)``, in ``x``'s dtype and layout."""
    dev = x.device
    N, C, L = _dims(x, channel_last)
    y = torch.empty_like(x)
    meta = dict(HAS_W=weight is not None, HAS_B=bias is not None, HAS_Z=z is not None, RELU=fuse_relu)
    with device_guard(dev):
        if channel_last:
            bm, bc = _elem_plan_nhwc(N, C)
            _fwd_nhwc((triton.cdiv(N, bm), triton.cdiv(C, bc)), (x, z, y, mean, invstd, weight, bias, N, C),
                      dict(**meta, BLOCK_M=bm, BLOCK_C=bc), TUNING["num_warps"])
        else:
            br, bl = _elem_plan_nchw(N * C, L)
            _fwd_nchw((triton.cdiv(N * C, br), triton.cdiv(L, bl)),
                      (x, z, y, mean, invstd, weight, bias, N * C, C, L),
                      dict(**meta, BLOCK_R=br, BLOCK_L=bl), TUNING["num_warps"])
    return y


def bn_bwd_reduce(dy: Tensor, x: Tensor, y: Tensor | None, mean: Tensor, invstd: Tensor, weight: Tensor | None,
                  bias: Tensor | None, fuse_relu: bool, channel_last: bool, store_dz: bool):
    """This process's ``sums = [sum dy | sum dy (x - mean)]`` ``(2C,)`` fp32, ``dweight``, ``dbias`` (in the
    parameters' dtypes, ``None`` when absent) and, with ``store_dz``, ``dz`` = the ReLU-masked ``dy``.
    ``y`` is the forward's output, needed with ``fuse_relu``."""
    dev = x.device
    N, C, L = _dims(x, channel_last)
    dz = torch.empty_like(dy) if store_dz else None
    with device_guard(dev):
        if channel_last:
            block_m, block_c, rows_per, S = _nhwc_reduce_plan(N, C, dev)
            part = torch.empty((S, 2 * C), device=dev, dtype=torch.float32)
            _bwd_reduce_nhwc((triton.cdiv(C, block_c), S), (dy, x, y, dz, mean, part, N, C, rows_per),
                             dict(RELU=fuse_relu, STORE_DZ=store_dz, BLOCK_M=block_m, BLOCK_C=block_c),
                             TUNING["num_warps"])
        else:
            block_r, block_l, rows_per, s_r, cols_per, s_l = _nchw_reduce_plan(N, C, L, dev)
            S = s_r * s_l
            part = torch.empty((S, 2 * C), device=dev, dtype=torch.float32)
            _bwd_reduce_nchw((C, S), (dy, x, y, dz, mean, part, N, C, L, rows_per, cols_per, s_l),
                             dict(RELU=fuse_relu, STORE_DZ=store_dz, BLOCK_R=block_r, BLOCK_L=block_l),
                             TUNING["num_warps"])
        sums = torch.empty((2 * C,), device=dev, dtype=torch.float32)
        dw = torch.empty_like(weight) if weight is not None else None
        db = torch.empty_like(bias) if bias is not None else None
        block_c = min(128, triton.next_power_of_2(C))
        _bwd_finalize((triton.cdiv(C, block_c),), (part, S, C, invstd, sums, dw, db),
                      dict(HAS_DW=dw is not None, HAS_DB=db is not None,
                           BLOCK_S=max(1, min(32, triton.next_power_of_2(S))), BLOCK_C=block_c), 4)
    return sums, dw, db, dz


def bn_bwd(dy: Tensor, x: Tensor, y: Tensor | None, mean: Tensor, invstd: Tensor, weight: Tensor | None,
           sums: Tensor, count: Tensor, fuse_relu: bool, training: bool, channel_last: bool) -> Tensor:
    """``dx`` from the group-wide ``sums`` (see ``bn_bwd_reduce``) and element ``count`` (int64 ``(1,)``)."""
    dev = x.device
    N, C, L = _dims(x, channel_last)
    dx = torch.empty_like(x)
    meta = dict(HAS_W=weight is not None, RELU=fuse_relu, TRAINING=training)
    with device_guard(dev):
        if channel_last:
            bm, bc = _elem_plan_nhwc(N, C)
            _bwd_nhwc((triton.cdiv(N, bm), triton.cdiv(C, bc)),
                      (dy, x, y, dx, mean, invstd, weight, sums, count, N, C),
                      dict(**meta, BLOCK_M=bm, BLOCK_C=bc), TUNING["num_warps"])
        else:
            br, bl = _elem_plan_nchw(N * C, L)
            _bwd_nchw((triton.cdiv(N * C, br), triton.cdiv(L, bl)),
                      (dy, x, y, dx, mean, invstd, weight, sums, count, N * C, C, L),
                      dict(**meta, BLOCK_R=br, BLOCK_L=bl), TUNING["num_warps"])
    return dx
