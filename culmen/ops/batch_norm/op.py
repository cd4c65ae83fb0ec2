"""``sync_batch_norm``, the op-level entry point of ``culmen.parallel.SyncBatchNorm``: batch norm over the batch
of every rank of a process group (an all-gather of packed statistics in forward, an all-reduce of
``[sum dy | sum dy (x - mean)]`` in backward), with a residual ``z`` and a fused ReLU; its eager autograd; and
the ``torch.library`` op ``culmen::batch_norm_fwd`` that ``torch.compile`` traces (one process).

The call path (DESIGN.md): an eager call builds a key from its signature and looks up a cached ``BNPlan``
(validation ran when the plan was built; ``momentum`` is a per-call argument, so Apex's cumulative
average does not make a plan per step); with autograd recording it goes through ``_BatchNormFn`` (a plain
``autograd.Function``), otherwise straight to the plan's forward. Under ``torch.compile`` the op is a
``triton_op`` whose body launches through ``wrap_triton``, so Inductor launches the kernels itself; its
backward launches through ``wrap_triton`` too. A process group of several ranks is not traced: its
collectives run eagerly (``torch.compiler.disable``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from culmen.ops.backend import register_op
from culmen.ops.batch_norm.launch import PLANS, BNPlan, combine_kernel_rows, group_size, stats_kernel_rows
from culmen.ops.batch_norm.reference import (
    bn_bwd_reduce_ref,
    bn_bwd_ref,
    bn_combine_ref,
    bn_fwd_ref,
    bn_stats_ref,
    stat_dtype,
)
from culmen.ops.common.collectives import all_gather_single
from culmen.ops.common.launch import traceable_kernels

register_op("batch_norm_fwd", "normalization", "(synchronized) batch norm (+ residual z + ReLU), fp32 statistics")
register_op("batch_norm_bwd", "normalization", "backward of batch_norm_fwd (dx, dz, dweight, dbias)")


def _default_group():
    """The default process group when ``torch.distributed`` is initialized, else ``None`` (this process)."""
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def _plan(x, z, weight, bias, running_mean, running_var, use_batch_stats, eps, process_group, channel_last,
          fuse_relu) -> BNPlan:
    """The cached plan of this call signature (built, after full validation, on first sight)."""
    group = process_group
    if group is None and use_batch_stats:
        group = _default_group()
    try:
        key = (x.shape, x.stride(), x.dtype, x.device,
               None if z is None else (z.shape, z.stride(), z.dtype, z.device),
               None if weight is None else (weight.shape, weight.stride(), weight.dtype, weight.device),
               None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
               None if running_mean is None else (running_mean.shape, running_mean.stride(), running_mean.dtype,
                                                  running_mean.device),
               None if running_var is None else (running_var.shape, running_var.stride(), running_var.dtype,
                                                 running_var.device),
               use_batch_stats, eps, group, channel_last, fuse_relu)
        plan = PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors / unhashable arguments: the plan reports it
        key, plan = None, None
    if plan is None:
        plan = BNPlan(x, z, weight, bias, running_mean, running_var, use_batch_stats, eps, group, channel_last,
                      fuse_relu)
        if key is not None:
            PLANS.put(key, plan)
    return plan


# ------------------------------------------------------------------------------ reference path


def _forward_ref(plan: BNPlan, x, z, weight, bias, running_mean, running_var, momentum: float):
    """The plan's forward on the PyTorch reference (CPU, fp64, the ``reference`` backend): ``(y, (mean, invstd,
    count), x_rows)``, the statistics of the whole process group's batch in training."""
    xc = plan.to_rows(x)
    zc = plan.to_rows(z) if z is not None else None
    if plan.training:
        local = bn_stats_ref(xc, plan.cl)  # one packed row
        if plan.world > 1:
            gathered = local.new_empty((plan.world, local.shape[1]))
            all_gather_single(gathered.view(-1), local.view(-1), group=plan.group)
            local = gathered
        mean, invstd, count = bn_combine_ref(local, running_mean, running_var, momentum, plan.eps)
    else:
        sd = stat_dtype(x)
        mean, invstd, count = running_mean.to(sd), torch.rsqrt(running_var.to(sd) + plan.eps), None
    yc = bn_fwd_ref(xc, zc, mean, invstd, weight, bias, plan.relu, plan.cl)
    # A fresh tensor, as the kernel path's: a view made inside the autograd Function could not be modified
    # in place afterwards (ReLU(inplace=True) after the norm, as every ResNet has).
    return plan.from_rows(yc).clone(memory_format=torch.preserve_format), (mean, invstd, count), xc


def _backward_ref(plan: BNPlan, dy, stats, xc, y, weight, bias, need_dx: bool, store_dz: bool):
    mean, invstd, count = stats
    dyc = plan.to_rows(dy)
    yc = plan.to_rows(y) if y is not None else None
    sums, dw, db, dz = bn_bwd_reduce_ref(dyc, xc, yc, mean, invstd, weight, bias, plan.relu, plan.cl, store_dz)
    dx = None
    if need_dx:
        if plan.training and plan.world > 1:
            dist.all_reduce(sums, group=plan.group)
        dx = plan.from_rows(bn_bwd_ref(dyc, xc, yc, mean, invstd, weight, sums, count, plan.relu, plan.training,
                                       plan.cl))
    return dx, (plan.from_rows(dz) if store_dz else None), dw, db


# ------------------------------------------------------------------------------------- eager


def _forward(ctx, plan: BNPlan, momentum, x, z, weight, bias, running_mean, running_var):
    """The autograd forward of both ``autograd.Function``s: ``y``; what the backward needs goes on ``ctx``."""
    if plan.use_kernel:
        y, stats, xk = plan.forward(x, z, weight, bias, running_mean, running_var, momentum, True)
    else:
        y, stats, xk = _forward_ref(plan, x, z, weight, bias, running_mean, running_var, momentum)
    ctx.plan = plan
    ctx.stats = stats  # the workspace (kernels) or (mean, invstd, count): never handed out, so not checked
    ctx.save_for_backward(xk, weight, bias, y if plan.relu else None)
    return y


def _backward(ctx, dy, need_x: bool, need_z: bool):
    plan = ctx.plan
    x, weight, bias, y = ctx.saved_tensors
    store_dz = plan.has_z and need_z
    if plan.use_kernel:
        ws = ctx.stats
        return plan.backward(dy, ws, ws, plan.ws_fwd, x, y, weight, bias, need_x, store_dz)
    return _backward_ref(plan, dy, ctx.stats, x, y, weight, bias, need_x, store_dz)


class _BatchNormFn(torch.autograd.Function):
    """Eager autograd of ``sync_batch_norm``: the plan's kernels called directly. Few, positional arguments
    (``apply`` costs host time per argument): ``(plan, momentum, x, z, weight, bias, running_mean, running_var)``."""

    @staticmethod
    def forward(ctx, plan, momentum, x, z, weight, bias, running_mean, running_var):
        return _forward(ctx, plan, momentum, x, z, weight, bias, running_mean, running_var)

    @staticmethod
    def backward(ctx, dy):
        need = ctx.needs_input_grad
        dx, dz, dw, db = _backward(ctx, dy, need[2], need[3])
        return None, None, dx, dz, dw if need[4] else None, db if need[5] else None, None, None


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
        plan = _plan(x, z, weight, bias, running_mean, running_var, bool(use_batch_stats), float(eps), process_group,
                     bool(channel_last), bool(fuse_relu))
        return _forward(ctx, plan, float(momentum), x, z, weight, bias, running_mean, running_var)

    @staticmethod
    def backward(ctx, dy):
        need = ctx.needs_input_grad
        dx, dz, dw, db = _backward(ctx, dy, need[0], need[1])
        return dx, dz, dw if need[2] else None, db if need[3] else None, None, None, None, None, None, None, None, \
            None


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
    if torch.compiler.is_compiling():
        return _sync_batch_norm_compiled(input, weight, bias, running_mean, running_var, use_batch_stats, momentum,
                                         eps, process_group, channel_last, fuse_relu, z)
    plan = _plan(input, z, weight, bias, running_mean, running_var, use_batch_stats, eps, process_group,
                 channel_last, fuse_relu)
    if plan.use_kernel:
        if torch.is_grad_enabled() and (input.requires_grad or (z is not None and z.requires_grad)
                                        or (weight is not None and weight.requires_grad)
                                        or (bias is not None and bias.requires_grad)):
            return _BatchNormFn.apply(plan, momentum, input, z, weight, bias, running_mean, running_var)
        return plan.forward(input, z, weight, bias, running_mean, running_var, momentum, False)[0]  # no autograd node
    if torch.is_autocast_enabled(input.device.type):
        with torch.autocast(input.device.type, enabled=False):  # the reference's ops keep their dtypes
            return _BatchNormFn.apply(plan, momentum, input, z, weight, bias, running_mean, running_var)
    return _BatchNormFn.apply(plan, momentum, input, z, weight, bias, running_mean, running_var)


# ------------------------------------------------------------------------------ building blocks


def stats_rows(x: Tensor, channel_last: bool) -> Tensor:
    """The packed statistics rows ``(R, 2C + 2)`` (``[mean | M2 | int64 count]``, fp32; fp64 for fp64 ``x``) this
    process sends to its peers for ``x`` (``(N, C, L)`` NCHW or ``(M, C)`` channel-last, contiguous): ``R``
    partials of disjoint parts of the batch (kernels; ``R`` depends on C, L and the device type, never on the
    batch) or one row (reference). For tests and diagnostics."""
    if x.dtype != torch.float64 and _kernels(x.device):
        return stats_kernel_rows(x, channel_last)
    return bn_stats_ref(x, channel_last)


def combine_rows(rows: Tensor, running_mean: Tensor | None, running_var: Tensor | None, momentum: float,
                 eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Merge packed rows ``(R, 2C + 2)`` (any counts, zero included) into ``(mean (C), invstd (C), count (1,)
    int64)``, updating the running statistics in place (unbiased variance) when given. For tests and
    diagnostics."""
    if rows.dtype == torch.float32 and _kernels(rows.device):
        return combine_kernel_rows(rows, running_mean, running_var, momentum, eps)
    return bn_combine_ref(rows, running_mean, running_var, momentum, eps)


def _kernels(dev: torch.device) -> bool:
    from culmen.ops.backend import choose_backend

    return choose_backend(dev) == "triton"


# -------------------------------------------------------------------------- torch.compile


def _plan_from(x, z, weight, bias, running_mean, running_var, training, eps, channel_last, fuse_relu) -> BNPlan:
    """An uncached one-process plan for traced code (the batch size may be symbolic). Triton's CPU
    interpreter cannot be traced, so there the compiled graph takes the (traceable) reference path."""
    plan = BNPlan(x, z, weight, bias, running_mean, running_var, training, eps, None, channel_last, fuse_relu,
                  world=1)
    plan.use_kernel = plan.use_kernel and traceable_kernels()
    return plan


@torch.library.triton_op("culmen::batch_norm_fwd", mutates_args=())
def batch_norm_fwd_op(x: Tensor, z: Tensor | None, weight: Tensor | None, bias: Tensor | None,
                      running_mean: Tensor | None, running_var: Tensor | None, training: bool, momentum: float,
                      eps: float, channel_last: bool, fuse_relu: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One-process batch norm for ``torch.compile``: ``(y, stats, new_running_mean, new_running_var)``. ``y`` like
    ``x``; ``stats`` what the backward reads (the kernels' workspace, or ``[mean | invstd | count]`` of the
    reference); the updated running statistics in training (empty tensors otherwise: a functional op cannot
    update its inputs and still have an autograd formula, so the caller copies them back)."""
    plan = _plan_from(x, z, weight, bias, running_mean, running_var, training, eps, channel_last, fuse_relu)
    rm, rv = running_mean, running_var
    if plan.update:
        rm, rv = rm.clone(), rv.clone()
    if plan.use_kernel:
        y, stats, _ = plan.forward(x, z, weight, bias, rm, rv, momentum, False, traced=True)
    else:
        y, (mean, invstd, count), _ = _forward_ref(plan, x, z, weight, bias, rm, rv, momentum)
        if count is None:
            count = mean.new_zeros((1,))
        stats = torch.cat((mean, invstd, count.to(mean.dtype)))
    if not plan.update:
        rm, rv = x.new_empty((0,)), x.new_empty((0,))
    return y, stats, rm, rv


def _setup_context(ctx, inputs, output):
    # Runs while torch.compile traces (never in eager calls): the plan rides on ctx to the backward, which
    # launches the kernels itself through wrap_triton.
    x, z, weight, bias, running_mean, running_var, training, momentum, eps, channel_last, fuse_relu = inputs
    y, stats, _, _ = output
    plan = _plan_from(x, z, weight, bias, running_mean, running_var, training, eps, channel_last, fuse_relu)
    ctx.plan = plan
    ctx.save_for_backward(x, weight, bias, y if plan.relu else None, stats)


def _compiled_backward(ctx, dy, _dstats, _drm, _drv):
    plan = ctx.plan
    x, weight, bias, y, stats = ctx.saved_tensors
    need = ctx.needs_input_grad
    store_dz = plan.has_z and need[1]
    if plan.use_kernel:
        ws = torch.empty((plan.ws_bwd,), device=plan.device, dtype=torch.float32)
        x = plan.canonical(x)
        dx, dz, dw, db = plan.backward(dy, stats, ws, 0, x, y, weight, bias, need[0], store_dz, traced=True)
    else:
        C = plan.C
        ref_stats = (stats[:C], stats[C:2 * C], stats[2 * C:].to(torch.int64))
        dx, dz, dw, db = _backward_ref(plan, dy, ref_stats, plan.to_rows(x), y, weight, bias, need[0], store_dz)
    return (dx, dz, dw if need[2] else None, db if need[3] else None, None, None, None, None, None, None, None)


torch.library.register_autograd("culmen::batch_norm_fwd", _compiled_backward, setup_context=_setup_context)


@torch.compiler.disable
def _sync_batch_norm_eager(*args):
    """A process group of several ranks under ``torch.compile``: the eager path (its collectives are not traced)."""
    return sync_batch_norm(*args)


def _sync_batch_norm_compiled(x, weight, bias, running_mean, running_var, use_batch_stats, momentum, eps,
                              process_group, channel_last, fuse_relu, z):
    """``sync_batch_norm`` while ``torch.compile`` traces: the ``triton_op`` (one process), no plan cache."""
    if use_batch_stats and group_size(process_group) > 1:
        return _sync_batch_norm_eager(x, weight, bias, running_mean, running_var, use_batch_stats, momentum, eps,
                                      process_group, channel_last, fuse_relu, z)
    y, _, rm, rv = batch_norm_fwd_op(x, z, weight, bias, running_mean, running_var, bool(use_batch_stats),
                                     float(momentum), float(eps), bool(channel_last), bool(fuse_relu))
    if use_batch_stats and running_mean is not None:
        with torch.no_grad():
            running_mean.copy_(rm)
            running_var.copy_(rv)
    return y
