"""(Synchronized) batch normalization in Triton, with a PyTorch reference.

Layers (DESIGN.md): Triton kernels in ``kernels.py``; the cached call plan ``BNPlan`` (validation,
layout, workspace, bound launches of the statistics / combine / normalize / backward kernels) in
``launch.py``; the references ``bn_*_ref`` and the oracle ``sync_batch_norm_ref`` in ``reference.py``; the
entry point ``sync_batch_norm``, its autograd (and Apex's ``SyncBatchNormFunction``) and the
``torch.compile`` op ``culmen::batch_norm_fwd`` in ``op.py``.
"""

from culmen.ops.batch_norm.op import SyncBatchNormFunction, sync_batch_norm
from culmen.ops.batch_norm.reference import sync_batch_norm_ref

__all__ = ["SyncBatchNormFunction", "sync_batch_norm", "sync_batch_norm_ref"]
