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
    check_layers,
    linear_act_linear_backward,
    linear_act_linear_forward,
    linear_backward,
    linear_forward,
)
from culmen.ops.activations.op import apply_function, raw_apply

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
        return linear_act_linear_forward(ctx, input, weight1, bias1, weight2, bias2, "gelu", 0)

    @staticmethod
    def backward(ctx, grad_output):
        return linear_act_linear_backward(ctx, grad_output)[:5]


def _half_function(fn):
    """Apex's ``amp.half_function``: under autocast, cast the tensors to the autocast dtype and run with
    autocast off."""

    def wrapped(*args):
        device_type = args[0].device.type if isinstance(args[0], Tensor) else "cuda"
        args = _cast_if_autocast_enabled(device_type, *args)
        with _autocast_off(device_type):
            return fn(*args)

    wrapped.__name__ = getattr(fn, "__name__", "function")
    return wrapped


# C-level ``apply`` of each function (skips ``Function.apply``'s Python wrapper in eager mode).
_DENSE_APPLY = raw_apply(FusedDenseFunc)
_NO_BIAS_APPLY = raw_apply(DenseNoBiasFunc)
_GELU_DENSE_APPLY = raw_apply(FusedDenseGeluDenseFunc)


def _fused_dense(input: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    check_layers(input, [("weight", weight, bias)])
    return apply_function(FusedDenseFunc, _DENSE_APPLY, input, weight, bias)


def _dense_no_bias(input: Tensor, weight: Tensor) -> Tensor:
    check_layers(input, [("weight", weight, None)])
    return apply_function(DenseNoBiasFunc, _NO_BIAS_APPLY, input, weight)


def _fused_dense_gelu_dense(input: Tensor, weight1: Tensor, bias1: Tensor, weight2: Tensor, bias2: Tensor) -> Tensor:
    check_layers(input, [("weight1", weight1, bias1), ("weight2", weight2, bias2)])
    return apply_function(FusedDenseGeluDenseFunc, _GELU_DENSE_APPLY, input, weight1, bias1, weight2,
                          bias2)


fused_dense_function = _half_function(_fused_dense)
"""``fused_dense_function(input (..., in), weight (out, in), bias (out,)) -> (..., out)``."""
dense_no_bias_function = _half_function(_dense_no_bias)
"""``dense_no_bias_function(input (..., in), weight (out, in)) -> (..., out)``."""
fused_dense_gelu_dense_function = _half_function(_fused_dense_gelu_dense)
"""``fused_dense_gelu_dense_function(input, weight1 (hid, in), bias1, weight2 (out, hid), bias2) -> (..., out)``."""


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
