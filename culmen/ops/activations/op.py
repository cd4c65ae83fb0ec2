"""The op-level entry points of the activation family, their eager autograd, and the ``torch.library``
ops ``torch.compile`` traces.

* ``bias_act(x, bias, activation)``: differentiable ``act(x + bias)``.
* ``gated_act(x, u, activation)``: differentiable ``act(x) * u`` (SwiGLU, GeGLU, ReGLU, GLU).
* ``act_fwd`` / ``act_bwd`` / ``glu_fwd`` / ``glu_bwd``: the raw forward / backward, for composite
  autograd functions (the MLPs of ``culmen.mlp``, ``culmen.fused_dense``, ``culmen.flash_attn``). In
  eager mode they may work in place.

The call path (DESIGN.md): an eager call builds a key from its signature and looks up a cached plan
(``launch.ActPlan`` / ``ActBwdPlan`` / ``GluPlan``; validation ran when the plan was built); with
autograd recording it goes through a plain ``autograd.Function`` (its C-level ``apply``), otherwise
straight to the plan. Under ``torch.compile``, ``bias_act`` and ``gated_act`` trace their PyTorch formulas
(fp32 math, ``reference.py``), which Inductor fuses with their neighbours, unless
``culmen.set_compile_fusion(False)``; the raw functions, and those two with the switch off, are
``triton_op``s (``culmen::act_fwd``, ``act_bwd``, ``glu_fwd``, ``glu_bwd``) whose bodies launch through
``wrap_triton``, so Inductor launches the kernels itself; the differentiable ones carry their backward
through ``register_autograd``.

``gated_act`` on the two halves of one tensor (``h.chunk(2, -1)``, the usual fused gate/up projection)
runs the kernels on the halves in place (row stride ``2N``), and when autograd records it takes the
tensor itself as its input and returns its gradient as one buffer: PyTorch would otherwise run the
chunk's backward, a concatenation of the two half-gradients (one more allocation, copy kernel and
autograd node). The halves then get no gradient of their own: differentiating with respect to them
(``torch.autograd.grad(out, [x, u])``) needs them as leaves or separate tensors; halves with a hook or
``retain_grad()`` keep the ordinary path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.activations.launch import (
    ACT_BWD_PLANS,
    ACT_PLANS,
    ACTIVATIONS,
    FROM_OUTPUT_ACTIVATIONS,
    GATED_ACTIVATIONS,
    GLU_PLANS,
    MASK_ACTIVATIONS,
    ActBwdPlan,
    ActPlan,
    GluPlan,
    check_activation,
    check_bias,
    check_same,
    check_tensor,
)
from culmen.ops.activations.reference import act_fwd_ref, glu_fwd_ref
from culmen.ops.backend import compile_fusion_enabled, register_op
from culmen.ops.common.function import raw_apply, saved_memory_free

register_op("act_fwd", "activations", "act(x + bias): none/relu/sigmoid/gelu/gelu_tanh/sqrelu/silu")
register_op("act_bwd", "activations", "backward of act_fwd, bias grad fused, optional recompute of act")
register_op("glu_fwd", "activations", "act(x) * u: SwiGLU / GeGLU / ReGLU / GLU")
register_op("glu_bwd", "activations", "backward of glu_fwd")

__all__ = [
    "ACTIVATIONS", "FROM_OUTPUT_ACTIVATIONS", "GATED_ACTIVATIONS", "MASK_ACTIVATIONS", "act_bwd", "act_fwd",
    "bias_act", "check_activation", "gated_act", "glu_bwd", "glu_fwd",
]

_functorch_active = torch._C._are_functorch_transforms_active
_bump_version = torch._C._increment_version


# ------------------------------------------------------------------------------------- plans


def _bias_key(bias: Tensor | None):
    return None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device)


def act_plan(x: Tensor, bias: Tensor | None, activation: str) -> ActPlan:
    """The cached ``ActPlan`` of ``act(x + bias)`` (built, and the arguments checked, on first use)."""
    try:
        key = (x.shape, x.stride(), x.dtype, x.device, _bias_key(bias), activation)
        plan = ACT_PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors / an unhashable activation: the plan says why
        key, plan = None, None
    if plan is None:
        plan = ActPlan(x, bias, activation)
        if key is not None:
            ACT_PLANS.put(key, plan)
    return plan


def glu_plan(x: Tensor, u: Tensor, activation: str) -> GluPlan:
    """The cached ``GluPlan`` of ``act(x) * u``."""
    try:
        key = (x.shape, x.stride(), x.dtype, x.device, u.shape, u.stride(), u.dtype, u.device, activation)
        plan = GLU_PLANS.get(key)
    except (AttributeError, TypeError):
        key, plan = None, None
    if plan is None:
        plan = GluPlan(x, u, activation)
        if key is not None:
            GLU_PLANS.put(key, plan)
    return plan


# ------------------------------------------------------------------------------------- eager


class _BiasActFn(torch.autograd.Function):
    """Eager autograd of ``bias_act``: the plan's kernels called directly. ReLU on the kernels saves a
    1-bit-per-element mask instead of its input: the backward reads ``dy`` and the mask (1.06 passes
    instead of 2), and ``x`` need not stay alive."""

    @staticmethod
    def forward(ctx, plan, x, bias):
        ctx.plan = plan
        if plan.mask_ok:
            y, mask = plan.forward_mask(x, bias)
            ctx.save_for_backward(mask)
            return y
        ctx.save_for_backward(x, bias)
        return plan.forward(x, bias)

    @staticmethod
    def backward(ctx, dy):
        plan = ctx.plan
        want_db = ctx.needs_input_grad[2]
        if plan.mask_ok:
            dx, db = plan.backward_mask(dy, ctx.saved_tensors[0], want_db)
        else:
            x, bias = ctx.saved_tensors
            dx, db = plan.backward(dy, x, bias, want_db)
        return None, dx, db


class _GluFn(torch.autograd.Function):
    """Eager autograd of ``gated_act`` on two tensors."""

    @staticmethod
    def forward(ctx, plan, x, u):
        ctx.plan = plan
        ctx.save_for_backward(x, u)
        return plan.forward(x, u)

    @staticmethod
    def backward(ctx, dy):
        x, u = ctx.saved_tensors
        plan = ctx.plan
        if plan.reuse_saved and saved_memory_free(x, u):
            # Nothing else holds x / u (an MLP's projections): their memory takes the gradients, as Liger's
            # SwiGLU always does; culmen only when it is safe. The version bump makes a stale use raise.
            dx, du = plan.backward(dy, x, u, out=(x.detach(), u.detach()))
            _bump_version((x, u))
            return None, dx, du
        dx, du = plan.backward(dy, x, u)
        return None, dx, du


class _GluPackedFn(torch.autograd.Function):
    """Eager autograd of ``gated_act`` on the two halves of ``base``: one input, one gradient buffer."""

    @staticmethod
    def forward(ctx, plan, base, order):
        ctx.plan, ctx.order = plan, order
        ctx.save_for_backward(base)
        return plan.forward_packed(base, order)

    @staticmethod
    def backward(ctx, dy):
        base = ctx.saved_tensors[0]
        if saved_memory_free(base):  # as _GluFn: the projection's output takes its own gradient
            d = ctx.plan.backward_packed(dy, base, ctx.order, out=base.detach())
            _bump_version((base,))
            return None, d, None
        return None, ctx.plan.backward_packed(dy, base, ctx.order), None


_BIAS_ACT_APPLY = raw_apply(_BiasActFn)
_GLU_APPLY = raw_apply(_GluFn)
_GLU_PACKED_APPLY = raw_apply(_GluPackedFn)


# --------------------------------------------------------------------------------- entry points


def bias_act(x: Tensor, bias: Tensor | None = None, activation: str = "gelu") -> Tensor:
    """Differentiable fused ``act(x + bias)``.

    Args:
        x: ``(..., N)`` fp16/bf16/fp32/fp64, any strides.
        bias: ``(N,)`` (any float dtype) or ``None``.
        activation: one of ``ACTIVATIONS`` (``gelu`` is the exact erf form, ``gelu_tanh`` the tanh
            approximation).

    Returns a contiguous tensor of ``x``'s shape and dtype; math in fp32. The bias gradient is
    reduced in the same kernel pass as ``dx`` (fp32 accumulation).
    """
    if torch.compiler.is_compiling():
        if compile_fusion_enabled():  # plain PyTorch, which Inductor fuses with its neighbours
            check_tensor("x", x)
            if bias is not None:
                check_bias(x, bias)
            return act_fwd_ref(x, bias, check_activation(activation))
        return act_fwd_op(x, bias, activation)
    plan = act_plan(x, bias, activation)
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return _BIAS_ACT_APPLY(plan, x, bias)
    return plan.forward(x, bias)


def gated_act(x: Tensor, u: Tensor, activation: str = "silu") -> Tensor:
    """Differentiable ``act(x) * u`` (``silu``: SwiGLU, ``gelu``/``gelu_tanh``: GeGLU, ``relu``: ReGLU,
    ``sigmoid``: GLU).

    Args:
        x: the gate ``(..., N)``; u: the value, same shape (any strides: the halves of one packed
            ``(..., 2N)`` tensor are read in place, and get one packed gradient, see the module docstring).
        activation: one of ``GATED_ACTIVATIONS``.

    Returns a contiguous tensor in ``x``'s dtype; math in fp32.
    """
    if torch.compiler.is_compiling():
        if compile_fusion_enabled():
            check_tensor("x", x)
            check_tensor("u", u)
            check_same("u", u, x)
            return glu_fwd_ref(x, u, check_activation(activation, GATED_ACTIVATIONS))
        return glu_fwd_op(x, u, activation)
    try:
        key = (x.shape, x.stride(), x.dtype, x.device, u.shape, u.stride(), u.dtype, u.device, activation)
        plan = GLU_PLANS.get(key)
    except (AttributeError, TypeError):
        key, plan = None, None
    if plan is None:
        plan = glu_plan(x, u, activation)
    if torch.is_grad_enabled() and (x.requires_grad or u.requires_grad):
        if plan.packable and not _functorch_active():
            base = x._base
            # Non-leaf views of one base that needs grad, with no per-half autograd state to honour.
            if (base is not None and u._base is base and base.requires_grad and not x.is_leaf and not u.is_leaf
                    and not (x.retains_grad or u.retains_grad)
                    and x._backward_hooks is None and u._backward_hooks is None):
                order = plan.packed_order(x, u, base)
                if order >= 0:
                    return _GLU_PACKED_APPLY(plan, base, order)
        return _GLU_APPLY(plan, x, u)
    return plan.forward(x, u)


def act_fwd(x: Tensor, bias: Tensor | None, activation: str, *, inplace: bool = False) -> Tensor:
    """Non-differentiable ``act(x + bias)`` for composite autograd functions; ``inplace`` writes into
    ``x`` when it is contiguous (eager mode). Under ``torch.compile`` it is the out-of-place op."""
    if torch.compiler.is_compiling():
        return act_fwd_op(x, bias, activation)
    plan = act_plan(x, bias, activation)
    return plan.forward(x, bias, x if (inplace and plan.inplace_ok) else None)


def act_bwd(g: Tensor, x: Tensor, bias: Tensor | None, activation: str, *, from_output: bool = False,
            dbias_dtype: torch.dtype | None = None, store_out: bool = False, inplace: bool = False
            ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Non-differentiable backward of ``act(x + bias)``: ``(dx, dbias, y)``.

    ``from_output``: ``x`` is ``act``'s output (``FROM_OUTPUT_ACTIVATIONS``). ``dbias_dtype``: also the
    bias gradient (column sums of ``dx``) in that dtype. ``store_out``: also ``y = act(x + bias)``.
    ``inplace``: write ``dx`` into ``g`` (eager mode, ``g`` contiguous and of ``x``'s dtype).
    """
    want_db = dbias_dtype is not None
    db_dtype = dbias_dtype if want_db else x.dtype
    if torch.compiler.is_compiling():
        dx, db, y = act_bwd_op(g, x, bias, activation, from_output, want_db, db_dtype, store_out)
        return dx, (db if want_db else None), (y if store_out else None)
    try:
        key = (g.shape, g.stride(), g.dtype, g.device, x.shape, x.stride(), x.dtype, x.device, _bias_key(bias),
               activation, from_output, db_dtype, want_db, store_out)
        plan = ACT_BWD_PLANS.get(key)
    except (AttributeError, TypeError):
        key, plan = None, None
    if plan is None:
        plan = ActBwdPlan(g, x, bias, activation, from_output, want_db, db_dtype, store_out)
        if key is not None:
            ACT_BWD_PLANS.put(key, plan)
    return plan.run(g, x, bias, g if (inplace and plan.inplace_ok) else None)


def glu_fwd(x: Tensor, u: Tensor, activation: str) -> Tensor:
    """Non-differentiable ``act(x) * u`` (the traced op under ``torch.compile``)."""
    if torch.compiler.is_compiling():
        return glu_fwd_op(x, u, activation)
    return glu_plan(x, u, activation).forward(x, u)


def glu_bwd(g: Tensor, x: Tensor, u: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    """Non-differentiable ``(dx, du)`` of ``act(x) * u`` for the output gradient ``g`` (``x``'s shape)."""
    if torch.compiler.is_compiling():
        return glu_bwd_op(g, x, u, activation)
    plan = glu_plan(x, u, activation)
    if not isinstance(g, Tensor) or g.shape != plan.shape or g.device != plan.device:
        check_tensor("g", g)
        check_same("g", g, x)
    return plan.backward(g, x, u)


# -------------------------------------------------------------------------- torch.compile


def _none_as_empty(t: Tensor | None, like: Tensor, dtype: torch.dtype) -> Tensor:
    """Custom ops cannot return ``None``: an absent output is a fresh empty tensor."""
    return t if t is not None else like.new_empty((0,), dtype=dtype)


@torch.library.triton_op("culmen::act_fwd", mutates_args=())
def act_fwd_op(x: Tensor, bias: Tensor | None, act: str) -> Tensor:
    """``act(x + bias)`` for ``torch.compile``: ``x`` ``(..., N)``, ``bias`` ``(N,)`` or None; a contiguous
    result in ``x``'s dtype."""
    return ActPlan(x, bias, act, traced=True).forward(x, bias, traced=True)


def _act_setup(ctx, inputs, output):
    x, bias, act = inputs
    ctx.save_for_backward(x, bias)
    ctx.act = act


def _act_backward(ctx, dy):
    # Runs while torch.compile traces: the kernels are launched through wrap_triton (no custom op).
    x, bias = ctx.saved_tensors
    want_db = bias is not None and ctx.needs_input_grad[1]
    db_dtype = bias.dtype if bias is not None else x.dtype
    dx, db, _ = ActBwdPlan(dy, x, bias, ctx.act, False, want_db, db_dtype, False, traced=True).run(
        dy, x, bias, traced=True)
    return dx, db, None


torch.library.register_autograd("culmen::act_fwd", _act_backward, setup_context=_act_setup)


@torch.library.triton_op("culmen::act_bwd", mutates_args=())
def act_bwd_op(g: Tensor, x: Tensor, bias: Tensor | None, act: str, from_output: bool, want_dbias: bool,
               dbias_dtype: torch.dtype, store_out: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dbias, y)`` of ``act(x + bias)`` for ``torch.compile``; absent results are empty tensors."""
    plan = ActBwdPlan(g, x, bias, act, from_output, want_dbias, dbias_dtype, store_out, traced=True)
    dx, db, y = plan.run(g, x, bias, traced=True)
    return dx, _none_as_empty(db, x, dbias_dtype), _none_as_empty(y, x, x.dtype)


@torch.library.triton_op("culmen::glu_fwd", mutates_args=())
def glu_fwd_op(x: Tensor, u: Tensor, act: str) -> Tensor:
    """``act(x) * u`` of two tensors of one shape for ``torch.compile``; a contiguous result in ``x``'s dtype."""
    return GluPlan(x, u, act, traced=True).forward(x, u, traced=True)


def _glu_setup(ctx, inputs, output):
    x, u, act = inputs
    ctx.save_for_backward(x, u)
    ctx.act = act


def _glu_backward(ctx, dy):
    x, u = ctx.saved_tensors
    dx, du = GluPlan(x, u, ctx.act, traced=True).backward(dy, x, u, traced=True)
    return dx, du, None


torch.library.register_autograd("culmen::glu_fwd", _glu_backward, setup_context=_glu_setup)


@torch.library.triton_op("culmen::glu_bwd", mutates_args=())
def glu_bwd_op(g: Tensor, x: Tensor, u: Tensor, act: str) -> tuple[Tensor, Tensor]:
    """``(dx, du)`` of ``act(x) * u`` for ``torch.compile``."""
    return GluPlan(x, u, act, traced=True).backward(g, x, u, traced=True)
