"""Fused (dropout + rowscale + x1 + residual) -> LayerNorm / RMSNorm, in Triton, with a PyTorch reference.

Layers (DESIGN.md): Triton kernels in ``kernels.py``; launchers ``layer_norm_fwd`` / ``layer_norm_bwd``
in ``launch.py``; the reference ``layer_norm_ref`` (and ``layer_norm_fwd_ref`` / ``layer_norm_bwd_ref``,
the CPU path) in ``reference.py``; custom ops ``culmen::layer_norm_fwd`` / ``culmen::layer_norm_bwd``
with autograd and the op-level entry point ``layer_norm`` in ``op.py``.
"""

from culmen.ops.layer_norm.op import LayerNormOutput, layer_norm
from culmen.ops.layer_norm.reference import layer_norm_ref

__all__ = ["LayerNormOutput", "layer_norm", "layer_norm_ref"]
