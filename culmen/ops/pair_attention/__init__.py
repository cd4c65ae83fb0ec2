"""Attention with an additive pair bias and a logit mask (OpenFold's MSA and triangle attention; Apex's
``contrib.openfold_triton`` MHA) in Triton, forward and backward with the bias gradient.

Layers (DESIGN.md): Triton kernels in ``kernels.py``; the cached call plan ``PairAttnPlan`` in
``launch.py``; the reference ``pair_attention_ref`` (the CPU path and the tests' oracle) in
``reference.py``; the entry point ``pair_attention`` and its eager autograd in ``op.py``.
"""

from culmen.ops.pair_attention.op import pair_attention
from culmen.ops.pair_attention.reference import pair_attention_ref

__all__ = ["pair_attention", "pair_attention_ref"]
