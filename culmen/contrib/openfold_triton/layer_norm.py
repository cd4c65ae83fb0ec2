"""``apex.contrib.openfold_triton.layer_norm``: ``LayerNormSmallShapeOptImpl``, LayerNorm for OpenFold's
small hidden sizes, on culmen's fused LayerNorm op (``culmen.ops.layer_norm``).

Apex's version is a hand-tuned Triton kernel pair for contiguous inputs and 4-d strided ones with the
last dim normalized. culmen's op takes any layout, any hidden size, and ``normalized_shape`` over several
trailing dims (the input is viewed as ``(rows, prod(normalized_shape))``).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

import torch
from torch import Tensor

from culmen.ops.layer_norm import layer_norm

__all__ = ["LayerNormSmallShapeOptImpl"]


def _layer_norm(inputs: Tensor, normalized_shape: Sequence[int] | int, weight: Tensor | None,
                bias: Tensor | None, eps: float) -> Tensor:
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    shape = tuple(int(s) for s in normalized_shape)
    if not isinstance(inputs, Tensor):
        raise TypeError(f"LayerNormSmallShapeOptImpl: inputs must be a tensor, got {type(inputs).__name__}")
    nd = len(shape)
    if nd == 0 or tuple(inputs.shape[inputs.dim() - nd:]) != shape or inputs.dim() < nd:
        raise ValueError(f"LayerNormSmallShapeOptImpl: normalized_shape {shape} must be the trailing dims of "
                         f"inputs {tuple(inputs.shape)}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != shape:
            raise ValueError(f"LayerNormSmallShapeOptImpl: {name} must have shape {shape}, got {tuple(p.shape)}")
    n = prod(shape)
    x = inputs if nd == 1 else inputs.reshape(*inputs.shape[:inputs.dim() - nd], n)
    w = None if weight is None else weight.reshape(n)
    b = None if bias is None else bias.reshape(n)
    y = layer_norm(x, w, b, eps=eps).y
    return y if nd == 1 else y.view(inputs.shape)


class LayerNormSmallShapeOptImpl(torch.autograd.Function):
    """LayerNorm over ``normalized_shape`` (the trailing dims of ``inputs``), used as Apex's is:
    ``LayerNormSmallShapeOptImpl.apply(inputs, normalized_shape, weight, bias, eps=1e-5)``.

    Args:
        inputs: ``(..., *normalized_shape)`` fp16/bf16/fp32/fp64, any layout.
        normalized_shape: the normalized trailing dims (a sequence or an int).
        weight, bias: ``normalized_shape`` tensors (or ``None``).
        eps: added to the variance.

    Returns ``inputs``' shape and dtype; differentiable in ``inputs``, ``weight`` and ``bias``. Statistics
    are fp32. ``apply`` runs culmen's fused norm op, whose own autograd node computes the gradients, so
    this class needs no ``forward`` / ``backward`` of its own.
    """

    @classmethod
    def apply(cls, inputs: Tensor, normalized_shape: Sequence[int] | int, weight: Tensor | None,
              bias: Tensor | None, eps: float = 1e-5) -> Tensor:
        return _layer_norm(inputs, normalized_shape, weight, bias, eps)
