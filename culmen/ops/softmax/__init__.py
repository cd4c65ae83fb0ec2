"""Scaled (+ masked / causal) softmax over the last dim in Triton, for every row length, with a PyTorch
reference.

Layers (DESIGN.md): Triton kernels in ``kernels.py``; the cached call plans ``SoftmaxPlan`` /
``SoftmaxBwdPlan`` in ``launch.py``; the oracle ``scaled_masked_softmax_ref`` and the CPU path in
``reference.py``; the op-level entry points ``scaled_masked_softmax``, ``softmax_forward``,
``softmax_backward``, their eager autograd and the ``triton_op``s ``culmen::scaled_masked_softmax_fwd`` /
``_bwd`` in ``op.py``.
"""

from culmen.ops.softmax.op import scaled_masked_softmax, softmax_backward, softmax_forward
from culmen.ops.softmax.reference import MASK_VALUE, scaled_masked_softmax_ref

__all__ = [
    "MASK_VALUE",
    "scaled_masked_softmax",
    "scaled_masked_softmax_ref",
    "softmax_backward",
    "softmax_forward",
]
