"""Sigmoid focal loss (RetinaNet; Apex's ``contrib.focal_loss``) in Triton, with a PyTorch reference.

Layers (DESIGN.md): Triton kernels in ``kernels.py``; the cached call plan ``FocalPlan`` (validation,
conversions, tiles, bound launches) in ``launch.py``; the reference ``focal_loss_ref`` (and
``focal_loss_fwd_ref`` / ``focal_loss_bwd_ref``, the CPU path) in ``reference.py``; the entry point
``focal_loss``, its eager autograd and the ``torch.compile`` op ``culmen::focal_loss_fwd`` in ``op.py``.
"""

from culmen.ops.focal_loss.op import focal_loss
from culmen.ops.focal_loss.reference import focal_loss_ref

__all__ = ["focal_loss", "focal_loss_ref"]
