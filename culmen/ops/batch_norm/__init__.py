"""(Synchronized) batch normalization in Triton, with a PyTorch reference.

Layers (DESIGN.md): Triton kernels in ``kernels.py``; launchers ``bn_stats`` / ``bn_combine`` /
``bn_fwd`` / ``bn_bwd_reduce`` / ``bn_bwd`` in ``launch.py``; their references ``bn_*_ref`` and the
oracle ``sync_batch_norm_ref`` in ``reference.py``; the custom ops ``culmen::batch_norm_*``, the
autograd ``SyncBatchNormFunction`` and the op-level entry point ``sync_batch_norm`` in ``op.py``.
"""

from culmen.ops.batch_norm.op import SyncBatchNormFunction, sync_batch_norm
from culmen.ops.batch_norm.reference import sync_batch_norm_ref

__all__ = ["SyncBatchNormFunction", "sync_batch_norm", "sync_batch_norm_ref"]
