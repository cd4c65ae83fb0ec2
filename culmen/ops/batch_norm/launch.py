"""Call plans of (synchronized) batch norm: validate once, then allocate and launch.

A ``BNPlan`` holds everything ``sync_batch_norm`` derives from one call signature (shapes, strides, dtypes
and devices of the tensors, flags, eps, process group): the checks passed, the canonical memory order the
kernels read (see ``kernels.py``: ``(N, C, L)`` NCHW or ``(M, C)`` channel-last; a tensor whose memory is
already in that order, a 4-D ``channels_last`` one say, is passed as it is), the blocks, splits and grids,
the layout of the one workspace a call allocates, and the bound ``Launch`` of every kernel. A cached
training forward then costs two allocations (workspace, output) and three launches; its backward three
allocations (dx, dweight, dbias: the workspace of the forward has room for the backward's sums) and three
launches. Batch norm runs once per layer and step, and at ResNet's late stages the kernels take less time
than the host spends on a call.

Across ranks: the forward all-gathers this rank's packed statistics rows (a region of the workspace) and
the backward all-reduces the ``(2C,)`` sums; the number of rows depends on C, L and the device type only,
never on the batch, so every rank sends the same amount.

Under ``torch.compile`` (one process) a plan is built from fake tensors whose batch size may be symbolic:
blocks follow the size hint, splits that depend on the batch use the fixed rule (splits past the batch
are empty), so any batch size runs correctly; the channel count and the spatial size are specialized.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from culmen.ops.backend import choose_backend
from culmen.ops.batch_norm.kernels import (
    _bn_bwd_finalize_kernel,
    _bn_bwd_nchw_kernel,
    _bn_bwd_nhwc_kernel,
    _bn_bwd_reduce_nchw_kernel,
    _bn_bwd_reduce_nhwc_kernel,
    _bn_combine_kernel,
    _bn_fwd_nchw_kernel,
    _bn_fwd_nhwc_kernel,
    _bn_running_stats_kernel,
    _bn_stats_nchw_kernel,
    _bn_stats_nhwc_kernel,
)
from culmen.ops.batch_norm.reference import stat_dtype
from culmen.ops.common.collectives import all_gather_single
from culmen.ops.common.launch import Launch, PlanTuning, cdiv, next_pow2, stream_getter
from culmen.ops.common.launch import aligned_16 as _aligned
from culmen.ops.common.launch import size_hint as _hint
from culmen.ops.common.plans import PlanCache, clear_plans

TUNING = PlanTuning({
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
}, clear_plans)

PLANS = PlanCache("batch_norm")
_F32 = torch.float32
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}


def _at_least_1(n):
    """``max(1, n)`` for a count that may be symbolic (symbolic batch sizes are at least 2: no guard needed)."""
    return max(1, n) if isinstance(n, int) else n


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
    every rank of a process group splits its statistics the same way (see ``BNPlan.rows``)."""
    return TUNING["reduce_programs_cuda"] if dev.type == "cuda" else TUNING["reduce_programs_cpu"]


def _nchw_reduce_plan(N, C: int, L: int, dev: torch.device, fixed: bool = False):
    """Blocks and splits of the NCHW reductions: grid ``(C, S_r * S_l)``. With ``fixed`` the number of
    splits does not depend on ``N`` (splits past the batch are empty; ``N`` may then be symbolic)."""
    block_l = min(_block_l(L), TUNING["reduce_tile"])
    block_r = max(1, min(TUNING["reduce_tile"] // block_l, next_pow2(_hint(N))))
    want = max(1, min(TUNING["max_splits"], cdiv(_target_programs(dev), C)))
    col_blocks = cdiv(L, block_l)
    if fixed:
        s_l = max(1, min(want, col_blocks))
        cols_per = cdiv(col_blocks, s_l) * block_l
        s_l = cdiv(L, cols_per) if L else 1
        s_r = cdiv(want, s_l)
        rows_per = _at_least_1(cdiv(N, s_r))
        return block_r, block_l, rows_per, s_r, cols_per, s_l
    row_blocks = cdiv(N, block_r)
    s_r = min(want, row_blocks)
    rows_per = cdiv(row_blocks, s_r) * block_r
    s_r = cdiv(N, rows_per)
    s_l = max(1, min(cdiv(want, s_r), col_blocks))
    cols_per = cdiv(col_blocks, s_l) * block_l
    s_l = cdiv(L, cols_per)
    return block_r, block_l, rows_per, s_r, cols_per, s_l


def _nhwc_reduce_plan(M, C: int, dev: torch.device, fixed: bool = False):
    """Blocks and splits of the channel-last reductions: grid ``(C / BLOCK_C, S)``. With ``fixed`` the
    number of splits does not depend on ``M`` (which may then be symbolic)."""
    block_c = _block_c(C)
    block_m = max(1, min(TUNING["reduce_tile"] // block_c, next_pow2(_hint(M))))
    col_programs = cdiv(C, block_c)
    want = max(1, min(TUNING["max_splits"], cdiv(_target_programs(dev), col_programs)))
    if fixed:
        return block_m, block_c, _at_least_1(cdiv(M, want)), want
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


def _pad4(n):
    """``n`` fp32 elements rounded up to 16 bytes, so the next region of a workspace stays aligned."""
    return (n + 3) // 4 * 4


def group_size(process_group) -> int:
    """Ranks of ``process_group`` (``None``: the default group), 1 without ``torch.distributed``."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)


def _check_tensor(name: str, t, dev: torch.device) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.device != dev:
        raise ValueError(f"{name} is on {t.device} but the input is on {dev}")


class BNPlan:
    """Everything ``sync_batch_norm`` derives from one call signature. Holds no tensors (but the process
    group). Built from example arguments (real tensors in eager mode, fake ones under ``torch.compile``);
    valid for every call with the same signature; ``momentum`` is a per-call argument.

    ``world``: the process group's size (``None``: asked from ``torch.distributed``); only training
    (``use_batch_stats``) communicates.
    """

    def __init__(self, x, z, weight, bias, running_mean, running_var, use_batch_stats, eps, process_group,
                 channel_last, fuse_relu, world: int | None = None) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2 or x.dim() > 5:
            raise ValueError(f"expected a 2D-5D input, got {x.dim()}D input of shape {tuple(x.shape)}")
        dev = x.device
        _check_tensor("input", x, dev)
        cl_shape = bool(channel_last) or x.dim() == 2
        C = int(x.shape[-1] if cl_shape else x.shape[1])
        params = (("weight", weight), ("bias", bias), ("running_mean", running_mean), ("running_var", running_var))
        for name, t in params:
            if t is not None:
                _check_tensor(name, t, dev)
                if t.numel() != C:
                    raise ValueError(f"{name} has {t.numel()} elements, the input has {C} channels")
        if (running_mean is None) != (running_var is None):
            raise ValueError("running_mean and running_var must be given together")
        if not use_batch_stats and running_mean is None:
            raise ValueError("use_batch_stats=False needs running_mean and running_var")
        if z is not None:
            _check_tensor("z", z, dev)
            if z.shape != x.shape or z.dtype != x.dtype:
                raise ValueError(f"z must have the input's shape {tuple(x.shape)} and dtype {x.dtype}, got "
                                 f"{tuple(z.shape)} {z.dtype}")
        if float(eps) < 0.0:
            raise ValueError(f"eps must be non-negative, got {eps}")
        self.training = bool(use_batch_stats)
        self.world = (group_size(process_group) if world is None else world) if self.training else 1
        self.group = process_group
        # Memory order the kernels read: channel-last (Apex's flag, a 2-D input, or an NCHW-shaped input
        # stored channels_last) or NCHW. Inputs in another order are copied into it per call.
        self.perm = None
        if cl_shape:
            self.cl, self.fmt = True, torch.contiguous_format
        else:
            fmt = _FORMATS.get(x.dim())
            if fmt is not None and not x.is_contiguous() and x.is_contiguous(memory_format=fmt):
                self.cl, self.fmt = True, fmt
                self.perm = (0, *range(2, x.dim()), 1)
            else:
                self.cl, self.fmt = False, torch.contiguous_format
        self.copy_x = not x.is_contiguous(memory_format=self.fmt)
        self.copy_z = z is not None and not z.is_contiguous(memory_format=self.fmt)
        self.fix_w = weight is not None and not (weight.dim() == 1 and weight.is_contiguous())
        self.fix_b = bias is not None and not (bias.dim() == 1 and bias.is_contiguous())
        self.shape = x.shape
        self.C = C
        self.numel = x.numel()
        if self.cl:
            self.N, self.L = (self.numel // C if C else 0), 1
        else:
            self.N = x.shape[0]
            self.L = int(math.prod(x.shape[2:]))
        count = self.N * self.L
        if self.training and self.world == 1 and count <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {tuple(x.shape)}")
        # Strides of every output like the input (y, dx, dz), in the kernels' memory order.
        self.y_stride = torch.empty_like(x, device="meta", memory_format=self.fmt).stride() if self.copy_x \
            else x.stride()
        self.dtype = x.dtype
        self.stat_dtype = stat_dtype(x)
        self.device = dev
        self.eps = float(eps)
        self.relu = bool(fuse_relu)
        self.has_z, self.has_w, self.has_b = z is not None, weight is not None, bias is not None
        self.update = self.training and running_mean is not None
        self.use_kernel = x.dtype != torch.float64 and choose_backend(dev) == "triton"
        if self.use_kernel and running_mean is not None and not (running_mean.is_contiguous()
                                                                 and running_var.is_contiguous()):
            raise ValueError("running_mean and running_var must be contiguous (the kernels update them in place)")
        self.stream = stream_getter(dev)
        self._bwd: dict = {}
        if self.use_kernel:
            self._plan_kernels()

    # ------------------------------------------------------------------------------------ layout
    def canonical(self, t: Tensor) -> Tensor:
        """``t`` (shaped like the input) in the kernels' memory order: itself, or a copy."""
        return t.contiguous(memory_format=self.fmt)

    def to_rows(self, t: Tensor) -> Tensor:
        """``t`` shaped like the input as the reference's canonical ``(N, C, L)`` or ``(M, C)`` tensor."""
        if self.cl:
            if self.perm is not None:
                t = t.permute(self.perm)
            return t.reshape(-1, self.C)
        return t.reshape(self.shape[0], self.C, self.L)

    def from_rows(self, t: Tensor) -> Tensor:
        """Inverse of ``to_rows`` (a view)."""
        if self.perm is not None:
            shape = self.shape
            nhwc = (shape[0], *shape[2:], self.C)
            inv = (0, len(shape) - 1, *range(1, len(shape) - 1))
            return t.view(nhwc).permute(inv)
        return t.view(self.shape)

    # ------------------------------------------------------------------------------------- plans
    def _plan_kernels(self) -> None:
        N, C, L, dev = self.N, self.C, self.L, self.device
        W = self.W = 2 * C + 2  # one packed statistics row
        nw = TUNING["num_warps"]
        if self.cl:
            bm, bc, rows_per, S = _nhwc_reduce_plan(N, C, dev, fixed=True)
            stats = Launch(_bn_stats_nhwc_kernel, (cdiv(C, bc), S), dict(BLOCK_M=bm, BLOCK_C=bc), nw, device=dev)
            self.stats_ints = (N, C, W, rows_per)
            bm, bc = _elem_plan_nhwc(_hint(N), C)
            self.elem_grid = (cdiv(N, bm), cdiv(C, bc))
            self.elem_ints = (N, C)
            self.elem_blocks = dict(BLOCK_M=bm, BLOCK_C=bc)
        else:
            br, bl, rows_per, s_r, cols_per, s_l = _nchw_reduce_plan(N, C, L, dev, fixed=True)
            S = s_r * s_l
            stats = Launch(_bn_stats_nchw_kernel, (C, S), dict(BLOCK_R=br, BLOCK_L=bl), nw, device=dev)
            self.stats_ints = (N, C, L, W, rows_per, cols_per, s_l)
            br, bl = _elem_plan_nchw(_hint(N) * C, L)
            self.elem_grid = (cdiv(N * C, br), cdiv(L, bl))
            self.elem_ints = (N * C, C, L)
            self.elem_blocks = dict(BLOCK_R=br, BLOCK_L=bl)
        self.splits = S
        # Rows of statistics this rank sends: its splits themselves when they are few (the combine then
        # merges every rank's splits at once, one launch less), else one row merged locally. It depends on
        # C, L and the device type only, never on the batch, so every rank sends the same number.
        self.rows = S if S * W * 4 <= TUNING["max_gather_bytes"] else 1
        self.block_cc = bcc = min(128, next_pow2(C))
        cgrid = (cdiv(C, bcc),)
        # The workspace: [partial rows | (local row) | (every rank's rows) | final stats] (training) or
        # [final stats] (eval), then, when autograd records, the backward's [partial sums | sums].
        off = 0
        # Only the launches of this plan's mode exist (the others stay None).
        self.stats = stats if self.training else None
        self.merge = self.final = self.running = None
        if self.training:
            self.o_part = 0
            off = _pad4(S * W)
            src, R = 0, S
            if self.world > 1:
                self.o_local = 0
                if self.rows != S:
                    self.o_local = off
                    off += _pad4(W)
                    self.merge = Launch(_bn_combine_kernel, cgrid, dict(FINAL=False, UPDATE_RUNNING=False,
                                                                         BLOCK_R=min(32, next_pow2(S)),
                                                                         BLOCK_C=bcc), 4, device=dev)
                self.o_gather = off
                src, R = off, self.world * self.rows
                off += _pad4(R * W)
            self.final_src, self.final_rows = src, R
            self.final = Launch(_bn_combine_kernel, cgrid, dict(FINAL=True, UPDATE_RUNNING=self.update,
                                                                 BLOCK_R=min(32, next_pow2(R)), BLOCK_C=bcc), 4,
                                device=dev)
        else:
            self.running = Launch(_bn_running_stats_kernel, cgrid, dict(BLOCK_C=bcc), 4, device=dev)
        self.o_stats = off
        self.ws_fwd = off + _pad4(W)
        fwd_kernel = _bn_fwd_nhwc_kernel if self.cl else _bn_fwd_nchw_kernel
        self.fwd = Launch(fwd_kernel, self.elem_grid, dict(HAS_W=self.has_w, HAS_B=self.has_b, HAS_Z=self.has_z,
                                                            RELU=self.relu, **self.elem_blocks), nw, device=dev)
        # Backward reductions: splits follow the batch when it is known (fixed otherwise, or when empty).
        adaptive = isinstance(N, int) and N * L > 0
        if self.cl:
            bm, bc, rows_per, Sb = _nhwc_reduce_plan(N, C, dev, fixed=not adaptive)
            self.reduce_grid, self.reduce_ints = (cdiv(C, bc), Sb), (N, C, rows_per)
            self.reduce_blocks = dict(BLOCK_M=bm, BLOCK_C=bc)
        else:
            br, bl, rows_per, s_r, cols_per, s_l = _nchw_reduce_plan(N, C, L, dev, fixed=not adaptive)
            Sb = s_r * s_l
            self.reduce_grid, self.reduce_ints = (C, Sb), (N, C, L, rows_per, cols_per, s_l)
            self.reduce_blocks = dict(BLOCK_R=br, BLOCK_L=bl)
        self.reduce_splits = Sb
        self.o_sums_rel = _pad4(Sb * 2 * C)  # backward regions, relative to the backward's base
        self.ws_bwd = self.o_sums_rel + _pad4(2 * C)
        self.ws_grad = self.ws_fwd + self.ws_bwd
        self.finalize = Launch(_bn_bwd_finalize_kernel, cgrid, dict(HAS_DW=self.has_w, HAS_DB=self.has_b,
                                                                     BLOCK_S=max(1, min(32, next_pow2(Sb))),
                                                                     BLOCK_C=bcc), 4, device=dev)
        bwd_kernel = _bn_bwd_nhwc_kernel if self.cl else _bn_bwd_nchw_kernel
        self.bwd = Launch(bwd_kernel, self.elem_grid, dict(HAS_W=self.has_w, RELU=self.relu, TRAINING=self.training,
                                                           **self.elem_blocks), nw, device=dev)

    def _reduce(self, store_dz: bool) -> Launch:
        la = self._bwd.get(store_dz)
        if la is None:
            kernel = _bn_bwd_reduce_nhwc_kernel if self.cl else _bn_bwd_reduce_nchw_kernel
            la = self._bwd[store_dz] = Launch(kernel, self.reduce_grid, dict(RELU=self.relu, STORE_DZ=store_dz,
                                                                              **self.reduce_blocks),
                                              TUNING["num_warps"], device=self.device)
        return la

    # ----------------------------------------------------------------------------------- launches
    def forward(self, x, z, weight, bias, running_mean, running_var, momentum: float, grad: bool,
                traced: bool = False):
        """``(y, ws, x)``: the output (the input's shape, dtype and kernels' memory order), the workspace
        (``[mean | invstd | count]`` at ``o_stats``, room for the backward with ``grad``) and the input as the
        kernels read it (for the backward). Training statistics cover the whole process group; the running
        statistics, when given, are updated in place."""
        if self.copy_x:
            x = self.canonical(x)
        if self.copy_z:
            z = self.canonical(z)
        if self.fix_w:
            weight = weight.reshape(self.C).contiguous()
        if self.fix_b:
            bias = bias.reshape(self.C).contiguous()
        ws = torch.empty((self.ws_grad if grad else self.ws_fwd,), device=self.device, dtype=_F32)
        stream = None if traced else self.stream()
        aligned = traced or _aligned(x, z, weight, bias, running_mean, running_var)
        C, W = self.C, self.W
        if self.training:
            args = (x, ws, self.o_part, *self.stats_ints)
            self.stats.traced(*args) if traced else self.stats(stream, aligned, *args)
            if self.world > 1:
                if self.merge is not None:
                    args = (ws, self.o_part, self.splits, C, W, self.o_local, None, None, 0.0, 0.0)
                    self.merge.traced(*args) if traced else self.merge(stream, aligned, *args)
                n = self.rows * W
                all_gather_single(ws[self.o_gather:self.o_gather + self.world * n], ws[self.o_local:self.o_local + n],
                                  group=self.group)
            args = (ws, self.final_src, self.final_rows, C, W, self.o_stats, running_mean, running_var,
                    float(momentum), self.eps)
            self.final.traced(*args) if traced else self.final(stream, aligned, *args)
        else:
            args = (running_mean, running_var, ws, self.o_stats, C, self.eps)
            self.running.traced(*args) if traced else self.running(stream, aligned, *args)
        y = torch.empty_like(x)
        if self.numel:
            args = (x, z, y, ws, self.o_stats, weight, bias, *self.elem_ints)
            self.fwd.traced(*args) if traced else self.fwd(stream, aligned, *args)
        return y, ws, x

    def backward(self, dy, stats, ws, base, x, y, weight, bias, need_dx: bool, store_dz: bool,
                 traced: bool = False):
        """``(dx, dz, dweight, dbias)``: ``dx`` (``None`` without ``need_dx``) and ``dz`` (the ReLU-masked ``dy``,
        with ``store_dz``) shaped like the input, the parameter gradients (this rank's share) in the
        parameters' dtypes, ``None`` without the parameter. ``stats``: the forward's workspace; the backward's
        regions start at ``base`` in ``ws``: the forward's workspace at ``ws_fwd`` when it was made with
        ``grad``, else a fresh one of ``ws_bwd`` elements at 0. ``x`` / ``y``: the forward's returned input
        and output (``y`` only with ``fuse_relu``)."""
        if traced or dy.stride() != self.y_stride:
            dy = self.canonical(dy)
        w = weight.reshape(self.C).contiguous() if self.fix_w else weight
        b = bias.reshape(self.C).contiguous() if self.fix_b else bias
        stream = None if traced else self.stream()
        aligned = traced or _aligned(dy, x, w, b)
        C = self.C
        o_part, o_sums = base, base + self.o_sums_rel
        dz = torch.empty_like(dy) if store_dz else None
        reduce = self._reduce(store_dz)
        args = (dy, x, y, dz, stats, self.o_stats, ws, o_part, *self.reduce_ints)
        reduce.traced(*args) if traced else reduce(stream, aligned, *args)
        dw = torch.empty_like(w) if w is not None else None
        db = torch.empty_like(b) if b is not None else None
        args = (ws, o_part, self.reduce_splits, C, stats, self.o_stats, o_sums, dw, db)
        self.finalize.traced(*args) if traced else self.finalize(stream, aligned, *args)
        dx = None
        if need_dx:
            if self.training and self.world > 1:
                dist.all_reduce(ws[o_sums:o_sums + 2 * C], group=self.group)
            dx = torch.empty_like(x)
            if self.numel:
                args = (dy, x, y, dx, stats, self.o_stats, ws, o_sums, w, *self.elem_ints)
                self.bwd.traced(*args) if traced else self.bwd(stream, aligned, *args)
        if self.fix_w:
            dw = dw.view(weight.shape)
        if self.fix_b:
            db = db.view(bias.shape)
        return dx, dz, dw, db


# ------------------------------------------------------------------------------ building blocks


def stats_kernel_rows(x: Tensor, channel_last: bool) -> Tensor:
    """The packed statistics rows ``(rows, 2C + 2)`` the kernels send to the peers for ``x`` (``(N, C, L)`` or
    ``(M, C)`` channel-last), as a multi-rank plan computes them (no collective). For tests and diagnostics."""
    plan = BNPlan(x, None, None, None, None, None, True, 0.0, None, channel_last, False, world=2)
    x = plan.canonical(x)
    ws = torch.empty((plan.ws_fwd,), device=x.device, dtype=_F32)
    stream = plan.stream()
    plan.stats(stream, _aligned(x), x, ws, plan.o_part, *plan.stats_ints)
    W = plan.W
    if plan.merge is not None:
        plan.merge(stream, True, ws, plan.o_part, plan.splits, plan.C, W, plan.o_local, None, None, 0.0, 0.0)
    return ws[plan.o_local:plan.o_local + plan.rows * W].view(plan.rows, W)


def combine_kernel_rows(rows: Tensor, running_mean: Tensor | None, running_var: Tensor | None, momentum: float,
                        eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """The combine kernel on any packed rows ``(R, 2C + 2)`` fp32: ``(mean (C), invstd (C), count (1,) int64)``,
    the running statistics updated in place when given. For tests and diagnostics."""
    R, W = rows.shape
    C = (W - 2) // 2
    dev = rows.device
    o_out = _pad4(R * W)
    ws = torch.empty((o_out + W,), device=dev, dtype=_F32)
    ws[:R * W].copy_(rows.reshape(-1))
    bcc = min(128, next_pow2(C))
    la = Launch(_bn_combine_kernel, (cdiv(C, bcc),), dict(FINAL=True, UPDATE_RUNNING=running_mean is not None,
                                                           BLOCK_R=min(32, next_pow2(R)), BLOCK_C=bcc), 4, device=dev)
    la(stream_getter(dev)(), _aligned(running_mean, running_var), ws, 0, R, C, W, o_out, running_mean, running_var,
       float(momentum), float(eps))
    out = ws[o_out:]
    return out[:C], out[C:2 * C], out[2 * C:].view(torch.int64)
