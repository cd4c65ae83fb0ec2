"""``apex.contrib.index_mul_2d.index_mul_2d`` on culmen's op (``culmen.ops.index_mul_2d``).

``index_mul_2d(in1, in2, idx1)`` is ``in1[idx1] * in2`` for 2-D ``in1`` ``(M, F)``, ``in2`` ``(N, F)`` and
1-D ``idx1`` ``(N,)``, differentiable twice. Apex accepts fp32/fp16 only; culmen also takes bf16 and
fp64, and padded rows.
"""

from __future__ import annotations

from torch import Tensor

from culmen.ops.index_mul_2d.op import index_mul_2d as _index_mul_2d
from culmen.ops.index_mul_2d.op import index_mul_2d_backward as _index_mul_2d_backward

__all__ = ["IndexMul2dBackward_", "IndexMul2d_", "index_mul_2d", "index_mul_2d_backward"]


class IndexMul2d_:  # Apex's name
    """Stand-in for Apex's autograd function: ``IndexMul2d_.apply(in1, in2, idx1)`` is ``index_mul_2d``."""

    @staticmethod
    def apply(in1: Tensor, in2: Tensor, idx1: Tensor) -> Tensor:
        return _index_mul_2d(in1, in2, idx1)


class IndexMul2dBackward_:  # Apex's name
    """Stand-in for Apex's autograd function: ``IndexMul2dBackward_.apply(in1, in2, idx1, grad_out)`` returns
    ``(grad_in1, grad_in2)``, itself differentiable."""

    @staticmethod
    def apply(in1: Tensor, in2: Tensor, idx1: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor]:
        return _index_mul_2d_backward(in1, in2, idx1, grad_out)


def index_mul_2d(in1: Tensor, in2: Tensor, idx1: Tensor) -> Tensor:
    """``in1[idx1] * in2``: ``(N, F)`` in the inputs' dtype, differentiable twice (see the module docstring)."""
    return _index_mul_2d(in1, in2, idx1)


def index_mul_2d_backward(in1: Tensor, in2: Tensor, idx1: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor]:
    """``(grad_in1, grad_in2)`` of ``index_mul_2d`` for ``grad_out``; differentiable."""
    return _index_mul_2d_backward(in1, in2, idx1, grad_out)
