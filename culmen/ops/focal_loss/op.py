"""``focal_loss``, the op-level entry point of ``culmen.contrib.focal_loss`` (Apex's
``apex.contrib.focal_loss``), its eager autograd, and the ``torch.library`` op ``culmen::focal_loss_fwd``
that ``torch.compile`` traces.

The call path (DESIGN.md): an eager call builds a key from its signature and looks up a cached
``FocalPlan`` (validation ran when the plan was built); with autograd recording it goes through
``_FocalLossFn`` (a plain ``autograd.Function``), otherwise straight to the plan. Under ``torch.compile``
the forward is a ``triton_op`` whose body launches through ``wrap_triton``; its backward (registered
with ``register_autograd``) launches the gradient kernel the same way.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import register_op
from culmen.ops.focal_loss.launch import PLANS, FocalPlan, check_args, out_dtype

register_op("focal_loss_fwd", "loss", "sigmoid focal loss (RetinaNet), summed and divided by the positive count")
register_op("focal_loss_bwd", "loss", "gradient of focal_loss_fwd, recomputed from the logits")


def _plan(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma,
          label_smoothing) -> FocalPlan:
    """The cached plan of a call signature (built, and the arguments checked, on first use)."""
    nps = num_positives_sum
    try:
        key = (cls_output.shape, cls_output.stride(), cls_output.dtype, cls_output.device,
               cls_targets_at_level.shape, cls_targets_at_level.stride(), cls_targets_at_level.dtype,
               cls_targets_at_level.device,
               (nps.shape, nps.dtype, nps.device) if isinstance(nps, Tensor) else float,
               num_real_classes, alpha, gamma, label_smoothing)
        plan = PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors / unhashable scalars: the plan says why
        key, plan = None, None
    if plan is None:
        plan = FocalPlan(cls_output, cls_targets_at_level, nps, num_real_classes, alpha, gamma, label_smoothing)
        if key is not None:
            PLANS.put(key, plan)
    return plan


class _FocalLossFn(torch.autograd.Function):
    """Eager autograd: the plan's kernels called directly (the gradient is recomputed from the logits)."""

    @staticmethod
    def forward(ctx, plan, x, labels, nps):
        ctx.plan = plan
        ctx.save_for_backward(x, labels, nps)
        return plan.forward(x, labels, nps)

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        x, labels, nps = ctx.saved_tensors
        return None, plan.backward(grad, x, labels, nps), None, None


def focal_loss(cls_output: Tensor, cls_targets_at_level: Tensor, num_positives_sum: Tensor | float,
               num_real_classes: int, alpha: float, gamma: float, label_smoothing: float = 0.0) -> Tensor:
    """Sigmoid focal loss of RetinaNet, summed and divided by ``num_positives_sum`` (Apex semantics).

    Args:
        cls_output: logits ``(..., C)``, fp16/bf16/fp32/fp64; the last ``C - num_real_classes`` classes are
            padding (no loss, zero gradient).
        cls_targets_at_level: ``cls_output.shape[:-1]`` integer labels: a class in ``[0, num_real_classes)``
            (positive for it, negative for every other class), ``-1`` background (negative for all),
            ``-2`` ignored (no loss, zero gradient).
        num_positives_sum: one-element float tensor (or a number): the normalizer. Not differentiated.
        num_real_classes: ``0 <= num_real_classes <= C``.
        alpha: weight of positives (``1 - alpha`` for negatives). gamma: focusing exponent, ``>= 0``.
        label_smoothing: in ``[0, 1]``; targets become ``1 - s/2`` (positive) and ``s/2`` (negative).

    Returns:
        A 0-dim fp32 tensor (fp64 for fp64 logits), differentiable in ``cls_output``; the gradient has the
        dtype and shape of ``cls_output``.

    Differences from Apex: any ``C`` and ``num_real_classes`` (Apex needs ``C`` padded to a multiple of
    8 and at least 8 real classes), bf16 logits, int32 labels, and labels outside
    ``{-2, -1} U [0, num_real_classes)`` raise where they are checked (CPU tensors; GPU tensors with
    ``culmen.ops.backend.set_check_values(True)``; Apex silently treats them as background). The
    gradient is recomputed in the backward instead of being stored by the forward.
    """
    if torch.compiler.is_compiling():
        return _focal_loss_compiled(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha,
                                    gamma, label_smoothing)
    plan = _plan(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma,
                 label_smoothing)
    # A contiguous copy of the logits (unusual layouts only) is made under autograd: it passes the gradient on.
    x, labels, nps = plan.prepare(cls_output, cls_targets_at_level, num_positives_sum)
    if torch.is_grad_enabled() and cls_output.requires_grad:
        return _FocalLossFn.apply(plan, x, labels, nps)
    return plan.forward(x, labels, nps)


def focal_loss_with_partial_grad(cls_output: Tensor, cls_targets_at_level: Tensor, num_positives_sum: Tensor | float,
                                 num_real_classes: int, alpha: float, gamma: float,
                                 label_smoothing: float = 0.0) -> tuple[Tensor, Tensor]:
    """``(loss, partial_grad)`` as Apex's ``focal_loss_cuda.forward`` returns them, not differentiable.

    ``loss`` is ``focal_loss(...)``; ``partial_grad`` (the shape and dtype of ``cls_output``) is the gradient
    of the summed, not yet normalized loss; ``partial_grad * grad / num_positives_sum`` is the gradient.
    """
    plan = _plan(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma,
                 label_smoothing)
    with torch.no_grad():
        x, labels, nps = plan.prepare(cls_output, cls_targets_at_level, num_positives_sum)
        loss = plan.forward(x, labels, nps)
        partial = plan.backward(None, x, labels, nps)
    return loss, partial


# -------------------------------------------------------------------------- torch.compile


def _traced_plan(x, labels, num_pos, num_real, alpha, gamma, smoothing) -> FocalPlan:
    return FocalPlan(x, labels, num_pos, num_real, alpha, gamma, smoothing, traced=True)


@torch.library.triton_op("culmen::focal_loss_fwd", mutates_args=())
def focal_loss_fwd_op(x: Tensor, labels: Tensor, num_pos: Tensor, num_real: int, alpha: float, gamma: float,
                      smoothing: float) -> Tensor:
    """Focal loss of contiguous ``x`` ``(..., C)`` with contiguous int32/int64 ``labels`` ``x.shape[:-1]`` and a
    one-element ``num_pos``: a 0-dim fp32 tensor (fp64 for fp64 ``x``), for ``torch.compile``."""
    return _traced_plan(x, labels, num_pos, num_real, alpha, gamma, smoothing).forward(x, labels, num_pos, traced=True)


def _setup_context(ctx, inputs, output):
    x, labels, num_pos, *scalars = inputs
    ctx.save_for_backward(x, labels, num_pos)
    ctx.scalars = scalars


def _compiled_backward(ctx, grad):
    x, labels, num_pos = ctx.saved_tensors
    plan = _traced_plan(x, labels, num_pos, *ctx.scalars)
    dx = plan.backward(grad.reshape(()), x, labels, num_pos, traced=True)
    return dx, None, None, None, None, None, None


torch.library.register_autograd("culmen::focal_loss_fwd", _compiled_backward, setup_context=_setup_context)


def _focal_loss_compiled(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma,
                         label_smoothing) -> Tensor:
    """``focal_loss`` while ``torch.compile`` traces: the checks, the conversions as traced ops, the op."""
    num_real = check_args(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, gamma, label_smoothing)
    labels = cls_targets_at_level
    if labels.dtype not in (torch.int32, torch.int64):
        labels = labels.to(torch.int64)
    nps = num_positives_sum
    if isinstance(nps, Tensor):
        nps = nps.detach().reshape(1).to(cls_output.device)
    else:
        nps = torch.full((1,), float(nps), device=cls_output.device, dtype=out_dtype(cls_output))
    return focal_loss_fwd_op(cls_output.contiguous(), labels.contiguous(), nps, num_real, float(alpha), float(gamma),
                             float(label_smoothing))
