"""``conv_epilogue``: the op-level entry point behind ``culmen.contrib.conv_bias_relu`` and
``culmen.contrib.bottleneck``, and the cached plan lookup (``epilogue_plan``) their autograd functions use.

The call path (DESIGN.md): a call builds a key from its signature and looks up a cached ``EpiloguePlan``
(validation ran when the plan was built); with autograd recording it goes through ``_EpilogueFn`` (a plain
``autograd.Function``), otherwise straight to the plan's forward. ``scale`` and ``res_scale`` are constants
of the epilogue (frozen batch-norm factors): no gradient flows into them. There is no ``torch.library`` op:
under ``torch.compile`` the API functions use the same formula in plain PyTorch ops, which Inductor fuses.
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
    plan = epilogue_plan(c, scale, bias, res, res_scale, mask, bool(relu))
    if torch.is_grad_enabled() and (c.requires_grad or (bias is not None and bias.requires_grad)
                                    or (res is not None and res.requires_grad)):
        return _apply(plan, c, scale, bias, res, res_scale, mask)
    return plan.forward(c, scale, bias, res, res_scale, mask)
