"""``conv_epilogue``: the op-level entry point behind ``culmen.contrib.conv_bias_relu`` and
``culmen.contrib.bottleneck``, and the cached plan lookup (``epilogue_plan``) their autograd functions use.

The call path (DESIGN.md): a call builds a key from its signature and looks up a cached ``EpiloguePlan``
(validation ran when the plan was built); with autograd recording it goes through ``_EpilogueFn`` (a plain
``autograd.Function``), otherwise straight to the plan's forward. ``scale`` and ``res_scale`` are constants
of the epilogue (frozen batch-norm factors): no gradient flows into them. Under ``torch.compile`` the call
goes to the ``triton_op`` ``culmen::conv_epilogue_fwd`` (its body launches through ``wrap_triton``, so
Inductor launches the kernel); its backward, registered with ``register_autograd``, is the ``triton_op``
``culmen::conv_epilogue_bwd``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import register_op
from culmen.ops.common.function import raw_apply
from culmen.ops.conv_epilogue.launch import PLANS, EpiloguePlan

register_op("conv_epilogue_fwd", "convolution", "act((conv * scale + bias + res * res_scale) * mask), channels-last")
register_op("conv_epilogue_bwd", "convolution", "ReLU/mask-gated gradient, scaled, with the bias sums (one pass)")


def _sig(t: Tensor | None):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def epilogue_plan(c: Tensor, scale: Tensor | None, bias: Tensor | None, res: Tensor | None,
                  res_scale: Tensor | None, mask: Tensor | None, relu: bool) -> EpiloguePlan:
    """The cached plan of this call signature (built, after full validation, on first sight)."""
    try:
        key = (_sig(c), _sig(scale), _sig(bias), _sig(res), _sig(res_scale), _sig(mask), relu)
        plan = PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors: the plan names the argument
        key, plan = None, None
    if plan is None:
        plan = EpiloguePlan(c, scale, bias, res, res_scale, mask, relu)
        if key is not None:
            PLANS.put(key, plan)
    return plan


class _EpilogueFn(torch.autograd.Function):
    """Eager autograd of ``conv_epilogue``: ``(plan, c, scale, bias, res, res_scale, mask)``."""

    @staticmethod
    def forward(ctx, plan, c, scale, bias, res, res_scale, mask):
        y = plan.forward(c, scale, bias, res, res_scale, mask)
        ctx.plan = plan
        ctx.bias_shape = None if bias is None else (bias.shape, bias.dtype)
        ctx.save_for_backward(y if plan.relu else None, mask, scale, res_scale)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, mask, scale, res_scale = ctx.saved_tensors
        need = ctx.needs_input_grad
        dc, dr, s = ctx.plan.backward(dy, y, mask, scale, res_scale, need[1], need[4],
                                      need[3] and ctx.bias_shape is not None)
        db = None
        if s is not None:
            shape, dtype = ctx.bias_shape
            db = s.to(dtype).reshape(shape)
        return None, dc, None, db, dr, None, None


_apply = raw_apply(_EpilogueFn)
_compiling = torch.compiler.is_compiling


def conv_epilogue(c: Tensor, scale: Tensor | None = None, bias: Tensor | None = None, res: Tensor | None = None,
                  res_scale: Tensor | None = None, mask: Tensor | None = None, relu: bool = False) -> Tensor:
    """``act((c * scale + bias + res * res_scale) * mask)``, differentiable in ``c``, ``bias`` and ``res``.

    Args:
        c: ``(N, C, H, W)`` fp16/bf16/fp32/fp64, typically a convolution's output; channels-last memory is
            the fast path (other layouts are copied).
        scale, bias, res_scale: ``C`` elements each (any shape, e.g. ``(1, C, 1, 1)``) or ``None``; ``scale``
            and ``res_scale`` get no gradient (frozen factors).
        res: a residual like ``c`` (any float dtype) or ``None``. mask: a multiplier like ``c`` (int8, bool
            or float) or ``None``, applied before the ReLU.
        relu: apply ReLU last.

    Returns ``c``'s shape and dtype (channels-last memory on the kernel path); math in fp32 (fp64 for fp64).
    """
    if _compiling():
        return conv_epilogue_fwd_op(c, scale, bias, res, res_scale, mask, bool(relu))
    plan = epilogue_plan(c, scale, bias, res, res_scale, mask, bool(relu))
    if torch.is_grad_enabled() and (c.requires_grad or (bias is not None and bias.requires_grad)
                                    or (res is not None and res.requires_grad)):
        return _apply(plan, c, scale, bias, res, res_scale, mask)
    return plan.forward(c, scale, bias, res, res_scale, mask)


# -------------------------------------------------------------------------- torch.compile


@torch.library.triton_op("culmen::conv_epilogue_fwd", mutates_args=())
def conv_epilogue_fwd_op(c: Tensor, scale: Tensor | None, bias: Tensor | None, res: Tensor | None,
                         res_scale: Tensor | None, mask: Tensor | None, relu: bool) -> Tensor:
    """``conv_epilogue`` for ``torch.compile``: ``act((c * scale + bias + res * res_scale) * mask)`` in ``c``'s
    shape and dtype (channels-last memory on the kernel path). Differentiable in ``c``, ``bias`` and ``res``."""
    plan = EpiloguePlan(c, scale, bias, res, res_scale, mask, relu, traced=True)
    return plan.forward_traced(c, scale, bias, res, res_scale, mask)


@torch.library.triton_op("culmen::conv_epilogue_bwd", mutates_args=())
def conv_epilogue_bwd_op(dy: Tensor, y: Tensor | None, mask: Tensor | None, scale: Tensor | None,
                         res_scale: Tensor | None, relu: bool, need_dc: bool, need_dr: bool,
                         need_sum: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of ``culmen::conv_epilogue_fwd`` for ``g = dy * [y > 0] * mask``: ``(dc, dr, sum_g)`` with
    ``dc = g * scale`` and ``dr = g * res_scale`` (``dy``'s shape and dtype) and ``sum_g`` the fp32 (fp64 for
    fp64) ``(C,)`` channel sums of ``g``; a 0-element tensor for each one not asked for. ``y`` is the forward's
    output (``None`` without ReLU)."""
    # The plan only needs the residual's presence for res_scale's check: dy stands in for it.
    plan = EpiloguePlan(dy, scale, None, None if res_scale is None else dy, res_scale, mask, relu, traced=True)
    return plan.backward_traced(dy, y, mask, scale, res_scale, need_dc, need_dr, need_sum)


def _setup_context(ctx, inputs, output):
    c, scale, bias, res, res_scale, mask, relu = inputs
    ctx.relu = relu
    ctx.bias_meta = None if bias is None else (bias.shape, bias.dtype)
    ctx.has_res = res is not None
    ctx.save_for_backward(output if relu else None, mask, scale, res_scale)


def _compiled_backward(ctx, dy):
    y, mask, scale, res_scale = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_sum = need[2] and ctx.bias_meta is not None
    need_dr = need[3] and ctx.has_res
    dc, dr, s = conv_epilogue_bwd_op(dy, y, mask, scale, res_scale, ctx.relu, need[0], need_dr, need_sum)
    db = None
    if need_sum:
        shape, dtype = ctx.bias_meta
        db = s.to(dtype).reshape(shape)
    return dc if need[0] else None, None, db, dr if need_dr else None, None, None, None


torch.library.register_autograd("culmen::conv_epilogue_fwd", _compiled_backward, setup_context=_setup_context)
