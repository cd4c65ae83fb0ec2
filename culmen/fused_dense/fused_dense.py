"""``apex.fused_dense``: ``FusedDense`` and ``FusedDenseGeluDense`` with their functionals.

The GEMMs are cuBLAS; GELU and its backward are one Triton pass each, the backward one also reducing the
first bias's gradient. GELU is the exact (erf) form, which is what Apex's own test compares against
(``F.gelu``).

``FusedDense`` (and ``FusedDenseGeluDense``, for both of its GEMMs) rounds like Apex's:
``y = (x @ W^T) + b`` with the GEMM's result rounded to the input dtype *before* the bias is added (then
rounded again), which is what Apex's test compares against (``torch.matmul(x, W.t()) + b``) to 1e-3. A
bias added inside the GEMM's epilogue rounds once: in bf16 that moves ~1 in 4 outputs by one ulp (up to
4e-3 relative), outside Apex's tolerance. In fp32 both are the same.

Differences from Apex, on purpose: parameters are initialised like ``nn.Linear`` (Apex leaves them
uninitialised); inputs may have any leading shape ``(..., in_features)`` (Apex: 2-D); CPU tensors
work (reference path); ``bias=False`` in ``FusedDenseGeluDense`` raises ``ValueError`` (Apex asserts).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from culmen.normalization.fused_layer_norm import _autocast_off, _cast_if_autocast_enabled
from culmen.ops.activations.dense import (
    DensePlan,
    _act,
    check_layers,
    checked_linear,
    dense_plan,
    linear_act_linear,
    linear_act_linear_backward,
    linear_backward,
    linear_forward,
)
from culmen.ops.common.function import raw_apply

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
    """Apex's ``FusedDenseFunc.apply(input, weight, bias)``: ``input @ weight^T + bias``, the product rounded
    to ``input``'s dtype before the bias is added (Apex's numerics, see the module docstring)."""

    @staticmethod
    def forward(ctx, input, weight, bias):
        y = linear_forward(ctx, input, weight, None)
        ctx.has_bias = bias is not None
        return y if bias is None else y.add_(bias)  # y is the GEMM's fresh output: added in place

    @staticmethod
    def backward(ctx, grad_output):
        return linear_backward(ctx, grad_output)


_DENSE_APPLY = raw_apply(FusedDenseFunc)


def _checked_dense(input: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``FusedDenseFunc`` with ``check_layers``' checks, run once per call signature (as ``checked_linear``)."""
    try:
        key = ("fused_dense", input.shape, input.dtype, input.device, weight.shape, weight.dtype, weight.device,
               bias.shape, bias.dtype, bias.device)
    except AttributeError:
        key = None
    dense_plan(key, "none", lambda: check_layers(input, [("weight", weight, bias)], "input"))
    return _DENSE_APPLY(input, weight, bias)


class DenseNoBiasFunc(torch.autograd.Function):
    """Apex's ``DenseNoBiasFunc.apply(input, weight)``: ``input @ weight^T``."""

    @staticmethod
    def forward(ctx, input, weight):
        return linear_forward(ctx, input, weight, None)

    @staticmethod
    def backward(ctx, grad_output):
        dx, dw, _ = linear_backward(ctx, grad_output)
        return dx, dw


def _dense_gelu_dense_forward(ctx, plan: DensePlan | None, two_d: bool, x: Tensor, w1: Tensor, b1: Tensor,
                              w2: Tensor, b2: Tensor) -> Tensor:
    """``gelu(x @ w1^T + b1) @ w2^T + b2`` rounded as Apex's reference: each GEMM's product is rounded to the
    input dtype before its bias is added, GELU reads the rounded pre-activation. Saves what
    ``linear_act_linear_backward`` reads (the layout of ``linear_act_linear_forward`` at checkpoint level 0).
    ``two_d``: ``x`` is 2-D (known from the call signature, so the cached path asks nothing)."""
    x2 = x if two_d else x.reshape(-1, x.shape[-1])
    pre = F.linear(x2, w1).add_(b1)  # (F.linear without bias: the plain GEMM, one call)
    out1 = _act(plan, 0, pre, "gelu", False)
    out2 = F.linear(out1, w2).add_(b2)
    ctx.save_for_backward(x2, w1, b1, w2, pre, out1)
    ctx.state = (plan, "gelu", x.shape, True, True)
    return out2 if two_d else out2.view(*x.shape[:-1], out2.shape[-1])


class FusedDenseGeluDenseFunc(torch.autograd.Function):
    """Apex's ``FusedDenseGeluDenseFunc.apply(input, weight1, bias1, weight2, bias2)``:
    ``gelu(input @ weight1^T + bias1) @ weight2^T + bias2`` (exact GELU; products rounded before the bias
    adds, as Apex's reference)."""

    @staticmethod
    def forward(ctx, input, weight1, bias1, weight2, bias2):
        return _dense_gelu_dense_forward(ctx, None, input.dim() == 2, input, weight1, bias1, weight2, bias2)

    @staticmethod
    def backward(ctx, grad_output):
        return linear_act_linear_backward(ctx, grad_output)


class _DenseGeluDensePlanned(torch.autograd.Function):
    """``FusedDenseGeluDenseFunc`` with the call's cached activation plans (eager mode)."""

    @staticmethod
    def forward(ctx, plan, two_d, input, weight1, bias1, weight2, bias2):
        return _dense_gelu_dense_forward(ctx, plan, two_d, input, weight1, bias1, weight2, bias2)

    @staticmethod
    def backward(ctx, grad_output):
        return (None, None, *linear_act_linear_backward(ctx, grad_output, 2))


_DGD_APPLY = raw_apply(_DenseGeluDensePlanned)


def _dense_gelu_dense(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """The checked, planned ``FusedDenseGeluDenseFunc`` (arguments checked once per call signature)."""
    names = ("weight1", "weight2")
    if torch.compiler.is_compiling():
        check_layers(x, [(names[0], w1, b1), (names[1], w2, b2)], "input")
        return FusedDenseGeluDenseFunc.apply(x, w1, b1, w2, b2)
    try:
        key = ("fused_dense_gelu_dense", x.shape, x.dtype, x.device, w1.shape, w1.dtype, w1.device, b1.shape,
               b1.dtype, b1.device, w2.shape, w2.dtype, w2.device, b2.shape, b2.dtype, b2.device)
    except AttributeError:
        key = None
    plan = dense_plan(key, "gelu", lambda: check_layers(x, [(names[0], w1, b1), (names[1], w2, b2)], "input"))
    return _DGD_APPLY(plan, len(key[1]) == 2 if key is not None else x.dim() == 2, x, w1, b1, w2, b2)


def _dense(input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Apex's ``amp.half_function`` behaviour around the checked linear: under autocast the tensors are
    cast to the autocast dtype and the op runs with autocast off."""
    device_type = input.device.type if isinstance(input, Tensor) else "cuda"
    fn = checked_linear if bias is None else _checked_dense
    if torch.is_autocast_enabled(device_type):
        input, weight, bias = _cast_if_autocast_enabled(device_type, input, weight, bias)
        with _autocast_off(device_type):
            return fn(input, weight, bias)
    return fn(input, weight, bias)


def fused_dense_function(input: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``input (..., in) @ weight (out, in)^T + bias (out,) -> (..., out)``, differentiable (``FusedDenseFunc``;
    the product is rounded to the input dtype before the bias add, as Apex). Checked once per call signature."""
    return _dense(input, weight, bias)


def dense_no_bias_function(input: Tensor, weight: Tensor) -> Tensor:
    """``input (..., in) @ weight (out, in)^T -> (..., out)``, differentiable (``DenseNoBiasFunc``)."""
    return _dense(input, weight, None)


def fused_dense_gelu_dense_function(input: Tensor, weight1: Tensor, bias1: Tensor, weight2: Tensor, bias2: Tensor
                                    ) -> Tensor:
    """``gelu(input @ weight1^T + bias1) @ weight2^T + bias2``: ``input (..., in)``, ``weight1 (hid, in)``,
    ``weight2 (out, hid)`` -> ``(..., out)`` (exact GELU; ``FusedDenseGeluDenseFunc``'s rounding)."""
    device_type = input.device.type if isinstance(input, Tensor) else "cuda"
    if torch.is_autocast_enabled(device_type):
        input, weight1, bias1, weight2, bias2 = _cast_if_autocast_enabled(device_type, input, weight1, bias1, weight2,
                                                                          bias2)
        with _autocast_off(device_type):
            return _gelu_dense(input, weight1, bias1, weight2, bias2)
    return _gelu_dense(input, weight1, bias1, weight2, bias2)


def _gelu_dense(input: Tensor, weight1: Tensor, bias1: Tensor | None, weight2: Tensor, bias2: Tensor | None
                ) -> Tensor:
    if bias1 is None or bias2 is None:  # not Apex's case (it requires both biases): the epilogue path
        return linear_act_linear(input, weight1, bias1, weight2, bias2, "gelu")
    return _dense_gelu_dense(input, weight1, bias1, weight2, bias2)


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
