"""Fused bias + activation and gated activations, in Triton, with a PyTorch reference.

Layers (DESIGN.md): Triton kernels in ``kernels.py``; the cached call plans (validation, geometry,
allocation, bound launches) in ``launch.py``; references in ``reference.py``; the entry points
``bias_act`` / ``gated_act`` / ``act_fwd`` / ``act_bwd`` / ``glu_fwd`` / ``glu_bwd``, their eager autograd
and the ``torch.compile`` ops ``culmen::act_fwd`` / ``act_bwd`` / ``glu_fwd`` / ``glu_bwd`` in ``op.py``; the
cuBLAS + fused-epilogue dense compositions (linear+bias, linear-act-linear, MLP stacks) in ``dense.py``.

Eager autograd of ``bias_act`` with ReLU saves a 1-bit-per-element mask instead of the input, so its
fwd+bwd moves 4.125 tensor-sized passes instead of 5 (and keeps 1/16 of a bf16 input alive); every
bias gradient is reduced in the same pass as ``dx`` (deterministic fixed-order partial sums).
"""

from culmen.ops.activations.op import (
    ACTIVATIONS,
    FROM_OUTPUT_ACTIVATIONS,
    GATED_ACTIVATIONS,
    act_bwd,
    act_fwd,
    bias_act,
    check_activation,
    gated_act,
    glu_bwd,
    glu_fwd,
)
from culmen.ops.activations.reference import act_grad_ref, act_ref, glu_ref

__all__ = [
    "ACTIVATIONS",
    "FROM_OUTPUT_ACTIVATIONS",
    "GATED_ACTIVATIONS",
    "act_bwd",
    "act_fwd",
    "act_grad_ref",
    "act_ref",
    "bias_act",
    "check_activation",
    "gated_act",
    "glu_bwd",
    "glu_fwd",
    "glu_ref",
]
