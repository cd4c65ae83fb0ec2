"""Custom ops of (synchronized) batch norm, their dispatch, and the differentiable ``sync_batch_norm``.

The five ``culmen::batch_norm_*`` custom ops (with fake impls, for ``torch.compile`` and
``torch.library.opcheck``) are the kernels' boundary: statistics of the local batch, the parallel
combine of per-rank statistics (unequal counts) with the running-stats update, the normalize
(+ residual ``z`` + ReLU) forward, the backward reductions and the elementwise backward.
``sync_batch_norm`` composes them with the two collectives of a process group (an all-gather of the
packed statistics in forward, an all-reduce of ``[sum dy | sum dy (x - mean)]`` in backward); its
eager autograd goes through ``SyncBatchNormFunction``, which calls the implementations directly.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from culmen.ops.backend import choose_backend, device_guard, register_op
from culmen.ops.batch_norm.reference import (
    bn_bwd_reduce_ref,
    bn_bwd_ref,
    bn_combine_ref,
    bn_fwd_ref,
    bn_stats_ref,
    stat_dtype,
)
from culmen.ops.common.outputs import nothing

register_op("batch_norm_stats", "normalization", "per-channel (mean, M2, count) of a batch, NCHW or channel-last")
register_op("batch_norm_combine", "normalization", "parallel Welford combine of per-rank stats + running stats")
register_op("batch_norm_fwd", "normalization", "batch-norm normalize (+ residual z + ReLU)")
register_op("batch_norm_bwd_reduce", "normalization", "batch-norm backward reductions: sum dy, sum dy*(x-mean)")
register_op("batch_norm_bwd", "normalization", "batch-norm elementwise backward (dx)")


def _triton_backend(t: Tensor) -> bool:
    """Does ``t`` belong to the Triton kernels? (fp64 always takes the reference.)"""
    return t.dtype != torch.float64 and choose_backend(t.device) == "triton"


def _triton(t: Tensor) -> bool:
    """Run the Triton kernels on ``t``? (Empty inputs take the reference: nothing to launch.)"""
    return t.numel() > 0 and _triton_backend(t)


def _stats_rows(x: Tensor, channel_last: bool) -> int:
    if not _triton_backend(x):
        return 1
    from culmen.ops.batch_norm.launch import stats_rows

    return stats_rows(x.shape[1], 1 if channel_last else x.shape[2], channel_last, x.device)


def _stats_impl(x, channel_last):
    if _triton(x):
        from culmen.ops.batch_norm.launch import bn_stats

        return bn_stats(x, channel_last)
    R = _stats_rows(x, channel_last)
    if R > 1:  # an empty share of the batch still sends as many (count-0) rows as its peers
        return torch.zeros((R, 2 * x.shape[1] + 2), device=x.device, dtype=stat_dtype(x))
    return bn_stats_ref(x, channel_last)


def _combine_impl(stats, running_mean, running_var, momentum, eps):
    if stats.dtype == torch.float32 and choose_backend(stats.device) == "triton":
        from culmen.ops.batch_norm.launch import bn_combine

        return bn_combine(stats, running_mean, running_var, momentum, eps)
    return bn_combine_ref(stats, running_mean, running_var, momentum, eps)


def _fwd_impl(x, z, mean, invstd, weight, bias, fuse_relu, channel_last):
    if _triton(x):
        from culmen.ops.batch_norm.launch import bn_fwd

        return bn_fwd(x, z, mean, invstd, weight, bias, fuse_relu, channel_last)
    return bn_fwd_ref(x, z, mean, invstd, weight, bias, fuse_relu, channel_last)


def _bwd_reduce_impl(dy, x, y, mean, invstd, weight, bias, fuse_relu, channel_last, store_dz):
    if _triton(x):
        from culmen.ops.batch_norm.launch import bn_bwd_reduce

        return bn_bwd_reduce(dy, x, y, mean, invstd, weight, bias, fuse_relu, channel_last, store_dz)
    return bn_bwd_reduce_ref(dy, x, y, mean, invstd, weight, bias, fuse_relu, channel_last, store_dz)


def _bwd_impl(dy, x, y, mean, invstd, weight, sums, count, fuse_relu, training, channel_last):
    if _triton(x):
        from culmen.ops.batch_norm.launch import bn_bwd

        return bn_bwd(dy, x, y, mean, invstd, weight, sums, count, fuse_relu, training, channel_last)
    return bn_bwd_ref(dy, x, y, mean, invstd, weight, sums, count, fuse_relu, training, channel_last)


def _fresh(t: Tensor) -> Tensor:
    """Custom-op outputs may not share memory: copy one that is part of a larger buffer. (Inside a
    custom op's implementation ``_base`` is not tracked, so the storage itself is compared.)"""
    if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone()
    return t


# ---------------------------------------------------------------------------------------------
# Custom ops (canonical layouts: (N, C, L) contiguous, or (M, C) contiguous with channel_last)
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("culmen::batch_norm_stats", mutates_args=())
def batch_norm_stats_op(x: Tensor, channel_last: bool) -> Tensor:
    """Packed rows ``[mean (C) | M2 (C) | int64 count]`` ``(R, 2C + 2)`` of disjoint parts of ``x`` (fp32; fp64
    for fp64 ``x``); ``R`` depends on the shape's C/L and the backend, not on the batch size."""
    return _fresh(_stats_impl(x, channel_last))


@batch_norm_stats_op.register_fake
def _(x, channel_last):
    return x.new_empty((_stats_rows(x, channel_last), 2 * x.shape[1] + 2), dtype=stat_dtype(x))


@torch.library.custom_op("culmen::batch_norm_combine", mutates_args=("running_mean", "running_var"))
def batch_norm_combine_op(stats: Tensor, running_mean: Tensor | None, running_var: Tensor | None, momentum: float,
                          eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Merge packed rows ``(R, 2C + 2)`` into ``(mean (C), invstd (C), count (1,) int64)``; updates the
    running stats in place when given."""
    mean, invstd, cnt = _combine_impl(stats, running_mean, running_var, momentum, eps)
    # The Triton path returns views of one buffer; custom-op outputs may not alias each other.
    return mean.clone(), invstd.clone(), cnt.clone()


@batch_norm_combine_op.register_fake
def _(stats, running_mean, running_var, momentum, eps):
    C = (stats.shape[-1] - 2) // 2
    return (stats.new_empty((C,)), stats.new_empty((C,)), stats.new_empty((1,), dtype=torch.int64))


@torch.library.custom_op("culmen::batch_norm_fwd", mutates_args=())
def batch_norm_fwd_op(x: Tensor, z: Tensor | None, mean: Tensor, invstd: Tensor, weight: Tensor | None,
                      bias: Tensor | None, fuse_relu: bool, channel_last: bool) -> Tensor:
    """``relu?((x - mean) * invstd * weight + bias + z)``, shaped and typed like ``x``."""
    return _fwd_impl(x, z, mean, invstd, weight, bias, fuse_relu, channel_last)


@batch_norm_fwd_op.register_fake
def _(x, z, mean, invstd, weight, bias, fuse_relu, channel_last):
    return torch.empty_like(x)


@torch.library.custom_op("culmen::batch_norm_bwd_reduce", mutates_args=())
def batch_norm_bwd_reduce_op(dy: Tensor, x: Tensor, y: Tensor | None, mean: Tensor, invstd: Tensor,
                             weight: Tensor | None, bias: Tensor | None, fuse_relu: bool, channel_last: bool,
                             store_dz: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(sums (2C,), dweight, dbias, dz)``; absent outputs are empty tensors."""
    sums, dw, db, dz = _bwd_reduce_impl(dy, x, y, mean, invstd, weight, bias, fuse_relu, channel_last, store_dz)
    return (_fresh(sums), _fresh(dw) if dw is not None else nothing(x.device, x.dtype),
            _fresh(db) if db is not None else nothing(x.device, x.dtype),
            dz if dz is not None else nothing(x.device, x.dtype))


@batch_norm_bwd_reduce_op.register_fake
def _(dy, x, y, mean, invstd, weight, bias, fuse_relu, channel_last, store_dz):
    C = x.shape[1]
    sums = x.new_empty((2 * C,), dtype=stat_dtype(x))
    dw = torch.empty_like(weight) if weight is not None else nothing(x.device, x.dtype)
    db = torch.empty_like(bias) if bias is not None else nothing(x.device, x.dtype)
    dz = torch.empty_like(dy) if store_dz else nothing(x.device, x.dtype)
    return sums, dw, db, dz


@torch.library.custom_op("culmen::batch_norm_bwd", mutates_args=())
def batch_norm_bwd_op(dy: Tensor, x: Tensor, y: Tensor | None, mean: Tensor, invstd: Tensor, weight: Tensor | None,
                      sums: Tensor, count: Tensor, fuse_relu: bool, training: bool, channel_last: bool) -> Tensor:
    """``dx`` from the group-wide ``sums`` and element ``count``."""
    return _bwd_impl(dy, x, y, mean, invstd, weight, sums, count, fuse_relu, training, channel_last)


@batch_norm_bwd_op.register_fake
def _(dy, x, y, mean, invstd, weight, sums, count, fuse_relu, training, channel_last):
    return torch.empty_like(x)


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------


_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}


class _Layout:
    """How an input maps to a canonical layout and back.

    * ``channel_last=True`` (Apex's flag, or any 2-D input): the last dim is C; ``(M, C)``.
    * a 4-D/5-D NCHW-shaped input stored channels_last(_3d): ``(M, C)`` through a permuted view, no copy.
    * otherwise NCHW: ``(N, C, L)``.
    """

    def __init__(self, x: Tensor, channel_last: bool):
        self.shape = x.shape
        self.perm: tuple[int, ...] | None = None
        if channel_last or x.dim() == 2:
            self.cl = True
            self.C = x.shape[-1]
        else:
            self.C = x.shape[1]
            fmt = _FORMATS.get(x.dim())
            if fmt is not None and not x.is_contiguous() and x.is_contiguous(memory_format=fmt):
                self.cl = True
                self.perm = (0, *range(2, x.dim()), 1)
            else:
                self.cl = False

    def to_canonical(self, t: Tensor) -> Tensor:
        if self.cl:
            if self.perm is not None:
                t = t.permute(self.perm)
            return t.reshape(-1, self.C).contiguous()
        return t.contiguous().view(self.shape[0], self.C, math.prod(self.shape[2:]))

    def from_canonical(self, t: Tensor) -> Tensor:
        if self.perm is not None:
            nhwc = (self.shape[0], *self.shape[2:], self.C)
            inv = (0, len(self.shape) - 1, *range(1, len(self.shape) - 1))
            return t.view(nhwc).permute(inv)
        return t.view(self.shape)

    def count(self, t: Tensor) -> int:
        return t.numel() // self.C if self.C else 0

    def direct(self, t: Tensor) -> bool:
        """Is ``t``'s memory already in the canonical order (the kernels then take it as it is)?"""
        if self.perm is not None:
            return t.is_contiguous(memory_format=_FORMATS[t.dim()])
        return t.is_contiguous()

    def dims(self, t: Tensor) -> tuple[int, int, int]:
        """``(N, C, L)`` of the canonical view (``(M, C, 1)`` channel-last)."""
        if self.cl:
            return self.count(t), self.C, 1
        n = self.shape[0]
        return n, self.C, t.numel() // (n * self.C)

    def same_order(self, t: Tensor) -> Tensor:
        """``t`` (shaped like the input) with its memory in the canonical order: itself, or a copy."""
        if self.direct(t):
            return t
        return t.contiguous(memory_format=_FORMATS[t.dim()]) if self.perm is not None else t.contiguous()


def _group_size(process_group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)


def _all_gather(out: Tensor, inp: Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


class SyncBatchNormFunction(torch.autograd.Function):
    """Synchronized batch norm with Apex's argument order.

    ``apply(input, z, weight, bias, running_mean, running_var, eps, use_batch_stats, momentum,
    process_group, channel_last, fuse_relu)``. With ``use_batch_stats`` the statistics of the whole
    process group's batch are used (and the running stats, when given, are updated with
    ``momentum``); otherwise ``running_mean``/``running_var`` are. ``weight``/``bias`` gradients are
    this process's share (the data-parallel all-reduce sums them), like Apex and ``torch.nn.SyncBatchNorm``.
    """

    @staticmethod
    def forward(ctx, x, z, weight, bias, running_mean, running_var, eps, use_batch_stats, momentum, process_group,
                channel_last, fuse_relu):
        lay = _Layout(x, channel_last)
        world = _group_size(process_group) if use_batch_stats else 1
        if use_batch_stats and world == 1 and lay.count(x) <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {tuple(x.shape)}")
        # The kernels read raw memory: an input already in the canonical order goes in as it is (no
        # reshapes, and the output keeps its layout); anything else through a canonical copy.
        plan = None
        if _triton(x) and lay.direct(x) and (z is None or lay.direct(z)):
            from culmen.ops.batch_norm.launch import plan_for

            plan = plan_for(*lay.dims(x), lay.cl, x.device)
            xc, zc = x, z
        else:
            xc = lay.to_canonical(x)
            zc = lay.to_canonical(z) if z is not None else None
        count = None
        if use_batch_stats:
            mean, invstd, count = (_batch_stats_planned if plan is not None else _batch_stats)(
                plan, xc, lay, world, process_group, running_mean, running_var, float(momentum), float(eps))
        else:
            mean = running_mean.to(stat_dtype(x))
            invstd = torch.rsqrt(running_var.to(stat_dtype(x)) + eps)
        if plan is not None:
            with device_guard(x.device):
                yc = plan.fwd(xc, zc, mean, invstd, weight, bias, bool(fuse_relu))
        else:
            yc = _fwd_impl(xc, zc, mean, invstd, weight, bias, bool(fuse_relu), lay.cl)
        ctx.save_for_backward(xc, weight, bias, mean, invstd, count, yc if fuse_relu else None)
        ctx.layout = lay
        ctx.plan = plan
        ctx.group = process_group
        ctx.world = world
        ctx.training = bool(use_batch_stats)
        ctx.fuse_relu = bool(fuse_relu)
        ctx.has_z = z is not None
        return yc if plan is not None else lay.from_canonical(yc)

    @staticmethod
    def backward(ctx, dy):
        xc, weight, bias, mean, invstd, count, yc = ctx.saved_tensors
        lay, plan = ctx.layout, ctx.plan
        need_dx = ctx.needs_input_grad[0]
        store_dz = ctx.has_z and ctx.needs_input_grad[1]
        reduce_all = need_dx and ctx.training and ctx.world > 1
        dx = None
        if plan is not None:
            dyc = lay.same_order(dy)
            with device_guard(dy.device):
                sums, dw, db, dz = plan.bwd_reduce(dyc, xc, yc, mean, invstd, weight, bias, ctx.fuse_relu, store_dz)
                if need_dx:
                    if reduce_all:
                        dist.all_reduce(sums, group=ctx.group)
                    dx = plan.bwd(dyc, xc, yc, mean, invstd, weight, sums, count, ctx.fuse_relu, ctx.training)
        else:
            dyc = lay.to_canonical(dy)
            sums, dw, db, dz = _bwd_reduce_impl(dyc, xc, yc, mean, invstd, weight, bias, ctx.fuse_relu, lay.cl,
                                                store_dz)
            if need_dx:
                if reduce_all:
                    dist.all_reduce(sums, group=ctx.group)
                dx = lay.from_canonical(_bwd_impl(dyc, xc, yc, mean, invstd, weight, sums, count, ctx.fuse_relu,
                                                  ctx.training, lay.cl))
            dz = lay.from_canonical(dz) if store_dz else None
        dw = dw if (weight is not None and ctx.needs_input_grad[2]) else None
        db = db if (bias is not None and ctx.needs_input_grad[3]) else None
        return dx, dz if store_dz else None, dw, db, None, None, None, None, None, None, None, None


def _batch_stats(plan, xc, lay, world, group, running_mean, running_var, momentum, eps):
    """``(mean, invstd, count)`` of the whole group's batch, through the ops' implementations."""
    local = _stats_impl(xc, lay.cl)  # (R, 2C + 2), R the same on every rank
    if world > 1:
        gathered = local.new_empty((world * local.numel(),))
        _all_gather(gathered, local.view(-1), group)
        local = gathered.view(world * local.shape[0], -1)
    return _combine_impl(local, running_mean, running_var, momentum, eps)


def _batch_stats_planned(plan, xc, lay, world, group, running_mean, running_var, momentum, eps):
    """``_batch_stats`` on a ``BNPlan``: one workspace holds this rank's rows, every rank's rows and the
    result ``[mean | invstd | count]``, so a call allocates once."""
    from culmen.ops.batch_norm.launch import bn_combine_into

    rows, W = plan.rows, plan.width
    own = plan.stats_numel
    gathered_numel = (world * rows * W + 3) & ~3 if world > 1 else 0
    ws = torch.empty((own + gathered_numel + W,), device=xc.device, dtype=torch.float32)
    with device_guard(xc.device):
        local = plan.stats(xc, ws)
        if world > 1:
            flat = ws[own:own + world * rows * W]
            _all_gather(flat, local.view(-1), group)
            local = flat.view(world * rows, W)
        return bn_combine_into(plan, local, ws[own + gathered_numel:], running_mean, running_var, momentum, eps)


def sync_batch_norm(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    use_batch_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
    process_group=None,
    channel_last: bool = False,
    fuse_relu: bool = False,
    z: Tensor | None = None,
) -> Tensor:
    """Batch norm over the batch of every rank of ``process_group``, differentiable.

    Args:
        input: ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)`` or ``(N, C, D, H, W)`` fp16/bf16/fp32/fp64, NCHW
            or stored channels_last; with ``channel_last=True``, ``(N, ..., C)`` (channels last in the shape).
            Per-rank ``N`` may differ (even be 0).
        weight, bias: ``(C,)`` or ``None``. running_mean, running_var: ``(C,)`` or ``None``, updated in
            place in training (variance unbiased over the whole group's batch).
        use_batch_stats: normalize with the group's batch statistics (training, or no running stats);
            otherwise with the running stats.
        momentum: running-stats blend factor. eps: added to the variance.
        process_group: the ranks whose batches are normalized together (default: the world when
            ``torch.distributed`` is initialized, else this process alone).
        fuse_relu: ``relu(bn(x) + z)``. z: an optional residual added before the ReLU, like ``input``.

    Statistics are fp32 (fp64 for fp64 input); the output has ``input``'s dtype, shape and layout.
    """
    if input.dim() < 2 or input.dim() > 5:
        raise ValueError(f"expected a 2D-5D input, got {input.dim()}D input of shape {tuple(input.shape)}")
    C = input.shape[-1] if (channel_last or input.dim() == 2) else input.shape[1]
    for name, t in (("weight", weight), ("bias", bias), ("running_mean", running_mean), ("running_var", running_var)):
        if t is not None and t.numel() != C:
            raise ValueError(f"{name} has {t.numel()} elements, the input has {C} channels")
    if not use_batch_stats and (running_mean is None or running_var is None):
        raise ValueError("use_batch_stats=False needs running_mean and running_var")
    if z is not None and z.shape != input.shape:
        raise ValueError(f"z must have the input's shape {tuple(input.shape)}, got {tuple(z.shape)}")
    args = (input, z, weight, bias, running_mean, running_var, float(eps), bool(use_batch_stats), float(momentum),
            process_group, bool(channel_last), bool(fuse_relu))
    if torch.is_autocast_enabled(input.device.type):
        with torch.autocast(input.device.type, enabled=False):
            return SyncBatchNormFunction.apply(*args)
    return SyncBatchNormFunction.apply(*args)
