"""The RNN-T (transducer) joint and loss (Apex's ``contrib.transducer``) in Triton, with a PyTorch reference.

Layers (DESIGN.md): Triton kernels in ``kernels.py``; the cached call plans ``JointPlan`` / ``LossPlan``
(validation, tiles, bound launches) in ``launch.py``; the references (the CPU path and the tests'
oracles) in ``reference.py``; the entry points ``transducer_joint`` and ``rnnt_loss`` and their eager
autograd in ``op.py``; ``rnnt_projection_loss`` (a culmen addition: the vocabulary projection fused
with the loss, chunk by chunk, so the logits never exist whole) in ``projection.py``.
"""

from culmen.ops.transducer.op import rnnt_loss, transducer_joint
from culmen.ops.transducer.projection import rnnt_projection_loss
from culmen.ops.transducer.reference import rnnt_loss_ref

__all__ = ["rnnt_loss", "rnnt_loss_ref", "rnnt_projection_loss", "transducer_joint"]
