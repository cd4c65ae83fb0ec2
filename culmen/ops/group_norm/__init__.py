"""GroupNorm (+ fused SiLU) for NCHW and channels-last inputs, in Triton, with a PyTorch reference.

Layers (DESIGN.md): Triton kernels in ``kernels.py``; the cached call plan ``GNPlan`` (validation, layout,
chunking, bound launches) in ``launch.py``; the reference ``group_norm_ref`` (and ``group_norm_fwd_ref`` /
``group_norm_bwd_ref``, the CPU path) in ``reference.py``; the entry point ``group_norm``, its autograd and
the ``torch.compile`` op ``culmen::group_norm_fwd`` in ``op.py``.
"""

from culmen.ops.group_norm.op import group_norm
from culmen.ops.group_norm.reference import group_norm_ref

__all__ = ["group_norm", "group_norm_ref"]
