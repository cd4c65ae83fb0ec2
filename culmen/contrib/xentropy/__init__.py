"""``apex.contrib.xentropy``: ``SoftmaxCrossEntropyLoss``, fused softmax cross-entropy with label smoothing."""

from culmen.contrib.xentropy.softmax_xentropy import SoftmaxCrossEntropyLoss

__all__ = ["SoftmaxCrossEntropyLoss"]
