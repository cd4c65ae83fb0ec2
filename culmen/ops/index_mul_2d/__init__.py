"""``index_mul_2d`` (Apex's ``contrib.index_mul_2d``): ``in1[idx] * in2`` with backward and double backward.

Layers (DESIGN.md): Triton kernels in ``kernels.py``; the cached call plan ``IndexMulPlan`` (validation,
conversions, blocks, bound launches) in ``launch.py``; the reference ``index_mul_2d_ref`` (and the
CPU-path functions) in ``reference.py``; the entry point ``index_mul_2d``, its eager autograd and the
``torch.compile`` op ``culmen::index_mul_2d_fwd`` in ``op.py``.
"""

from culmen.ops.index_mul_2d.op import index_mul_2d
from culmen.ops.index_mul_2d.reference import index_mul_2d_ref

__all__ = ["index_mul_2d", "index_mul_2d_ref"]
