"""Launchers of the batch-norm kernels: allocate, pick blocks and splits, launch.

Inputs are in one of two canonical memory orders (see ``kernels.py``): ``(N, C, L)`` for NCHW
(``channel_last=False``) and ``(M, C)`` for channel-last; the kernels see raw pointers, so any tensor
whose memory is in that order (a 4-D ``channels_last`` tensor, say) is passed as it is.

Everything that depends only on the shape, layout and device (blocks, splits, grids, the compiled
kernel of each specialization) lives in a cached ``BNPlan``: a call costs one dict lookup and the
launches. Batch norm runs once per layer and step, and on a slow host the Python of planning every
call cost more than the kernels themselves at ResNet's late stages. ``TUNING`` holds the block rules
so a sweep can change them at run time (plans are keyed by its values).
"""

from __future__ import annotations

import torch
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
from culmen.ops.common.launch import BoundLaunch, FastLauncher, cdiv, next_pow2, raw_stream

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
        return next_pow2(max(L, 1))
    best, best_waste = 64, None
    for bl in (1024, 512, 256, 128, 64):
        waste = cdiv(L, bl) * bl / L
        if waste <= 1.15:
            return bl
        if best_waste is None or waste < best_waste:
            best, best_waste = bl, waste
    return best


def _block_c(C: int) -> int:
    return min(TUNING["max_block_c"], next_pow2(max(C, 1)))


def _target_programs(dev: torch.device) -> int:
    """Programs a reduction aims for. A constant per device type (not the multiprocessor count), so that
    every rank of a process group splits its statistics the same way (see ``stats_rows``)."""
    return TUNING["reduce_programs_cuda"] if dev.type == "cuda" else TUNING["reduce_programs_cpu"]


def _nchw_reduce_plan(N: int, C: int, L: int, dev: torch.device, fixed: bool = False):
    """Blocks and splits of the NCHW reductions: grid ``(C, S_r * S_l)``. With ``fixed`` the number of
    splits does not depend on ``N`` (splits past the batch are empty)."""
    block_l = min(_block_l(L), TUNING["reduce_tile"])
    block_r = max(1, min(TUNING["reduce_tile"] // block_l, next_pow2(N)))
    want = max(1, min(TUNING["max_splits"], cdiv(_target_programs(dev), C)))
    col_blocks = cdiv(L, block_l)
    if fixed:
        s_l = max(1, min(want, col_blocks))
        cols_per = cdiv(col_blocks, s_l) * block_l
        s_l = cdiv(L, cols_per) if L else 1
        s_r = cdiv(want, s_l)
        rows_per = max(1, cdiv(N, s_r))
        return block_r, block_l, rows_per, s_r, cols_per, s_l
    row_blocks = cdiv(N, block_r)
    s_r = min(want, row_blocks)
    rows_per = cdiv(row_blocks, s_r) * block_r
    s_r = cdiv(N, rows_per)
    s_l = max(1, min(cdiv(want, s_r), col_blocks))
    cols_per = cdiv(col_blocks, s_l) * block_l
    s_l = cdiv(L, cols_per)
    return block_r, block_l, rows_per, s_r, cols_per, s_l


def _nhwc_reduce_plan(M: int, C: int, dev: torch.device, fixed: bool = False):
    """Blocks and splits of the channel-last reductions: grid ``(C / BLOCK_C, S)``. With ``fixed`` the
    number of splits does not depend on ``M``."""
    block_c = _block_c(C)
    block_m = max(1, min(TUNING["reduce_tile"] // block_c, next_pow2(M)))
    col_programs = cdiv(C, block_c)
    want = max(1, min(TUNING["max_splits"], cdiv(_target_programs(dev), col_programs)))
    if fixed:
        return block_m, block_c, max(1, cdiv(M, want)), want
    row_blocks = cdiv(M, block_m)
    s = min(want, row_blocks)
    rows_per = cdiv(row_blocks, s) * block_m
    return block_m, block_c, rows_per, cdiv(M, rows_per)


def _elem_plan_nchw(NC: int, L: int):
    block_l = _block_l(L)
    while cdiv(L, block_l) > 65535:
        block_l *= 2
    block_r = max(1, min(TUNING["elem_tile"] // block_l, next_pow2(NC)))
    return block_r, block_l


def _elem_plan_nhwc(M: int, C: int):
    block_c = _block_c(C)
    block_m = max(1, min(TUNING["elem_tile"] // block_c, next_pow2(M)))
    return block_m, block_c


def _aligned(args: tuple) -> bool:
    """Whether every tensor argument's data pointer is 16-byte aligned (the cached kernels assume it)."""
    bits = 0
    for a in args:
        if isinstance(a, Tensor):
            bits |= a.data_ptr()
    return bits & 15 == 0


def _pad4(n: int) -> int:
    """``n`` fp32 elements rounded up to 16 bytes, so the next region of a workspace stays aligned."""
    return (n + 3) & ~3


def _dt(t: Tensor | None):
    return None if t is None else t.dtype


class BNPlan:
    """Blocks, splits, grids and bound launches of one ``(N, C, L)`` shape (``L = 1`` channel-last,
    ``N`` then being the row count ``M``), layout and device. Build through ``plan_for``."""

    def __init__(self, N: int, C: int, L: int, channel_last: bool, dev: torch.device):
        self.N, self.C, self.L, self.cl, self.dev = N, C, L, channel_last, dev
        self.width = W = 2 * C + 2  # one packed statistics row
        self._bound: dict = {}
        if channel_last:
            bm, bc, rows_per, S = _nhwc_reduce_plan(N, C, dev, fixed=True)
            self._stats = (_stats_nhwc, (cdiv(C, bc), S), (N, C, W, W // 2, rows_per), dict(BLOCK_M=bm, BLOCK_C=bc))
            bm, bc, rows_per, Sb = _nhwc_reduce_plan(N, C, dev)
            self._reduce = (_bwd_reduce_nhwc, (cdiv(C, bc), Sb), (N, C, rows_per), dict(BLOCK_M=bm, BLOCK_C=bc))
            bm, bc = _elem_plan_nhwc(N, C)
            self._elem = ((cdiv(N, bm), cdiv(C, bc)), (N, C), dict(BLOCK_M=bm, BLOCK_C=bc))
        else:
            br, bl, rows_per, s_r, cols_per, s_l = _nchw_reduce_plan(N, C, L, dev, fixed=True)
            S = s_r * s_l
            self._stats = (_stats_nchw, (C, S), (N, C, L, W, W // 2, rows_per, cols_per, s_l),
                           dict(BLOCK_R=br, BLOCK_L=bl))
            br, bl, rows_per, s_r, cols_per, s_l = _nchw_reduce_plan(N, C, L, dev)
            Sb = s_r * s_l
            self._reduce = (_bwd_reduce_nchw, (C, Sb), (N, C, L, rows_per, cols_per, s_l),
                            dict(BLOCK_R=br, BLOCK_L=bl))
            br, bl = _elem_plan_nchw(N * C, L)
            self._elem = ((cdiv(N * C, br), cdiv(L, bl)), (N * C, C, L), dict(BLOCK_R=br, BLOCK_L=bl))
        self.splits, self.reduce_splits = S, Sb
        # Rows of statistics this rank sends: its splits themselves when they are few (the combine then
        # merges every rank's splits at once, one launch less), else one row merged locally. It depends
        # on C, L and the device type only, never on the batch, so every rank sends the same number.
        self.rows = S if S * W * 4 <= TUNING["max_gather_bytes"] else 1
        self.stats_numel = _pad4(self.rows * W) + (_pad4(S * W) if self.rows != S else 0)
        self.reduce_numel = _pad4(Sb * 2 * C) + 2 * C  # partial rows, then the summed (2C,)
        self._block_cc = min(128, next_pow2(C))

    def _go(self, key, launcher: FastLauncher, grid, meta: dict, num_warps: int, args: tuple) -> None:
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bound[key] = BoundLaunch(launcher, grid, meta, num_warps)
        bound(args, _aligned(args), raw_stream(self.dev))

    def stats(self, x: Tensor, ws: Tensor | None = None) -> Tensor:
        """This rank's packed statistics ``(rows, 2C + 2)`` fp32, written at the start of ``ws`` (fp32, at
        least ``stats_numel`` elements; allocated when ``None``)."""
        W, S = self.width, self.splits
        if ws is None:
            ws = torch.empty((self.stats_numel,), device=x.device, dtype=torch.float32)
        out = ws[: self.rows * W].view(self.rows, W)
        part = out if self.rows == S else ws[_pad4(self.rows * W):][: S * W].view(S, W)
        launcher, grid, ints, meta = self._stats
        self._go(("s", x.dtype), launcher, grid, meta, TUNING["num_warps"], (x, part, part.view(torch.int64), *ints))
        if part is not out:
            self.combine_rows(part, out=out)
        return out

    def combine_rows(self, part: Tensor, *, out: Tensor | None = None, mean: Tensor | None = None,
                     invstd: Tensor | None = None, cnt: Tensor | None = None, running_mean: Tensor | None = None,
                     running_var: Tensor | None = None, momentum: float = 0.0, eps: float = 0.0) -> None:
        """Merge the packed rows ``part`` into one packed row ``out``, or (``mean`` given) into the final
        ``mean``/``invstd``/``cnt``, updating the running statistics when given."""
        R, C = part.shape[0], self.C
        final, update = mean is not None, running_mean is not None
        block_r = max(1, min(32, next_pow2(R)))
        key = ("c", R, final, update, _dt(running_mean), _dt(running_var))
        args = (part, part.view(torch.int64), R, C, part.stride(0), part.stride(0) // 2, out,
                None if out is None else out.view(torch.int64), mean, invstd, cnt, running_mean, running_var,
                float(momentum), float(eps))
        self._go(key, _combine, (cdiv(C, self._block_cc),), dict(FINAL=final, UPDATE_RUNNING=update,
                                                                 BLOCK_R=block_r, BLOCK_C=self._block_cc), 4, args)

    def fwd(self, x: Tensor, z: Tensor | None, mean: Tensor, invstd: Tensor, weight: Tensor | None,
            bias: Tensor | None, fuse_relu: bool) -> Tensor:
        """``y = relu?((x - mean) * invstd * weight + bias + z)``, allocated like ``x`` (same memory order)."""
        y = torch.empty_like(x)
        grid, ints, blocks = self._elem
        launcher = _fwd_nhwc if self.cl else _fwd_nchw
        key = ("f", x.dtype, _dt(z), _dt(weight), _dt(bias), fuse_relu)
        meta = dict(HAS_W=weight is not None, HAS_B=bias is not None, HAS_Z=z is not None, RELU=fuse_relu, **blocks)
        self._go(key, launcher, grid, meta, TUNING["num_warps"], (x, z, y, mean, invstd, weight, bias, *ints))
        return y

    def bwd_reduce(self, dy: Tensor, x: Tensor, y: Tensor | None, mean: Tensor, invstd: Tensor,
                   weight: Tensor | None, bias: Tensor | None, fuse_relu: bool, store_dz: bool,
                   ws: Tensor | None = None):
        """``(sums, dweight, dbias, dz)``: this rank's ``sums = [sum dy | sum dy (x - mean)]`` ``(2C,)`` fp32 (a
        view of ``ws``, fp32 of at least ``reduce_numel`` elements), the parameter gradients in the
        parameters' dtypes (``None`` when absent) and, with ``store_dz``, ``dz`` = the ReLU-masked ``dy``."""
        C, Sb = self.C, self.reduce_splits
        if ws is None:
            ws = torch.empty((self.reduce_numel,), device=x.device, dtype=torch.float32)
        part = ws[: Sb * 2 * C]
        sums = ws[_pad4(Sb * 2 * C):][: 2 * C]
        dz = torch.empty_like(dy) if store_dz else None
        launcher, grid, ints, blocks = self._reduce
        key = ("r", dy.dtype, x.dtype, y is None, fuse_relu, store_dz)
        self._go(key, launcher, grid, dict(RELU=fuse_relu, STORE_DZ=store_dz, **blocks), TUNING["num_warps"],
                 (dy, x, y, dz, mean, part, *ints))
        dw = db = None
        if weight is not None and bias is not None and weight.dtype == bias.dtype:
            wb = torch.empty((2 * C,), device=x.device, dtype=weight.dtype)  # one allocation for both
            dw, db = wb[:C], wb[C:]
        else:
            dw = torch.empty_like(weight) if weight is not None else None
            db = torch.empty_like(bias) if bias is not None else None
        meta = dict(HAS_DW=dw is not None, HAS_DB=db is not None, BLOCK_S=max(1, min(32, next_pow2(Sb))),
                    BLOCK_C=self._block_cc)
        self._go(("z", _dt(dw), _dt(db)), _bwd_finalize, (cdiv(C, self._block_cc),), meta, 4,
                 (part, Sb, C, invstd, sums, dw, db))
        return sums, dw, db, dz

    def bwd(self, dy: Tensor, x: Tensor, y: Tensor | None, mean: Tensor, invstd: Tensor, weight: Tensor | None,
            sums: Tensor, count: Tensor, fuse_relu: bool, training: bool) -> Tensor:
        """``dx`` (allocated like ``x``) from the group-wide ``sums`` and element ``count`` (int64 ``(1,)``)."""
        dx = torch.empty_like(x)
        grid, ints, blocks = self._elem
        launcher = _bwd_nhwc if self.cl else _bwd_nchw
        key = ("b", dy.dtype, x.dtype, y is None, _dt(weight), fuse_relu, training)
        meta = dict(HAS_W=weight is not None, RELU=fuse_relu, TRAINING=training, **blocks)
        self._go(key, launcher, grid, meta, TUNING["num_warps"],
                 (dy, x, y, dx, mean, invstd, weight, sums, count, *ints))
        return dx


_PLANS: dict = {}


def plan_for(N: int, C: int, L: int, channel_last: bool, dev: torch.device) -> BNPlan:
    """The cached ``BNPlan`` of a shape (``(N, C, L)`` NCHW, or ``(M, C, 1)`` channel-last) on ``dev``."""
    key = (N, C, L, channel_last, dev, *TUNING.values())
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) > 512:  # shapes seen by a long-running process: keep the cache bounded
            _PLANS.clear()
        plan = _PLANS[key] = BNPlan(N, C, L, channel_last, dev)
    return plan


def _canonical_plan(x: Tensor, channel_last: bool) -> BNPlan:
    """The plan of a canonical-shaped ``x``: ``(N, C, L)`` NCHW or ``(M, C)`` channel-last."""
    if channel_last:
        return plan_for(x.shape[0], x.shape[1], 1, True, x.device)
    return plan_for(x.shape[0], x.shape[1], x.shape[2], False, x.device)


def stats_rows(C: int, L: int, channel_last: bool, dev: torch.device) -> int:
    """Rows of packed statistics ``bn_stats`` returns for ``C`` channels (``L`` elements per sample, NCHW);
    the same for every batch size (see ``BNPlan.rows``)."""
    return plan_for(1, C, L, channel_last, dev).rows


def bn_stats(x: Tensor, channel_last: bool) -> Tensor:
    """Per-channel ``(mean, M2, count)`` of this process's ``x``: ``(stats_rows(...), 2C + 2)`` fp32 packed rows
    (partials of disjoint parts of the batch, merged by ``bn_combine``).

    ``x``: ``(N, C, L)`` (NCHW) or ``(M, C)`` (channel-last), contiguous, fp16/bf16/fp32, non-empty.
    """
    with device_guard(x.device):
        return _canonical_plan(x, channel_last).stats(x)


def bn_combine_into(plan: BNPlan, stats: Tensor, out: Tensor, running_mean: Tensor | None,
                    running_var: Tensor | None, momentum: float, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``bn_combine`` writing ``[mean (C) | invstd (C) | count (int64)]`` into ``out`` (fp32, ``2C + 2``)."""
    C = plan.C
    mean, invstd, cnt = out[:C], out[C:2 * C], out[2 * C:2 * C + 2].view(torch.int64)
    plan.combine_rows(stats, mean=mean, invstd=invstd, cnt=cnt, running_mean=running_mean,
                      running_var=running_var, momentum=momentum, eps=eps)
    return mean, invstd, cnt


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
    with device_guard(dev):
        # The combine's blocks depend on C only: any plan of C channels on this device serves.
        return bn_combine_into(plan_for(1, C, 1, True, dev), stats, out, running_mean, running_var, momentum, eps)


def bn_fwd(x: Tensor, z: Tensor | None, mean: Tensor, invstd: Tensor, weight: Tensor | None, bias: Tensor | None,
           fuse_relu: bool, channel_last: bool) -> Tensor:
    """``y = relu?((x - mean) * invstd * weight + bias + z)``, in ``x``'s dtype and layout."""
    with device_guard(x.device):
        return _canonical_plan(x, channel_last).fwd(x, z, mean, invstd, weight, bias, fuse_relu)


def bn_bwd_reduce(dy: Tensor, x: Tensor, y: Tensor | None, mean: Tensor, invstd: Tensor, weight: Tensor | None,
                  bias: Tensor | None, fuse_relu: bool, channel_last: bool, store_dz: bool):
    """This process's ``sums = [sum dy | sum dy*(x-mean)]`` ``(2C,)`` fp32, ``dweight``, ``dbias`` (in the
    parameters' dtypes, ``None`` when absent) and, with ``store_dz``, ``dz`` = the ReLU-masked ``dy``.
    ``y`` is the forward's output, needed with ``fuse_relu``."""
    with device_guard(x.device):
        return _canonical_plan(x, channel_last).bwd_reduce(dy, x, y, mean, invstd, weight, bias, fuse_relu, store_dz)


def bn_bwd(dy: Tensor, x: Tensor, y: Tensor | None, mean: Tensor, invstd: Tensor, weight: Tensor | None,
           sums: Tensor, count: Tensor, fuse_relu: bool, training: bool, channel_last: bool) -> Tensor:
    """``dx`` from the group-wide ``sums`` (see ``bn_bwd_reduce``) and element ``count`` (int64 ``(1,)``)."""
    with device_guard(x.device):
        return _canonical_plan(x, channel_last).bwd(dy, x, y, mean, invstd, weight, sums, count, fuse_relu, training)
