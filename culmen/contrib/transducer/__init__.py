"""``apex.contrib.transducer``: the RNN-T joint (``TransducerJoint``) and loss (``TransducerLoss``) on
culmen's Triton kernels (``culmen.ops.transducer``)."""

from culmen.contrib.transducer import _transducer_ref
from culmen.contrib.transducer.transducer import TransducerJoint, TransducerLoss

__all__ = ["TransducerJoint", "TransducerLoss", "_transducer_ref"]
