"""``apex.contrib.xentropy.softmax_xentropy``: ``SoftmaxCrossEntropyLoss.apply`` on culmen's op.

Apex semantics: per-token losses ``(1 - s) * CE + s * mean_j(-log p_j)``, rows whose label equals
``padding_idx`` get loss 0 and gradient 0, the loss is in the logits' dtype unless ``half_to_float``
(then fp32). Statistics are fp32 either way.

Differences from Apex: a label outside ``[0, V)`` other than ``padding_idx`` raises ``ValueError``
for CPU labels and gives a NaN loss row on the GPU (Apex computes a smoothing-only loss); the
incoming gradient is not modified in place (Apex masks it in place); ``(..., V)`` logits with
``(...)`` labels are accepted; it runs on CPU too.
"""

from __future__ import annotations

from torch import Tensor

from culmen.ops.cross_entropy import cross_entropy
from culmen.ops.cross_entropy.op import check_float

__all__ = ["SoftmaxCrossEntropyLoss", "softmax_cross_entropy"]


def softmax_cross_entropy(logits: Tensor, labels: Tensor, smoothing: float = 0.0, padding_idx: int = 0,
                          half_to_float: bool = False) -> Tensor:
    """Per-token label-smoothed cross-entropy of ``logits (..., V)`` and integer ``labels (...)``.

    Returns the losses with ``labels``' shape, in fp32 when ``half_to_float`` (or fp32 logits), else in
    the logits' dtype; differentiable w.r.t. ``logits``.
    """
    check_float("logits", logits)
    if logits.dim() < 1:
        raise ValueError("logits must have a class dimension (..., V)")
    lead = tuple(logits.shape[:-1])
    if not isinstance(labels, Tensor) or tuple(labels.shape) != lead:
        raise ValueError(f"labels must have shape {lead} (logits' without the class dim), got "
                         f"{tuple(getattr(labels, 'shape', ()))}")
    loss = cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), label_smoothing=smoothing,
                         ignore_index=padding_idx).loss.reshape(lead)
    return loss if half_to_float else loss.to(logits.dtype)


class SoftmaxCrossEntropyLoss:
    """Apex's autograd function: ``SoftmaxCrossEntropyLoss.apply(logits, labels, smoothing=0.0,
    padding_idx=0, half_to_float=False)`` returns per-token losses (padding rows 0)."""

    @staticmethod
    def apply(logits: Tensor, labels: Tensor, smoothing: float = 0.0, padding_idx: int = 0,
              half_to_float: bool = False) -> Tensor:
        """See ``softmax_cross_entropy``."""
        return softmax_cross_entropy(logits, labels, smoothing, padding_idx, half_to_float)
