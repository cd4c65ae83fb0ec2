"""``group_norm``, the op-level entry point of ``culmen.contrib.group_norm`` (Apex's NHWC GroupNorm with fused
SiLU) for NCHW and channels-last inputs alike, its eager autograd, and the ``torch.library`` op
``culmen::group_norm_fwd`` that ``torch.compile`` traces.

The call path (DESIGN.md): an eager call builds a key from its signature and looks up a cached ``GNPlan``
(validation ran when the plan was built); with autograd recording it goes through ``_GroupNormFn`` (a plain
``autograd.Function`` whose statistics stay in the forward's workspace), otherwise straight to the plan's
forward. Under ``torch.compile`` the op is a ``triton_op`` whose body launches through ``wrap_triton``, so
Inductor launches the kernels itself; its backward launches through ``wrap_triton`` too.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import register_op
from culmen.ops.common.launch import traceable_kernels
from culmen.ops.group_norm.launch import PLANS, GNPlan, parse_act
from culmen.ops.group_norm.reference import group_norm_bwd_ref, group_norm_fwd_ref, spatial_strides, stats_dtype

register_op("group_norm_fwd", "normalization", "GroupNorm (+ SiLU), NCHW or channels-last, fp32 statistics")
register_op("group_norm_bwd", "normalization", "backward of group_norm_fwd (dx, dweight, dbias)")

__all__ = ["group_norm", "group_norm_backward", "parse_act"]


def _plan(x, num_groups, weight, bias, eps, act) -> GNPlan:
    """The cached plan of this call signature (built, after full validation, on first sight)."""
    try:
        key = (x.shape, x.stride(), x.dtype, x.device, num_groups, eps, act,
               None if weight is None else (weight.shape, weight.stride(), weight.dtype, weight.device),
               None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device))
        plan = PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors / unhashable arguments: the plan reports it
        key, plan = None, None
    if plan is None:
        plan = GNPlan(x, num_groups, weight, bias, eps, act)
        if key is not None:
            PLANS.put(key, plan)
    return plan


def _forward(plan: GNPlan, x, weight, bias):
    """``(y, mean, rstd, roff)``: the kernels keep both statistics in one workspace (``mean = rstd = ws``,
    ``rstd`` at offset ``roff = N G``); the reference returns them apart (``roff = 0``)."""
    if plan.use_kernel:
        y, ws = plan.forward(x, weight, bias)
        return y, ws, ws, plan.NG
    y, mean, rstd = group_norm_fwd_ref(x, weight, bias, plan.G, plan.eps, plan.silu)
    return y, mean, rstd, 0


def _backward(plan: GNPlan, dy, x, weight, bias, mean, rstd, roff, need_dw: bool):
    if plan.use_kernel:
        return plan.backward(dy, x, weight, bias, mean, rstd, roff, need_dw)
    if spatial_strides(dy) is None:
        dy = dy.contiguous()
    return group_norm_bwd_ref(dy, x, weight, bias, mean, rstd, plan.G, plan.silu, need_dw)


def _stats_views(plan: GNPlan, mean: Tensor, rstd: Tensor, roff) -> tuple[Tensor, Tensor]:
    """``(mean, rstd)`` as ``(N, G)`` tensors (views of the kernels' workspace)."""
    if roff:
        return mean[: 2 * plan.NG].view(2, plan.N, plan.G).unbind(0)
    return mean, rstd


# ------------------------------------------------------------------------------------- eager


class _GroupNormFn(torch.autograd.Function):
    """Eager autograd: the plan's kernels called directly. ``forward(plan, x, weight, bias) -> y``; the
    statistics are saved (version-checked), not returned."""

    @staticmethod
    def forward(ctx, plan, x, weight, bias):
        y, mean, rstd, roff = _forward(plan, x, weight, bias)
        ctx.plan = plan
        ctx.roff = roff
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx, dw, db = _backward(ctx.plan, dy, x, weight, bias, mean, rstd, ctx.roff, need[2] or need[3])
        return None, dx if need[1] else None, dw if need[2] else None, db if need[3] else None


class _GroupNormStatsFn(torch.autograd.Function):
    """``_GroupNormFn`` that also returns the statistics ``(N, G)`` (not differentiable): ``return_stats``."""

    @staticmethod
    def forward(ctx, plan, x, weight, bias):
        y, mean, rstd, roff = _forward(plan, x, weight, bias)
        ctx.plan = plan
        ctx.roff = roff
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        m, r = _stats_views(plan, mean, rstd, roff)
        ctx.mark_non_differentiable(m, r)
        return y, m, r

    @staticmethod
    def backward(ctx, dy, _dmean, _drstd):
        return _GroupNormFn.backward(ctx, dy)


def group_norm(x: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5, act: str | None = "", return_stats: bool = False
               ) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """GroupNorm over ``num_groups`` groups of channels, optionally followed by SiLU, in one pass.

    Args:
        x: ``(N, C, *spatial)``, fp16/bf16/fp32/fp64, NCHW or channels-last (or any layout whose spatial
            dims collapse into one stride; others are copied first).
        num_groups: divides ``C`` (any value; Apex's fast path takes only 16 or 32).
        weight, bias: ``(C,)`` of any float dtype (independent of ``x``'s), or ``None``.
        eps: added to the variance.
        act: ``None`` / ``""`` (none) or ``"silu"`` / ``"swish"``.
        return_stats: also return the per-group ``mean`` and ``rstd`` (``(N, num_groups)``, not differentiable).

    Returns:
        ``y`` with the shape, dtype and memory format of ``x`` (``(y, mean, rstd)`` with ``return_stats``).
        Statistics are fp32 (fp64 for fp64 ``x``); gradients for ``x``, ``weight`` and ``bias`` (in their
        own dtypes).
    """
    if torch.compiler.is_compiling():
        return _group_norm_compiled(x, num_groups, weight, bias, eps, act, return_stats)
    plan = _plan(x, num_groups, weight, bias, eps, act)
    if plan.fix_x:
        x = x.contiguous()
    if plan.fix_params:
        weight, bias = plan.params(weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)
                                    or (bias is not None and bias.requires_grad)):
        if return_stats:
            return _GroupNormStatsFn.apply(plan, x, weight, bias)
        return _GroupNormFn.apply(plan, x, weight, bias)
    y, mean, rstd, roff = _forward(plan, x, weight, bias)  # nothing to differentiate: no autograd node
    if return_stats:
        return (y, *_stats_views(plan, mean, rstd, roff))
    return y


def group_norm_backward(grad_output: Tensor, x: Tensor, num_groups: int, weight: Tensor | None, bias: Tensor | None,
                        mean: Tensor, rstd: Tensor, act: str | None = ""
                        ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(dx, dweight, dbias)`` of ``group_norm`` from its saved ``mean`` / ``rstd`` (``(N, num_groups)``); not
    differentiable.

    ``grad_output`` has the shape of ``x`` (any layout); the parameter gradients are ``None`` without the
    parameter.
    """
    if tuple(grad_output.shape) != tuple(x.shape):
        raise ValueError(f"group_norm: grad_output must have the shape of x {tuple(x.shape)}, got "
                         f"{tuple(grad_output.shape)}")
    plan = _plan(x, num_groups, weight, bias, 0.0, act)
    stats = (x.shape[0], plan.G)
    if tuple(mean.shape) != stats or tuple(rstd.shape) != stats:
        raise ValueError(f"group_norm: mean and rstd must have shape {stats}, got {tuple(mean.shape)} and "
                         f"{tuple(rstd.shape)}")
    if plan.fix_x:
        x = x.contiguous()
    w, b = plan.params(weight, bias) if plan.fix_params else (weight, bias)
    sd = stats_dtype(x)
    mean, rstd = mean.to(sd).contiguous(), rstd.to(sd).contiguous()
    with torch.no_grad():
        return _backward(plan, grad_output.to(x.dtype), x, w, b, mean, rstd, 0, True)


# -------------------------------------------------------------------------- torch.compile


def _plan_from(x, weight, bias, num_groups, eps, silu) -> GNPlan:
    """An uncached plan for traced code (the batch size may be symbolic). Triton's CPU interpreter cannot be
    traced, so there the compiled graph takes the (traceable) reference path."""
    plan = GNPlan(x, num_groups, weight, bias, eps, "silu" if silu else "")
    plan.use_kernel = plan.use_kernel and traceable_kernels()
    return plan


@torch.library.triton_op("culmen::group_norm_fwd", mutates_args=())
def group_norm_fwd_op(x: Tensor, weight: Tensor | None, bias: Tensor | None, num_groups: int, eps: float,
                      silu: bool) -> tuple[Tensor, Tensor, Tensor]:
    """GroupNorm of ``x`` ``(N, C, *spatial)`` (spatial dims collapsible into one stride) with contiguous ``(C,)``
    parameters, for ``torch.compile``. Returns ``(y, mean, rstd)``: ``y`` like ``x``; ``mean``/``rstd``
    ``(N, num_groups)`` fp32 (fp64 for fp64 ``x``)."""
    plan = _plan_from(x, weight, bias, num_groups, eps, silu)
    if plan.use_kernel:
        return plan.forward(x, weight, bias, traced=True)
    return group_norm_fwd_ref(x, weight, bias, plan.G, plan.eps, plan.silu)


def _setup_context(ctx, inputs, output):
    # Runs while torch.compile traces (never in eager calls): the plan rides on ctx to the backward, which
    # launches the kernel itself through wrap_triton (no custom op needed there).
    x, weight, bias, num_groups, eps, silu = inputs
    _, mean, rstd = output
    ctx.plan = _plan_from(x, weight, bias, num_groups, eps, silu)
    ctx.save_for_backward(x, weight, bias, mean, rstd)


def _compiled_backward(ctx, dy, _dmean, _drstd):
    plan = ctx.plan
    x, weight, bias, mean, rstd = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_dw = bool(need[1] or need[2])
    if plan.use_kernel:
        dx, dw, db = plan.backward(dy, x, weight, bias, mean, rstd, 0, need_dw, traced=True)
    else:
        dx, dw, db = _backward(plan, dy, x, weight, bias, mean, rstd, 0, need_dw)
    return (dx if need[0] else None, dw if need[1] else None, db if need[2] else None, None, None, None)


torch.library.register_autograd("culmen::group_norm_fwd", _compiled_backward, setup_context=_setup_context)


def _group_norm_compiled(x, num_groups, weight, bias, eps, act, return_stats):
    """``group_norm`` while ``torch.compile`` traces: the ``triton_op``, no plan cache. Layout fixes (a copy of
    an ``x`` whose spatial dims do not collapse, ``(C,)`` parameters) are traced ops before it."""
    silu = parse_act(act)
    C = x.shape[1]
    if spatial_strides(x) is None:
        x = x.contiguous()
    if weight is not None and not (weight.dim() == 1 and weight.is_contiguous()):
        weight = weight.reshape(C).contiguous()
    if bias is not None and not (bias.dim() == 1 and bias.is_contiguous()):
        bias = bias.reshape(C).contiguous()
    y, mean, rstd = group_norm_fwd_op(x, weight, bias, num_groups, float(eps), silu)
    return (y, mean, rstd) if return_stats else y
