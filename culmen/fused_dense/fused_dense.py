"""``apex.fused_dense``: ``FusedDense`` and ``FusedDenseGeluDense`` with their functionals.

The GEMMs are cuBLAS (``torch.addmm`` / ``mm``, bias in the cuBLASLt epilogue); GELU and its backward
are one Triton pass each, the backward one also reducing the first bias's gradient. GELU is the exact
(erf) form, which is what Apex's own test compares against (``F.gelu``).

Differences from Apex, on purpose: parameters are initialised like ``nn.Linear`` (Apex leaves them
uninitialised); inputs may have any leading shape ``(..., in_features)`` (Apex: 2-D); CPU tensors
work (reference path); ``bias=False`` in ``FusedDenseGeluDense`` raises ``ValueError`` (Apex asserts).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from culmen.normalization.fused_layer_norm import _autocast_off, _cast_if_autocast_enabled
from culmen.ops.activations.dense import (
    checked_linear,
    linear_act_linear,
    linear_act_linear_backward,
    linear_act_linear_forward,
    linear_backward,
    linear_forward,
)

__all__ = [
    "DenseNoBiasFunc",
    "FusedDense",
    "FusedDenseFunc",
    "FusedDenseGeluDense",
    "FusedDenseGeluDenseFunc",
    "dense_no_bias_function",
    "fused_dense_function",
    "fused_dense_gelu_dense_function",
]


class FusedDenseFunc(torch.autograd.Function):
    """Apex's ``FusedDenseFunc.apply(input, weight, bias)``: ``input @ weight^T + bias``."""

    @staticmethod
    def forward(ctx, input, weight, bias):
        return linear_forward(ctx, input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        return linear_backward(ctx, grad_output)


class DenseNoBiasFunc(torch.autograd.Function):
    """Apex's ``DenseNoBiasFunc.apply(input, weight)``: ``input @ weight^T``."""

    @staticmethod
    def forward(ctx, input, weight):
        return linear_forward(ctx, input, weight, None)

    @staticmethod
    def backward(ctx, grad_output):
        dx, dw, _ = linear_backward(ctx, grad_output)
        return dx, dw


class FusedDenseGeluDenseFunc(torch.autograd.Function):
    """Apex's ``FusedDenseGeluDenseFunc.apply(input, weight1, bias1, weight2, bias2)``:
    ``gelu(input @ weight1^T + bias1) @ weight2^T + bias2`` (exact GELU)."""

    @staticmethod
    def forward(ctx, input, weight1, bias1, weight2, bias2):
        return linear_act_linear_forward(ctx, None, input, weight1, bias1, weight2, bias2, "gelu", 0)

    @staticmethod
    def backward(ctx, grad_output):
        return linear_act_linear_backward(ctx, grad_output)


def _dense(input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Apex's ``amp.half_function`` behaviour around the checked linear: under autocast the tensors are
    cast to the autocast dtype and the op runs with autocast off."""
    device_type = input.device.type if isinstance(input, Tensor) else "cuda"
    if torch.is_autocast_enabled(device_type):
        input, weight, bias = _cast_if_autocast_enabled(device_type, input, weight, bias)
        with _autocast_off(device_type):
            return checked_linear(input, weight, bias)
    return checked_linear(input, weight, bias)


def fused_dense_function(input: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``input (..., in) @ weight (out, in)^T + bias (out,) -> (..., out)``, differentiable (``FusedDenseFunc``).
    The arguments are checked once per call signature."""
    return _dense(input, weight, bias)


def dense_no_bias_function(input: Tensor, weight: Tensor) -> Tensor:
    """``input (..., in) @ weight (out, in)^T -> (..., out)``, differentiable (``DenseNoBiasFunc``)."""
    return _dense(input, weight, None)


def fused_dense_gelu_dense_function(input: Tensor, weight1: Tensor, bias1: Tensor, weight2: Tensor, bias2: Tensor
                                    ) -> Tensor:
    """``gelu(input @ weight1^T + bias1) @ weight2^T + bias2``: ``input (..., in)``, ``weight1 (hid, in)``,
    ``weight2 (out, hid)`` -> ``(..., out)`` (exact GELU; ``FusedDenseGeluDenseFunc``)."""
    device_type = input.device.type if isinstance(input, Tensor) else "cuda"
    if torch.is_autocast_enabled(device_type):
        input, weight1, bias1, weight2, bias2 = _cast_if_autocast_enabled(device_type, input, weight1, bias1, weight2,
                                                                          bias2)
        with _autocast_off(device_type):
            return linear_act_linear(input, weight1, bias1, weight2, bias2, "gelu")
    return linear_act_linear(input, weight1, bias1, weight2, bias2, "gelu")


def _init_linear(weight: Tensor, bias: Tensor | None) -> None:
    # nn.Linear's init (Apex leaves the memory uninitialised).
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(weight.shape[1]) if weight.shape[1] > 0 else 0
        nn.init.uniform_(bias, -bound, bound)


class FusedDense(nn.Module):
    """Apex's ``FusedDense(in_features, out_features, bias=True)``: ``y = x @ weight^T + bias``.

    Input ``(..., in_features)``, output ``(..., out_features)``; parameters ``weight`` ``(out, in)``,
    ``bias`` ``(out,)`` (or ``None``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation."""
        _init_linear(self.weight, self.bias)

    def forward(self, input: Tensor) -> Tensor:
        if self.bias is not None:
            return fused_dense_function(input, self.weight, self.bias)
        return dense_no_bias_function(input, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class FusedDenseGeluDense(nn.Module):
    """Apex's ``FusedDenseGeluDense(in_features, intermediate_features, out_features, bias=True)``:
    ``gelu(x @ weight1^T + bias1) @ weight2^T + bias2`` (exact GELU).

    Input ``(..., in_features)``, output ``(..., out_features)``. ``bias`` must be True (as in Apex).
    """

    def __init__(self, in_features: int, intermediate_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        if not bias:
            raise ValueError("FusedDenseGeluDense without bias is not supported (bias=False), as in Apex")
        self.in_features = in_features
        self.intermediate_features = intermediate_features
        self.out_features = out_features
        self.weight1 = nn.Parameter(torch.empty(intermediate_features, in_features))
        self.bias1 = nn.Parameter(torch.empty(intermediate_features))
        self.weight2 = nn.Parameter(torch.empty(out_features, intermediate_features))
        self.bias2 = nn.Parameter(torch.empty(out_features))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation for both layers."""
        _init_linear(self.weight1, self.bias1)
        _init_linear(self.weight2, self.bias2)

    def forward(self, input: Tensor) -> Tensor:
        return fused_dense_gelu_dense_function(input, self.weight1, self.bias1, self.weight2, self.bias2)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, intermediate_features={self.intermediate_features}, "
                f"out_features={self.out_features}")
