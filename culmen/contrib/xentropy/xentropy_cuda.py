"""Apex's compiled ``xentropy_cuda`` extension in Python: ``forward`` and ``backward`` with its signatures.

``forward(logits, labels, smoothing, half_to_float) -> [losses, max_log_sum_exp]`` computes every row
(the padding mask is applied by ``SoftmaxCrossEntropyLoss``); ``backward(grad_loss, logits,
max_log_sum_exp, labels, smoothing) -> grad_logits``. Neither records autograd history, as with the
extension. Differences: ``max_log_sum_exp`` is fp32 (Apex stores it in the loss dtype, which loses
precision for half logits), labels outside ``[0, V)`` raise ``ValueError`` (CPU labels; NaN rows on
the GPU), and CPU tensors work.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.cross_entropy.op import NO_IGNORE, bwd_impl, check_float, check_int_labels, check_labels, fwd_impl

__all__ = ["backward", "forward"]
__version__ = ""


def _check(logits: Tensor, labels: Tensor) -> None:
    check_float("logits", logits)
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be 2-D (N, V) with V >= 1, got shape {tuple(logits.shape)}")
    check_int_labels(labels, (logits.shape[0],), logits.device)
    check_labels(labels, logits.shape[1], NO_IGNORE)


@torch.no_grad()
def forward(logits: Tensor, labels: Tensor, smoothing: float = 0.0, half_to_float: bool = False) -> list[Tensor]:
    """``[losses (N,), max_log_sum_exp (N,) fp32]``; losses fp32 if ``half_to_float`` else logits' dtype."""
    _check(logits, labels)
    if not 0.0 <= float(smoothing) <= 1.0:
        raise ValueError(f"smoothing must be in [0, 1], got {smoothing}")
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    loss, _, lse = fwd_impl(x, labels.contiguous(), None, float(smoothing), 1.0, 0.0, NO_IGNORE, 0.0, 0,
                            logits.shape[1], True)
    return [loss if half_to_float else loss.to(logits.dtype), lse]


@torch.no_grad()
def backward(grad_loss: Tensor, logits: Tensor, max_log_sum_exp: Tensor, labels: Tensor,
             smoothing: float = 0.0) -> Tensor:
    """``grad_logits (N, V)`` in the logits' dtype for per-row ``grad_loss (N,)``."""
    _check(logits, labels)
    N, V = logits.shape
    for name, t in (("grad_loss", grad_loss), ("max_log_sum_exp", max_log_sum_exp)):
        if tuple(t.shape) != (N,):
            raise ValueError(f"{name} must have shape ({N},), got {tuple(t.shape)}")
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    return bwd_impl(grad_loss.to(torch.float32), x, max_log_sum_exp.to(torch.float32).contiguous(),
                    labels.contiguous(), float(smoothing), 1.0, 0.0, NO_IGNORE, 0.0, 0, V)
