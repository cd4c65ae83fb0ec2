"""Rotary position embedding in Triton, with a PyTorch reference.

Layers (DESIGN.md): the Triton kernel in ``kernels.py``; the cached call plans ``RotaryPlan`` (forward
and backward: the backward is the conjugate rotation) in ``launch.py``; the oracle ``rotary_emb_ref``
and the CPU path ``rotary_fwd_ref`` in ``reference.py``; the op-level entry point ``rotary``, its eager
autograd and the ``triton_op``s ``culmen::rotary`` / ``culmen::rotary_`` in ``op.py``.
"""

from culmen.ops.rotary.op import LAYOUTS, rotary, rotary_planned
from culmen.ops.rotary.reference import rotary_emb_ref, rotate_half

__all__ = ["LAYOUTS", "rotary", "rotary_emb_ref", "rotary_planned", "rotate_half"]
