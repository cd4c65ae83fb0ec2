"""Pure-PyTorch focal loss: the oracle of the tests and the CPU path of the op.

``focal_loss_ref`` is the textbook formula (sigmoid, BCE-with-logits, pow) kept differentiable, so
its autograd gradient checks the hand-derived one of the kernels. ``focal_loss_fwd_ref`` /
``focal_loss_bwd_ref`` compute what the kernels compute (fp32, or fp64 for fp64 logits), with the
same closed-form gradient; they back the custom ops on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _masks(x: Tensor, labels: Tensor, num_real: int) -> tuple[Tensor, Tensor]:
    cls = torch.arange(x.shape[-1], device=x.device)
    lab = labels.unsqueeze(-1)
    pos = lab == cls
    valid = (lab != -2) & (cls < num_real)
    return pos, valid


def focal_loss_ref(x: Tensor, labels: Tensor, num_pos: Tensor | float, num_real: int, alpha: float, gamma: float,
                   smoothing: float = 0.0) -> Tensor:
    """Sigmoid focal loss summed over every valid element and divided by ``num_pos``, computed in ``x.dtype``.

    Args:
        x: logits ``(..., C)``.
        labels: ``x.shape[:-1]`` integers: a class in ``[0, num_real)`` (positive for that class, negative
            for the others), ``-1`` background (negative for every class), ``-2`` ignored (no loss).
        num_pos: the normalizer (tensor or number).
        num_real: classes ``>= num_real`` are padding and contribute nothing.
        alpha, gamma: the focal weights: ``alpha`` for positives, ``1 - alpha`` for negatives, ``(1 - p_t)^gamma``.
        smoothing: label smoothing: targets become ``1 - s/2`` and ``s/2``.

    Returns a 0-dim tensor of ``x.dtype``; differentiable in ``x``.
    """
    pos, valid = _masks(x, labels, num_real)
    target = pos.to(x.dtype) * (1.0 - smoothing) + smoothing / 2.0
    p = torch.sigmoid(x)
    ce = F.binary_cross_entropy_with_logits(x, target, reduction="none")
    q = torch.where(pos, 1.0 - p, p)
    a = torch.where(pos, torch.full_like(x, alpha), torch.full_like(x, 1.0 - alpha))
    loss = a * q.pow(gamma) * ce
    total = torch.where(valid, loss, torch.zeros_like(loss)).sum()
    return total / (num_pos.reshape(()) if isinstance(num_pos, Tensor) else num_pos)


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _terms(x: Tensor, labels: Tensor, num_real: int, alpha: float, gamma: float, smoothing: float):
    """Element loss and gradient in the kernels' stable form (see ``kernels.py``)."""
    xf = x.to(_compute_dtype(x))
    pos, valid = _masks(xf, labels, num_real)
    e = torch.exp(-xf.abs())
    inv = 1.0 / (1.0 + e)
    nonneg = xf >= 0
    sig = torch.where(nonneg, inv, e * inv)
    one_m_sig = torch.where(nonneg, e * inv, inv)
    soft = torch.clamp(-xf, min=0.0) + torch.log1p(e)
    q = torch.where(pos, one_m_sig, sig)
    # Scalars as tensors of the compute dtype: torch.where on Python floats would give fp32.
    coeff = torch.where(pos, xf.new_tensor(alpha), xf.new_tensor(1.0 - alpha)) * q.pow(gamma)
    t = torch.where(pos, xf.new_tensor(1.0 - 0.5 * smoothing), xf.new_tensor(0.5 * smoothing))
    bce = soft + (1.0 - t) * xf
    zero = xf.new_zeros(())
    loss = torch.where(valid, coeff * bce, zero)
    slope = torch.where(pos, -sig, one_m_sig)
    grad = torch.where(valid, coeff * (gamma * slope * bce + sig - t), zero)
    return loss, grad


def focal_loss_fwd_ref(x: Tensor, labels: Tensor, num_pos: Tensor, num_real: int, alpha: float, gamma: float,
                       smoothing: float) -> Tensor:
    """What ``focal_loss_fwd`` returns: a 0-dim fp32 (fp64 for fp64 ``x``) loss."""
    loss, _ = _terms(x, labels, num_real, alpha, gamma, smoothing)
    return loss.sum() / num_pos.reshape(()).to(loss.dtype)


def focal_loss_bwd_ref(grad: Tensor | None, x: Tensor, labels: Tensor, num_pos: Tensor, num_real: int,
                       alpha: float, gamma: float, smoothing: float) -> Tensor:
    """What ``focal_loss_bwd`` returns: the gradient (dtype of ``x``) times ``grad / num_pos``, or the
    raw gradient of the summed loss when ``grad`` is ``None``."""
    _, g = _terms(x, labels, num_real, alpha, gamma, smoothing)
    if grad is not None:
        g = g * (grad.reshape(()).to(g.dtype) / num_pos.reshape(()).to(g.dtype))
    return g.to(x.dtype)
