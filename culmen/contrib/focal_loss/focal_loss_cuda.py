"""Apex's compiled ``focal_loss_cuda`` module, in Python on culmen's kernels (for ``culmen.compat``).

``forward`` returns ``[loss, partial_grad]`` where ``partial_grad`` is the gradient of the summed,
not yet normalized loss; ``backward`` scales it in place by ``grad_output / num_positives_sum`` and
returns it, as Apex's kernels do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.focal_loss.op import focal_loss_with_partial_grad

__all__ = ["backward", "forward"]


def forward(cls_output: Tensor, cls_targets_at_level: Tensor, num_positives_sum: Tensor, num_real_classes: int,
            alpha: float, gamma: float, smoothing_factor: float) -> list[Tensor]:
    """``[loss (0-dim fp32), partial_grad (like cls_output)]``; nothing is differentiable."""
    loss, partial = focal_loss_with_partial_grad(cls_output, cls_targets_at_level, num_positives_sum,
                                                 num_real_classes, alpha, gamma, smoothing_factor)
    return [loss, partial]


def backward(grad_output: Tensor, partial_grad: Tensor, num_positives_sum: Tensor) -> Tensor:
    """``partial_grad *= grad_output / num_positives_sum`` in place (fp32 arithmetic); returns ``partial_grad``."""
    with torch.no_grad():
        scale = grad_output.reshape(()).float() / num_positives_sum.reshape(()).float()
        if partial_grad.dtype in (torch.float32, torch.float64):
            partial_grad.mul_(scale.to(partial_grad.dtype))
        else:
            partial_grad.copy_(partial_grad.float() * scale)
    return partial_grad
