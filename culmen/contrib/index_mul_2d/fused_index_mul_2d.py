"""Apex's compiled ``fused_index_mul_2d`` module, in Python on culmen's kernels (for ``culmen.compat``).

Every function writes into the tensors it is given, as Apex's do: ``out`` / ``grad_in2`` /
``grad_grad_out`` are overwritten, ``grad_in1`` is accumulated into (Apex zero-fills it first and adds
atomically). The ``float_*`` and ``half_*`` variants are the same functions here (any float dtype).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.index_mul_2d.op import index_mul_2d, index_mul_2d_backward, index_mul_2d_backward_backward

__all__ = ["float_backward", "float_backward_backward", "float_forward", "half_backward", "half_backward_backward",
           "half_forward"]


def float_forward(out: Tensor, in1: Tensor, in2: Tensor, idx1: Tensor) -> None:
    """``out[:] = in1[idx1] * in2``."""
    with torch.no_grad():
        out.copy_(index_mul_2d(in1, in2, idx1))


def float_backward(grad_in1: Tensor, grad_in2: Tensor, grad_out: Tensor, in1: Tensor, in2: Tensor,
                   idx1: Tensor) -> None:
    """``grad_in1 += scatter(grad_out * in2)``, ``grad_in2[:] = grad_out * in1[idx1]``."""
    with torch.no_grad():
        g1, g2 = index_mul_2d_backward(in1, in2, idx1, grad_out)
        grad_in1.add_(g1)
        grad_in2.copy_(g2)


def float_backward_backward(grad_grad_out: Tensor, grad_in1: Tensor, grad_in2: Tensor, grad_out: Tensor,
                            grad_grad_in1: Tensor, grad_grad_in2: Tensor, in1: Tensor, in2: Tensor,
                            idx1: Tensor) -> None:
    """The double backward: ``grad_grad_out[:]``, ``grad_in1 +=``, ``grad_in2[:]`` (see ``culmen.ops.index_mul_2d``)."""
    ggo, g1, g2 = index_mul_2d_backward_backward(in1, in2, idx1, grad_out, grad_grad_in1, grad_grad_in2)
    with torch.no_grad():
        grad_grad_out.copy_(ggo)
        grad_in1.add_(g1)
        grad_in2.copy_(g2)


half_forward = float_forward
half_backward = float_backward
half_backward_backward = float_backward_backward
