"""``apex.contrib.xentropy.softmax_xentropy``: ``SoftmaxCrossEntropyLoss.apply`` on culmen's op.

Apex semantics: per-token losses ``(1 - s) * CE + s * mean_j(-log p_j)``, rows whose label equals
``padding_idx`` get loss 0 and gradient 0, the loss is in the logits' dtype unless ``half_to_float``
(then fp32). Statistics are fp32 either way; the kernel writes the loss in its final dtype (no cast op).

Differences from Apex: a label outside ``[0, V)`` other than ``padding_idx`` raises ``ValueError``
for CPU labels and gives a NaN loss row on the GPU (Apex computes a smoothing-only loss); the
incoming gradient is not modified in place (Apex masks it in place); ``(..., V)`` logits with
``(...)`` labels are accepted; it runs on CPU too.
"""

from __future__ import annotations

from torch import Tensor

from culmen.ops.cross_entropy import cross_entropy
from culmen.ops.cross_entropy.launch import check_float

__all__ = ["SoftmaxCrossEntropyLoss", "softmax_cross_entropy"]


def softmax_cross_entropy(logits: Tensor, labels: Tensor, smoothing: float = 0.0, padding_idx: int = 0,
                          half_to_float: bool = False) -> Tensor:
    """Per-token label-smoothed cross-entropy of ``logits (..., V)`` and integer ``labels (...)``.

    Returns the losses with ``labels``' shape, in fp32 when ``half_to_float`` (or fp32 logits), else in
    the logits' dtype; differentiable w.r.t. ``logits``.
    """
    if not isinstance(logits, Tensor):
        check_float("logits", logits)  # raises; dtypes are checked by the op's plan
    dim = logits.dim()
    if dim < 1:
        raise ValueError("logits must have a class dimension (..., V)")
    lead = getattr(labels, "shape", None)
    if lead != logits.shape[:-1]:
        raise ValueError(f"labels must have shape {tuple(logits.shape[:-1])} (logits' without the class dim), got "
                         f"{tuple(lead or ())}")
    flat = dim != 2
    x, y = (logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)) if flat else (logits, labels)
    loss = cross_entropy(x, y, label_smoothing=smoothing, ignore_index=padding_idx,
                         out_dtype=None if half_to_float else logits.dtype).loss
    return loss.reshape(lead) if flat else loss


class SoftmaxCrossEntropyLoss:
    """Apex's autograd function: ``SoftmaxCrossEntropyLoss.apply(logits, labels, smoothing=0.0,
    padding_idx=0, half_to_float=False)`` returns per-token losses (padding rows 0)."""

    @staticmethod
    def apply(logits: Tensor, labels: Tensor, smoothing: float = 0.0, padding_idx: int = 0,
              half_to_float: bool = False) -> Tensor:
        """See ``softmax_cross_entropy``."""
        return softmax_cross_entropy(logits, labels, smoothing, padding_idx, half_to_float)
