"""The op-level entry points of the scaled (+ masked / causal) softmax: ``scaled_masked_softmax``
(differentiable) and ``softmax_forward`` / ``softmax_backward`` (the two halves, for Apex's
extension-style API whose autograd lives in Python), their eager autograd, and the ``torch.library``
ops ``culmen::scaled_masked_softmax_fwd`` / ``_bwd`` that ``torch.compile`` traces.

The call path (DESIGN.md): an eager call builds a key from its signature and looks up a cached
``SoftmaxPlan`` (validation ran when the plan was built); with autograd recording it goes through
``_SoftmaxFn`` (a plain ``autograd.Function``), otherwise straight to the plan. Under ``torch.compile``
the ops are ``triton_op``s whose bodies launch through ``wrap_triton``, so Inductor launches the kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import register_op
from culmen.ops.common.launch import traceable_kernels
from culmen.ops.softmax.launch import PLANS, SoftmaxBwdPlan, SoftmaxPlan

register_op("scaled_masked_softmax_fwd", "softmax", "softmax(x * scale) with a padding mask (-10000) and/or causal")
register_op("scaled_masked_softmax_bwd", "softmax", "backward of scaled_masked_softmax_fwd")


def as_scale(scale) -> float:
    """``scale`` as a Python float (a one-element tensor is read once: a device sync, as in Apex)."""
    if isinstance(scale, Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale must be a number or a one-element tensor, got shape {tuple(scale.shape)}")
        return float(scale.item())
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    return float(scale)


# ------------------------------------------------------------------------------------- eager


class _SoftmaxFn(torch.autograd.Function):
    """Eager autograd: the plan's kernels called directly (no ``torch.library`` dispatch)."""

    @staticmethod
    def forward(ctx, plan, x, mask, scale):
        y = plan.forward(x, mask, scale)
        ctx.save_for_backward(y)
        ctx.plan, ctx.scale = plan, scale
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return None, ctx.plan.backward(dy, y, ctx.scale), None, None


def fwd_plan(x: Tensor, mask: Tensor | None, causal: bool, dims: tuple[int, ...] = (4,), name: str = "x",
             check=None) -> SoftmaxPlan:
    """The cached forward plan of a call signature (built, and so checked, on first use). ``check(x, mask)``:
    an API layer's own checks, run when the plan is built (the cache keeps its plans apart)."""
    try:
        key = (dims, check, x.shape, x.stride(), x.dtype, x.device,
               None if mask is None else (mask.shape, mask.stride(), mask.dtype, mask.device), causal)
        plan = PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors: the plan names the problem
        key, plan = None, None
    if plan is None:
        if check is not None:
            check(x, mask)
        plan = SoftmaxPlan(x, mask, causal, dims, name)
        if key is not None:
            PLANS.put(key, plan)
    return plan


def bwd_plan(dy: Tensor, y: Tensor, causal: bool, check=None) -> SoftmaxBwdPlan:
    """The cached backward plan of a call signature; ``check(dy, y)`` as in ``fwd_plan``."""
    try:
        key = ("bwd", check, dy.shape, dy.stride(), dy.dtype, dy.device, y.shape, y.stride(), y.dtype, y.device,
               causal)
        plan = PLANS.get(key)
    except (AttributeError, TypeError):
        key, plan = None, None
    if plan is None:
        if check is not None:
            check(dy, y)
        plan = SoftmaxBwdPlan(dy, y, causal)
        if key is not None:
            PLANS.put(key, plan)
    return plan


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
    if torch.compiler.is_compiling():
        return softmax_fwd_op(x, mask, as_scale(scale), bool(causal))
    if type(scale) is not float:
        scale = as_scale(scale)
    try:
        key = ((4,), None, x.shape, x.stride(), x.dtype, x.device,
               None if mask is None else (mask.shape, mask.stride(), mask.dtype, mask.device), causal)
        plan = PLANS.get(key)
    except (AttributeError, TypeError):
        key, plan = None, None
    if plan is None:
        plan = fwd_plan(x, mask, causal)
    if x.requires_grad and torch.is_grad_enabled():
        return _SoftmaxFn.apply(plan, x, mask, scale)
    return plan.forward(x, mask, scale)


def softmax_forward(x: Tensor, mask: Tensor | None = None, scale: float | Tensor = 1.0,
                    causal: bool = False) -> Tensor:
    """Probabilities of ``scaled_masked_softmax`` without autograd (for Apex-style extension calls);
    ``x`` may also be 3-D ``(attn_batches, SQ, SK)``."""
    if type(scale) is not float:
        scale = as_scale(scale)
    if torch.compiler.is_compiling():
        return softmax_fwd_op(x, mask, scale, bool(causal))
    return fwd_plan(x, mask, causal, (3, 4), "input").forward(x, mask, scale)


def softmax_backward(dy: Tensor, y: Tensor, scale: float | Tensor = 1.0, causal: bool = False) -> Tensor:
    """Input gradient of ``scaled_masked_softmax`` from the output gradient ``dy`` and the saved ``y``
    (3-D or 4-D, one shape)."""
    if type(scale) is not float:
        scale = as_scale(scale)
    if torch.compiler.is_compiling():
        return softmax_bwd_op(dy, y, scale, bool(causal))
    return bwd_plan(dy, y, causal).backward(dy, y, scale)


# -------------------------------------------------------------------------- torch.compile


@torch.library.triton_op("culmen::scaled_masked_softmax_fwd", mutates_args=())
def softmax_fwd_op(x: Tensor, mask: Tensor | None, scale: float, causal: bool) -> Tensor:
    """Forward for ``torch.compile``: ``x`` ``(B, NP, SQ, SK)`` or ``(A, SQ, SK)``, ``mask`` bool/uint8
    broadcastable to x or ``None``. Returns the probabilities, contiguous, in x's dtype."""
    plan = SoftmaxPlan(x, mask, causal, (3, 4))
    plan.use_kernel = plan.use_kernel and traceable_kernels()  # the interpreter cannot be traced: reference
    return plan.forward(x, mask, scale, traced=True)


@torch.library.triton_op("culmen::scaled_masked_softmax_bwd", mutates_args=())
def softmax_bwd_op(dy: Tensor, y: Tensor, scale: float, causal: bool) -> Tensor:
    """Gradient of the scores' input: ``scale * y * (dy - sum(y * dy))``, contiguous, in dy's dtype."""
    plan = SoftmaxBwdPlan(dy, y, causal)
    plan.use_kernel = plan.use_kernel and traceable_kernels()
    return plan.backward(dy, y, scale, traced=True)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale, ctx.causal = inputs[2], inputs[3]


def _compiled_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return softmax_bwd_op(dy, y, ctx.scale, ctx.causal), None, None, None


torch.library.register_autograd("culmen::scaled_masked_softmax_fwd", _compiled_backward, setup_context=_setup_context)
