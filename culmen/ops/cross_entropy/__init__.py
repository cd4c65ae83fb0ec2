"""Softmax cross-entropy (online softmax over the vocab, fp32 statistics) and fused linear + cross-entropy.

Layers (DESIGN.md): Triton kernels in ``kernels.py`` (and the strided ones of the fused linear path in
``vocab_major.py``); the cached call plan ``CEPlan`` (checks, geometry, bound launches) in ``launch.py``;
the reference ``cross_entropy_ref`` (and the CPU path ``cross_entropy_fwd_ref`` / ``cross_entropy_bwd_ref``,
the oracle ``fused_linear_cross_entropy_ref``) in ``reference.py``; the entry point ``cross_entropy``, its
autograd, the vocab-parallel path and the ``triton_op`` ``culmen::cross_entropy`` in ``op.py``;
``fused_linear_cross_entropy`` with its plan ``FLCEPlan`` in ``fused_linear.py`` / ``fused_linear_plan.py``.
The APIs: ``culmen.flash_attn.losses.cross_entropy``, ``culmen.flash_attn.ops.triton.cross_entropy`` and
``culmen.contrib.xentropy``.
"""

from culmen.ops.cross_entropy.fused_linear import fused_linear_cross_entropy
from culmen.ops.cross_entropy.op import CrossEntropyOutput, cross_entropy
from culmen.ops.cross_entropy.reference import cross_entropy_ref, fused_linear_cross_entropy_ref

__all__ = [
    "CrossEntropyOutput",
    "cross_entropy",
    "cross_entropy_ref",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_ref",
]
