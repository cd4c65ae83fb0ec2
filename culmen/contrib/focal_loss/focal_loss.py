"""``apex.contrib.focal_loss.focal_loss`` on culmen's focal-loss op (``culmen.ops.focal_loss``).

The loss is the sigmoid focal loss summed over every (anchor, real class) pair whose anchor is not
ignored, divided by ``num_positives_sum``. Targets are class indices: ``-1`` background, ``-2``
ignored; classes from ``num_real_classes`` on are padding. See ``culmen.ops.focal_loss.focal_loss``
for the differences from Apex (any class count, bf16, labels validated).
"""

from __future__ import annotations

from torch import Tensor

from culmen.ops.focal_loss import focal_loss as _focal_loss

__all__ = ["FocalLoss", "focal_loss"]


class FocalLoss:
    """Stand-in for Apex's autograd function: ``FocalLoss.apply(cls_output, cls_targets_at_level,
    num_positives_sum, num_real_classes, alpha, gamma, label_smoothing=0.0)`` returns the 0-dim fp32 loss,
    differentiable in ``cls_output``."""

    @staticmethod
    def apply(cls_output: Tensor, cls_targets_at_level: Tensor, num_positives_sum: Tensor, num_real_classes: int,
              alpha: float, gamma: float, label_smoothing: float = 0.0) -> Tensor:
        return _focal_loss(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma,
                           label_smoothing)


def focal_loss(cls_output: Tensor, cls_targets_at_level: Tensor, num_positive_sum: Tensor, num_real_classes: int,
               alpha: float, gamma: float, label_smoothing: float = 0.0) -> Tensor:
    """Fused sigmoid focal loss (Apex's signature).

    Args:
        cls_output: logits ``(..., C)`` (fp16/bf16/fp32/fp64).
        cls_targets_at_level: ``cls_output.shape[:-1]`` integer class indices (``-1`` background, ``-2``
            ignored).
        num_positive_sum: one-element float tensor; the summed loss is divided by it.
        num_real_classes: classes ``>= num_real_classes`` are padding.
        alpha, gamma: focal-loss weights. label_smoothing: in ``[0, 1]``.

    Returns a 0-dim fp32 tensor, differentiable in ``cls_output``.
    """
    return _focal_loss(cls_output, cls_targets_at_level, num_positive_sum, num_real_classes, alpha, gamma,
                       label_smoothing)
