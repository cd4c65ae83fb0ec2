"""Custom ops ``culmen::focal_loss_fwd`` / ``culmen::focal_loss_bwd``, their autograd, and ``focal_loss``.

``focal_loss`` is the op-level entry point of ``culmen.contrib.focal_loss`` (Apex's
``apex.contrib.focal_loss``). It validates the arguments, flattens the logits to ``(R, C)`` and runs
the Triton kernels (CUDA, or ``CULMEN_BACKEND=triton``) or the PyTorch reference (CPU).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import choose_backend, register_op
from culmen.ops.common.checks import check_values_enabled
from culmen.ops.focal_loss.reference import focal_loss_bwd_ref, focal_loss_fwd_ref

register_op("focal_loss_fwd", "loss", "sigmoid focal loss (RetinaNet), summed and divided by the positive count")
register_op("focal_loss_bwd", "loss", "gradient of focal_loss_fwd, recomputed from the logits")

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _out_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _use_triton(x: Tensor) -> bool:
    # Triton passes float scalars (alpha, gamma, smoothing) as fp32: fp64 logits take the reference,
    # which keeps them in fp64 (fp64 is a checking dtype, not a training one).
    return x.dtype != torch.float64 and choose_backend(x.device) == "triton"


def _fwd_impl(x, labels, num_pos, num_real, alpha, gamma, smoothing):
    if _use_triton(x):
        from culmen.ops.focal_loss.launch import focal_loss_fwd

        return focal_loss_fwd(x, labels, num_pos, num_real, alpha, gamma, smoothing)
    return focal_loss_fwd_ref(x, labels, num_pos, num_real, alpha, gamma, smoothing)


def _bwd_impl(grad, x, labels, num_pos, num_real, alpha, gamma, smoothing):
    if _use_triton(x):
        from culmen.ops.focal_loss.launch import focal_loss_bwd

        return focal_loss_bwd(grad, x, labels, num_pos, num_real, alpha, gamma, smoothing)
    return focal_loss_bwd_ref(grad, x, labels, num_pos, num_real, alpha, gamma, smoothing)


@torch.library.custom_op("culmen::focal_loss_fwd", mutates_args=())
def focal_loss_fwd_op(x: Tensor, labels: Tensor, num_pos: Tensor, num_real: int, alpha: float, gamma: float,
                      smoothing: float) -> Tensor:
    """Focal loss of contiguous ``x`` ``(R, C)`` with ``labels`` ``(R,)`` and ``num_pos`` ``(1,)``: a 0-dim
    fp32 tensor (fp64 for fp64 ``x``)."""
    return _fwd_impl(x, labels, num_pos, num_real, alpha, gamma, smoothing)


@focal_loss_fwd_op.register_fake
def _(x, labels, num_pos, num_real, alpha, gamma, smoothing):
    return x.new_empty((), dtype=_out_dtype(x))


@torch.library.custom_op("culmen::focal_loss_bwd", mutates_args=())
def focal_loss_bwd_op(grad: Tensor, x: Tensor, labels: Tensor, num_pos: Tensor, num_real: int, alpha: float,
                      gamma: float, smoothing: float) -> Tensor:
    """Gradient of ``culmen::focal_loss_fwd`` for ``x`` (``(R, C)``, dtype of ``x``), given the 0-dim ``grad``."""
    return _bwd_impl(grad, x, labels, num_pos, num_real, alpha, gamma, smoothing)


@focal_loss_bwd_op.register_fake
def _(grad, x, labels, num_pos, num_real, alpha, gamma, smoothing):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    x, labels, num_pos, num_real, alpha, gamma, smoothing = inputs
    ctx.save_for_backward(x, labels, num_pos)
    ctx.args = (num_real, alpha, gamma, smoothing)


def _backward(ctx, grad, bwd=None):
    x, labels, num_pos = ctx.saved_tensors
    dx = (bwd or focal_loss_bwd_op)(grad.reshape(()).contiguous(), x, labels, num_pos, *ctx.args)
    return dx, None, None, None, None, None, None


torch.library.register_autograd("culmen::focal_loss_fwd", _backward, setup_context=_setup_context)


class _FocalLossFn(torch.autograd.Function):
    """Eager path: the implementations of the custom ops without ``torch.library`` dispatch overhead."""

    @staticmethod
    def forward(ctx, *inputs):
        out = _fwd_impl(*inputs)
        _setup_context(ctx, inputs, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _backward(ctx, grad, bwd=_bwd_impl)


def _prepare(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma,
             label_smoothing) -> tuple:
    """Validate the arguments of ``focal_loss``; return the custom ops' ``(x2, labels, num_pos, num_real,
    alpha, gamma, smoothing)`` (``x2`` the contiguous ``(R, C)`` logits)."""
    x = cls_output
    if not isinstance(x, Tensor) or x.dtype not in _FLOATS:
        got = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"focal_loss: cls_output must be a float16/bfloat16/float32/float64 tensor, got {got}")
    labels = cls_targets_at_level
    if not isinstance(labels, Tensor) or labels.dtype.is_floating_point or labels.dtype.is_complex or \
            labels.dtype == torch.bool:
        got = labels.dtype if isinstance(labels, Tensor) else type(labels).__name__
        raise TypeError(f"focal_loss: cls_targets_at_level must be an integer tensor, got {got}")
    if x.dim() == 0:
        raise ValueError("focal_loss: cls_output must have a class dimension, got a 0-dim tensor")
    if tuple(labels.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"focal_loss: cls_targets_at_level must have shape cls_output.shape[:-1] = "
                         f"{tuple(x.shape[:-1])}, got {tuple(labels.shape)}")
    if labels.device != x.device:
        raise ValueError(f"focal_loss: cls_targets_at_level is on {labels.device} but cls_output on {x.device}")
    C = x.shape[-1]
    num_real = int(num_real_classes)
    if not 0 <= num_real <= C:
        raise ValueError(f"focal_loss: num_real_classes must be in [0, {C}] (the class dim of cls_output), "
                         f"got {num_real_classes}")
    if float(gamma) < 0.0:
        raise ValueError(f"focal_loss: gamma must be >= 0, got {gamma}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"focal_loss: label_smoothing must be in [0, 1], got {label_smoothing}")
    nps = num_positives_sum
    if isinstance(nps, Tensor):
        if nps.numel() != 1 or not nps.dtype.is_floating_point:
            raise ValueError(f"focal_loss: num_positives_sum must be a one-element float tensor, got shape "
                             f"{tuple(nps.shape)} and dtype {nps.dtype}")
        nps = nps.detach().reshape(1).to(device=x.device, dtype=_out_dtype(x))
    else:
        nps = torch.full((1,), float(nps), device=x.device, dtype=_out_dtype(x))
    if labels.numel() and check_values_enabled(labels):
        lo, hi = (int(v) for v in torch.aminmax(labels))
        if lo < -2 or hi >= num_real:
            bad = labels[(labels < -2) | (labels >= num_real)]
            raise ValueError(f"focal_loss: cls_targets_at_level must be -2 (ignore), -1 (background) or a class in "
                             f"[0, {num_real}); got {bad.unique()[:8].tolist()}")
    if labels.dtype not in (torch.int32, torch.int64):
        labels = labels.to(torch.int64)
    x2 = x.reshape(-1, C).contiguous()
    lab = labels.reshape(-1).contiguous()
    return (x2, lab, nps, num_real, float(alpha), float(gamma), float(label_smoothing))


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
    ``{-2, -1} U [0, num_real_classes)`` raise (Apex silently treats them as background). The
    gradient is recomputed in the backward instead of being stored by the forward.
    """
    args = _prepare(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma,
                    label_smoothing)
    fn = focal_loss_fwd_op if torch.compiler.is_compiling() else _FocalLossFn.apply
    return fn(*args)


def focal_loss_with_partial_grad(cls_output: Tensor, cls_targets_at_level: Tensor, num_positives_sum: Tensor | float,
                                 num_real_classes: int, alpha: float, gamma: float,
                                 label_smoothing: float = 0.0) -> tuple[Tensor, Tensor]:
    """``(loss, partial_grad)`` as Apex's ``focal_loss_cuda.forward`` returns them, not differentiable.

    ``loss`` is ``focal_loss(...)``; ``partial_grad`` (the shape and dtype of ``cls_output``) is the gradient
    of the summed, not yet normalized loss; ``partial_grad * grad / num_positives_sum`` is the gradient.
    """
    x2, lab, nps, num_real, a, g, s = _prepare(cls_output, cls_targets_at_level, num_positives_sum,
                                              num_real_classes, alpha, gamma, label_smoothing)
    with torch.no_grad():
        loss = _fwd_impl(x2, lab, nps, num_real, a, g, s)
        partial = _bwd_impl(None, x2, lab, nps, num_real, a, g, s)
    return loss, partial.reshape(cls_output.shape)
