"""Rotary position embedding in Triton, with a PyTorch reference.

Layers (DESIGN.md): the Triton kernel in ``kernels.py``; the launcher ``rotary_fwd`` in ``launch.py``
(forward and backward: the backward is the conjugate rotation); the oracle ``rotary_emb_ref`` and the
CPU path ``rotary_fwd_ref`` in ``reference.py``; custom ops ``culmen::rotary`` / ``culmen::rotary_``
with autograd and the op-level entry point ``rotary`` in ``op.py``.
"""

from culmen.ops.rotary.op import LAYOUTS, rotary
from culmen.ops.rotary.reference import rotary_emb_ref, rotate_half

__all__ = ["LAYOUTS", "rotary", "rotary_emb_ref", "rotate_half"]
