"""Apex's compiled ``xentropy_cuda`` extension in Python: ``forward`` and ``backward`` with its signatures.

``forward(logits, labels, smoothing, half_to_float) -> [losses, max_log_sum_exp]`` computes every row
(the padding mask is applied by ``SoftmaxCrossEntropyLoss``); ``backward(grad_loss, logits,
max_log_sum_exp, labels, smoothing) -> grad_logits``. Neither records autograd history, as with the
extension. Both run the cached plans of ``culmen.ops.cross_entropy``. Differences: ``max_log_sum_exp``
is fp32 (Apex stores it in the loss dtype, which loses precision for half logits), labels outside
``[0, V)`` raise ``ValueError`` (CPU labels; NaN rows on the GPU), and CPU tensors work.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.cross_entropy.op import NO_IGNORE, check_labels, get_plan, run_backward, run_forward

__all__ = ["backward", "forward"]
__version__ = ""

_F32 = torch.float32


def _plan(logits: Tensor, labels: Tensor, smoothing: float, out_dtype: torch.dtype | None):
    if not isinstance(logits, Tensor) or logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be 2-D (N, V) with V >= 1, got shape {tuple(getattr(logits, 'shape', ()))}")
    plan = get_plan(logits, labels, None, smoothing, 1.0, 0.0, NO_IGNORE, None, "none", False, out_dtype)
    if plan.check_values:
        check_labels(labels, plan.V, NO_IGNORE)
    return plan


@torch.no_grad()
def forward(logits: Tensor, labels: Tensor, smoothing: float = 0.0, half_to_float: bool = False) -> list[Tensor]:
    """``[losses (N,), max_log_sum_exp (N,) fp32]``; losses fp32 if ``half_to_float`` else logits' dtype."""
    plan = _plan(logits, labels, smoothing, None if half_to_float else logits.dtype)
    x = logits.contiguous() if plan.copy_logits else logits
    loss, _, lse, _ = run_forward(plan, x, labels, None)
    return [loss, lse]


@torch.no_grad()
def backward(grad_loss: Tensor, logits: Tensor, max_log_sum_exp: Tensor, labels: Tensor,
             smoothing: float = 0.0) -> Tensor:
    """``grad_logits (N, V)`` in the logits' dtype for per-row ``grad_loss (N,)``."""
    plan = _plan(logits, labels, smoothing, None)
    N = plan.N
    for name, t in (("grad_loss", grad_loss), ("max_log_sum_exp", max_log_sum_exp)):
        if tuple(t.shape) != (N,):
            raise ValueError(f"{name} must have shape ({N},), got {tuple(t.shape)}")
    x = logits.contiguous() if plan.copy_logits else logits
    return run_backward(plan, grad_loss, x, max_log_sum_exp.to(_F32).contiguous(), labels, None)
