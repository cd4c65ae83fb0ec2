"""``flash_attn.ops.activations`` on culmen: bias-GELU, tanh GELU, (squared) ReLU and SwiGLU, each a
single Triton pass forward and backward (fp32 math, results in the input's dtype).

Same names and argument orders as flash_attn (note ``swiglu_bwd(x, y, g)`` but ``gelu_bwd(g, x)``).
GELU here is flash_attn's tanh approximation; ``bias_gelu_erf_impl`` (exact GELU) and ``geglu`` are
culmen additions. Every function is a thin call of ``culmen.ops.activations`` (cached call plans: the
arguments are checked once per call signature). ``swiglu`` on the two halves of one tensor
(``h.chunk(2, -1)``) reads them in place and returns the gradient of ``h`` as one buffer (see
``culmen.ops.activations.op``).

Differences, on purpose: ``bias_gelu_back`` reduces the bias gradient over every leading dim
(flash_attn sums dim 0 only, which is wrong for 3-D input); the ``*_fwd`` functions are
differentiable (their autograd uses the fused backward), the ``*_bwd`` ones are not (flash_attn's,
being plain PyTorch expressions, could be differentiated twice); ``bias_gelu_impl``, ``fast_gelu_impl``
and ``swiglu`` are functions with the ``apply`` signatures of the autograd functions they name.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.activations import act_bwd, act_fwd, bias_act, gated_act, glu_bwd, glu_fwd

__all__ = [
    "FastGeLUFunction",
    "GeLUFunction",
    "SwiGLUFunction",
    "bias_gelu",
    "bias_gelu_back",
    "bias_gelu_erf_impl",
    "bias_gelu_impl",
    "fast_gelu_impl",
    "geglu",
    "gelu_bwd",
    "gelu_fwd",
    "relu_bwd",
    "sqrelu_bwd",
    "sqrelu_fwd",
    "swiglu",
    "swiglu_bwd",
    "swiglu_fwd",
    "swish",
]


def swish(x: Tensor) -> Tensor:
    """``silu(x)`` (flash_attn's older ``swish``), differentiable."""
    return bias_act(x, None, "silu")


def bias_gelu(y: Tensor, bias: Tensor) -> Tensor:
    """tanh-GELU of ``y + bias``: ``y`` ``(..., D)``, ``bias`` ``(D,)``; result in ``y``'s dtype (differentiable)."""
    return bias_act(y, bias, "gelu_tanh")


def bias_gelu_back(g: Tensor, y: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """``(grad_y, grad_bias)`` of ``bias_gelu`` for output gradient ``g``: ``grad_y`` in ``y``'s dtype,
    ``grad_bias`` ``(D,)`` in ``bias``'s dtype (fp32 accumulation), from one fused pass."""
    dx, db, _ = act_bwd(g, y, bias, "gelu_tanh", dbias_dtype=bias.dtype if bias is not None else y.dtype)
    return dx, db


class GeLUFunction(torch.autograd.Function):
    """``bias_gelu`` as an autograd function: ``apply(input, bias)`` (``bias`` may be ``None``)."""

    @staticmethod
    def forward(ctx, input, bias):
        ctx.save_for_backward(input, bias)
        return act_fwd(input, bias, "gelu_tanh")

    @staticmethod
    def backward(ctx, grad_output):
        input, bias = ctx.saved_tensors
        want_db = bias is not None and ctx.needs_input_grad[1]
        dx, db, _ = act_bwd(grad_output, input, bias, "gelu_tanh", dbias_dtype=bias.dtype if want_db else None)
        return dx, db


def bias_gelu_impl(input: Tensor, bias: Tensor | None) -> Tensor:
    """``GeLUFunction.apply(input, bias)``: differentiable tanh-GELU of ``input + bias``."""
    return bias_act(input, bias, "gelu_tanh")


def bias_gelu_erf_impl(input: Tensor, bias: Tensor | None = None) -> Tensor:
    """Exact (erf) GELU of ``input + bias``, differentiable (culmen addition)."""
    return bias_act(input, bias, "gelu")


def gelu_fwd(x: Tensor) -> Tensor:
    """tanh-GELU of ``x`` in ``x``'s dtype (differentiable)."""
    return bias_act(x, None, "gelu_tanh")


def gelu_bwd(g: Tensor, x: Tensor) -> Tensor:
    """``g * gelu_tanh'(x)`` in ``x``'s dtype."""
    return act_bwd(g, x, None, "gelu_tanh")[0]


class FastGeLUFunction(torch.autograd.Function):
    """tanh-GELU as an autograd function: ``apply(input)``."""

    @staticmethod
    def forward(ctx, input):
        ctx.save_for_backward(input)
        return act_fwd(input, None, "gelu_tanh")

    @staticmethod
    def backward(ctx, grad_output):
        (input,) = ctx.saved_tensors
        return act_bwd(grad_output, input, None, "gelu_tanh")[0]


def fast_gelu_impl(input: Tensor) -> Tensor:
    """``FastGeLUFunction.apply(input)``: differentiable tanh-GELU."""
    return bias_act(input, None, "gelu_tanh")


def relu_bwd(g: Tensor, x: Tensor) -> Tensor:
    """``g`` where ``x >= 0``, else 0 (flash_attn's convention: the derivative at 0 is 1), in ``x``'s dtype."""
    return act_bwd(g, x, None, "relu_ge0")[0]


def sqrelu_fwd(x: Tensor) -> Tensor:
    """``relu(x)^2`` in ``x``'s dtype (differentiable)."""
    return bias_act(x, None, "sqrelu")


def sqrelu_bwd(g: Tensor, x: Tensor) -> Tensor:
    """``2 * g * relu(x)`` in ``x``'s dtype."""
    return act_bwd(g, x, None, "sqrelu")[0]


def swiglu_fwd(x: Tensor, y: Tensor) -> Tensor:
    """``silu(x) * y`` in ``x``'s dtype (differentiable)."""
    return gated_act(x, y, "silu")


def swiglu_bwd(x: Tensor, y: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """``(dx, dy)`` of ``silu(x) * y`` for output gradient ``g`` (note the argument order)."""
    return glu_bwd(g, x, y, "silu")


class SwiGLUFunction(torch.autograd.Function):
    """``silu(x) * y`` as an autograd function: ``apply(x, y)``."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return glu_fwd(x, y, "silu")

    @staticmethod
    def backward(ctx, dout):
        x, y = ctx.saved_tensors
        return glu_bwd(dout, x, y, "silu")


def swiglu(x: Tensor, y: Tensor) -> Tensor:
    """``SwiGLUFunction.apply(x, y)``: differentiable ``silu(x) * y`` (``x``, ``y`` ``(..., N)`` of one shape,
    any strides; a contiguous result in ``x``'s dtype)."""
    return gated_act(x, y, "silu")


def geglu(x: Tensor, y: Tensor, approximate: str = "tanh") -> Tensor:
    """``gelu(x) * y`` (culmen addition; ``approximate`` ``"tanh"`` or ``"none"`` as in ``F.gelu``)."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return gated_act(x, y, "gelu_tanh" if approximate == "tanh" else "gelu")
