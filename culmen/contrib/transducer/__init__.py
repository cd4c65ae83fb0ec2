"""``apex.contrib.transducer``: the RNN-T joint (``TransducerJoint``) and loss (``TransducerLoss``) on
culmen's Triton kernels (``culmen.ops.transducer``), and ``TransducerProjectionLoss`` (a culmen addition: the
vocabulary projection fused with the loss, so the logits never exist whole)."""

from culmen.contrib.transducer import _transducer_ref
from culmen.contrib.transducer.projection import TransducerProjectionLoss
from culmen.contrib.transducer.transducer import TransducerJoint, TransducerLoss

__all__ = ["TransducerJoint", "TransducerLoss", "TransducerProjectionLoss", "_transducer_ref"]
