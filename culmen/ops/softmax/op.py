"""Custom ops ``culmen::scaled_masked_softmax_fwd`` / ``_bwd``, their autograd, and the op-level entry
points: ``scaled_masked_softmax`` (differentiable) and ``softmax_forward`` / ``softmax_backward``
(the two halves, for Apex's extension-style API whose autograd lives in Python).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import choose_backend, register_op
from culmen.ops.softmax.reference import softmax_bwd_ref, softmax_fwd_ref

register_op("scaled_masked_softmax_fwd", "softmax", "softmax(x * scale) with a padding mask (-10000) and/or causal")
register_op("scaled_masked_softmax_bwd", "softmax", "backward of scaled_masked_softmax_fwd")

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fwd_impl(x: Tensor, mask: Tensor | None, scale: float, causal: bool) -> Tensor:
    if choose_backend(x.device) == "triton" and x.dtype != torch.float64 and x.numel() > 0:
        from culmen.ops.softmax.launch import softmax_fwd

        return softmax_fwd(x, mask, scale, causal)
    return softmax_fwd_ref(x, mask, scale, causal)


def _bwd_impl(dy: Tensor, y: Tensor, scale: float, causal: bool) -> Tensor:
    if choose_backend(dy.device) == "triton" and dy.dtype != torch.float64 and dy.numel() > 0:
        from culmen.ops.softmax.launch import softmax_bwd

        return softmax_bwd(dy, y, scale, causal)
    return softmax_bwd_ref(dy, y, scale, causal)


@torch.library.custom_op("culmen::scaled_masked_softmax_fwd", mutates_args=())
def softmax_fwd_op(x: Tensor, mask: Tensor | None, scale: float, causal: bool) -> Tensor:
    """``x`` ``(B, NP, SQ, SK)`` (unit column stride), ``mask`` uint8 expanded to x's shape or ``None``.
    Returns the probabilities ``(B, NP, SQ, SK)``, contiguous, in x's dtype."""
    return _fwd_impl(x, mask, scale, causal)


@softmax_fwd_op.register_fake
def _(x, mask, scale, causal):
    return x.new_empty(x.shape)


@torch.library.custom_op("culmen::scaled_masked_softmax_bwd", mutates_args=())
def softmax_bwd_op(dy: Tensor, y: Tensor, scale: float, causal: bool) -> Tensor:
    """Gradient of the scores' input: ``scale * y * (dy - sum(y * dy))``, contiguous, in dy's dtype."""
    return _bwd_impl(dy, y, scale, causal)


@softmax_bwd_op.register_fake
def _(dy, y, scale, causal):
    return dy.new_empty(dy.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale, ctx.causal = inputs[2], inputs[3]


def _backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return softmax_bwd_op(_unit_cols(dy), y, ctx.scale, ctx.causal), None, None, None


torch.library.register_autograd("culmen::scaled_masked_softmax_fwd", _backward, setup_context=_setup_context)


class _SoftmaxFn(torch.autograd.Function):
    """Eager path: the implementations called directly, without ``torch.library`` dispatch cost."""

    @staticmethod
    def forward(ctx, x, mask, scale, causal):
        y = _fwd_impl(x, mask, scale, causal)
        ctx.save_for_backward(y)
        ctx.scale, ctx.causal = scale, causal
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return _bwd_impl(_unit_cols(dy), y, ctx.scale, ctx.causal), None, None, None


def _unit_cols(t: Tensor) -> Tensor:
    """The kernels take any strides but the last (an expanded gradient has stride 0 there)."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _scale(scale: float | Tensor) -> float:
    if isinstance(scale, Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale must be a number or a one-element tensor, got shape {tuple(scale.shape)}")
        return float(scale.item())
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    return float(scale)


def _check_x(name: str, x: Tensor) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name} must be a floating-point tensor (float16/bfloat16/float32/float64), got {x.dtype}")
    if x.dim() != 4:
        raise ValueError(f"{name} must be 4-D (batch, heads, sq, sk), got shape {tuple(x.shape)}")
    return _unit_cols(x)


def prepare_mask(mask: Tensor | None, x: Tensor) -> Tensor | None:
    """``mask`` (bool/uint8, nonzero = masked, broadcastable to x) as a uint8 view expanded to x's shape."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(f"mask must be a bool or uint8 tensor, got {mask.dtype}")
    if mask.device != x.device:
        raise ValueError(f"mask is on {mask.device} but the input is on {x.device}")
    try:
        m = mask.expand(x.shape)
    except RuntimeError:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to the input's shape "
                         f"{tuple(x.shape)}") from None
    if m.dtype != torch.bool:
        return m
    if torch.compiler.is_compiling():  # inductor cannot lower a bool -> uint8 reinterpreting view
        return m.to(torch.uint8)
    return m.view(torch.uint8)


def softmax_forward(x: Tensor, mask: Tensor | None = None, scale: float | Tensor = 1.0,
                    causal: bool = False) -> Tensor:
    """Probabilities of ``scaled_masked_softmax`` without autograd (for Apex-style extension calls)."""
    x = _check_x("input", x)
    m = prepare_mask(mask, x)
    s = _scale(scale)
    if torch.compiler.is_compiling():
        return softmax_fwd_op(x, m, s, bool(causal))
    return _fwd_impl(x, m, s, bool(causal))


def softmax_backward(dy: Tensor, y: Tensor, scale: float | Tensor = 1.0, causal: bool = False) -> Tensor:
    """Input gradient of ``scaled_masked_softmax`` from the output gradient ``dy`` and the saved ``y``."""
    dy, y = _check_x("output_grads", dy), _check_x("softmax_results", y)
    if dy.shape != y.shape:
        raise ValueError(f"output_grads {tuple(dy.shape)} and softmax_results {tuple(y.shape)} must have one shape")
    s = _scale(scale)
    if torch.compiler.is_compiling():
        return softmax_bwd_op(dy, y, s, bool(causal))
    return _bwd_impl(dy, y, s, bool(causal))


def scaled_masked_softmax(x: Tensor, mask: Tensor | None = None, scale: float | Tensor = 1.0,
                          causal: bool = False) -> Tensor:
    """``softmax(where(mask, -10000, x * scale))`` over the last dim, fused; differentiable in ``x``.

    Args:
        x: ``(B, NP, SQ, SK)`` fp16/bf16/fp32/fp64 attention scores, any strides.
        mask: bool/uint8, broadcastable to ``x`` (e.g. ``(B, 1, SQ, SK)`` or ``(1, 1, SQ, SK)``),
            nonzero = masked: the element scores -10000 (Megatron). ``None``: no mask.
        scale: multiplies ``x`` before masking.
        causal: exclude columns past the row index (upper-triangular mask; probability 0).

    The softmax runs in fp32 for every SK (rows longer than registers take a chunked online kernel);
    the result is contiguous, in ``x``'s dtype. Rows with every element masked are all zeros.
    """
    x = _check_x("x", x)
    m = prepare_mask(mask, x)
    s = _scale(scale)
    if torch.compiler.is_compiling():
        return softmax_fwd_op(x, m, s, bool(causal))
    return _SoftmaxFn.apply(x, m, s, bool(causal))
