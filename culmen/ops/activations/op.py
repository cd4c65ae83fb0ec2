"""Custom ops ``culmen::act_fwd`` / ``act_bwd`` / ``glu_fwd`` / ``glu_bwd``, their autograd, and the
op-level entry points.

* ``bias_act(x, bias, activation)``: differentiable ``act(x + bias)``.
* ``gated_act(x, u, activation)``: differentiable ``act(x) * u`` (SwiGLU, GeGLU, ReGLU, GLU).
* ``act_fwd`` / ``act_bwd`` / ``glu_fwd`` / ``glu_bwd``: the raw forward / backward, for composite
  autograd functions (the MLPs of ``culmen.mlp``, ``culmen.fused_dense``, ``culmen.flash_attn``). In
  eager mode they call the implementation directly and may work in place; under ``torch.compile``
  they are the custom ops (out of place), so the compiler sees no graph break.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.activations.reference import act_bwd_ref, act_fwd_ref, glu_bwd_ref, glu_fwd_ref
from culmen.ops.backend import choose_backend, register_op
from culmen.ops.common.outputs import nothing

register_op("act_fwd", "activations", "act(x + bias): none/relu/sigmoid/gelu/gelu_tanh/sqrelu/silu")
register_op("act_bwd", "activations", "backward of act_fwd, bias grad fused, optional recompute of act")
register_op("glu_fwd", "activations", "act(x) * u: SwiGLU / GeGLU / ReGLU / GLU")
register_op("glu_bwd", "activations", "backward of glu_fwd")

ACTIVATIONS: tuple[str, ...] = ("none", "relu", "sigmoid", "gelu", "gelu_tanh", "sqrelu", "silu", "relu_ge0")
"""Activations of ``bias_act`` (``relu_ge0``: ReLU whose derivative at 0 is 1, flash_attn's convention)."""
GATED_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu", "gelu_tanh", "relu", "sigmoid", "sqrelu", "none")
"""Activations applied to the gate ``x`` of ``gated_act``."""
FROM_OUTPUT_ACTIVATIONS: tuple[str, ...] = ("none", "relu", "sigmoid")
"""Activations whose derivative can be computed from their output (no pre-activation saved)."""
MASK_ACTIVATIONS: tuple[str, ...] = ("relu", "relu_ge0")
"""Activations whose derivative is one bit per element: ``bias_act`` saves a bit mask for them."""

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _use_triton(t: Tensor) -> bool:
    # fp64 keeps fp64 math: the kernels compute in fp32, so fp64 runs the (fp64) reference.
    return t.dtype != torch.float64 and t.numel() > 0 and choose_backend(t.device) == "triton"


_LAUNCH = None


def _launch():
    """The launcher module, imported on first use (importing culmen must not import triton) and then
    kept: an ``import`` statement in the hot path costs microseconds per call."""
    global _LAUNCH
    if _LAUNCH is None:
        from culmen.ops.activations import launch

        _LAUNCH = launch
    return _LAUNCH


# ------------------------------------------------------------------------------------ implementations


def act_fwd_impl(x: Tensor, bias: Tensor | None, act: str, out: Tensor | None = None) -> Tensor:
    """``act(x + bias)`` on the chosen backend; into ``out`` (contiguous, may be ``x``) when given."""
    if _use_triton(x):
        return _launch().act_fwd(x, bias, act, out)
    y = act_fwd_ref(x, bias, act)
    if out is None:
        return y
    out.copy_(y)
    return out


def act_bwd_impl(g: Tensor, x: Tensor, bias: Tensor | None, act: str, from_output: bool, want_dbias: bool,
                 dbias_dtype: torch.dtype, store_out: bool = False, out: Tensor | None = None
                 ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(dx, dbias, y)`` of ``act(x + bias)`` on the chosen backend (see ``launch.act_bwd``)."""
    if _use_triton(x):
        return _launch().act_bwd(g, x, bias, act, from_output, want_dbias, dbias_dtype, store_out, out)
    dx, db, y = act_bwd_ref(g, x, bias, act, from_output, want_dbias, dbias_dtype, store_out)
    if out is not None:
        out.copy_(dx)
        dx = out
    return dx, db, y


def glu_fwd_impl(x: Tensor, u: Tensor, act: str) -> Tensor:
    """``act(x) * u`` on the chosen backend."""
    if _use_triton(x):
        return _launch().glu_fwd(x, u, act)
    return glu_fwd_ref(x, u, act)


def glu_bwd_impl(g: Tensor, x: Tensor, u: Tensor, act: str) -> tuple[Tensor, Tensor]:
    """``(dx, du)`` of ``act(x) * u`` on the chosen backend."""
    if _use_triton(x):
        return _launch().glu_bwd(g, x, u, act)
    return glu_bwd_ref(g, x, u, act)


# ------------------------------------------------------------------------------------- custom ops


@torch.library.custom_op("culmen::act_fwd", mutates_args=())
def act_fwd_op(x: Tensor, bias: Tensor | None, act: str) -> Tensor:
    """``act(x + bias)``: ``x`` ``(..., N)``, ``bias`` ``(N,)`` or None; a contiguous result in ``x``'s dtype."""
    return act_fwd_impl(x, bias, act)


@act_fwd_op.register_fake
def _(x, bias, act):
    return x.new_empty(x.shape)


@torch.library.custom_op("culmen::act_bwd", mutates_args=())
def act_bwd_op(g: Tensor, x: Tensor, bias: Tensor | None, act: str, from_output: bool, want_dbias: bool,
               dbias_dtype: torch.dtype, store_out: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dbias, y)`` of ``act(x + bias)``; absent results are empty tensors."""
    dx, db, y = act_bwd_impl(g, x, bias, act, from_output, want_dbias, dbias_dtype, store_out)
    return (dx, db if db is not None else nothing(x.device, dbias_dtype),
            y if y is not None else nothing(x.device, x.dtype))


@act_bwd_op.register_fake
def _(g, x, bias, act, from_output, want_dbias, dbias_dtype, store_out):
    db = x.new_empty((x.shape[-1],), dtype=dbias_dtype) if want_dbias else nothing(x.device, dbias_dtype)
    y = x.new_empty(x.shape) if store_out else nothing(x.device, x.dtype)
    return x.new_empty(x.shape), db, y


@torch.library.custom_op("culmen::glu_fwd", mutates_args=())
def glu_fwd_op(x: Tensor, u: Tensor, act: str) -> Tensor:
    """``act(x) * u`` of two tensors of one shape; a contiguous result in ``x``'s dtype."""
    return glu_fwd_impl(x, u, act)


@glu_fwd_op.register_fake
def _(x, u, act):
    return x.new_empty(x.shape)


@torch.library.custom_op("culmen::glu_bwd", mutates_args=())
def glu_bwd_op(g: Tensor, x: Tensor, u: Tensor, act: str) -> tuple[Tensor, Tensor]:
    """``(dx, du)`` of ``act(x) * u``."""
    return glu_bwd_impl(g, x, u, act)


@glu_bwd_op.register_fake
def _(g, x, u, act):
    return x.new_empty(x.shape), u.new_empty(u.shape)


def _act_setup(ctx, inputs, output):
    x, bias, act = inputs
    ctx.save_for_backward(x, bias)
    ctx.act = act
    ctx.bias_dtype = bias.dtype if bias is not None else x.dtype


def _act_backward(ctx, dy):
    x, bias = ctx.saved_tensors
    want_db = bias is not None and ctx.needs_input_grad[1]
    dx, db, _ = act_bwd_op(dy, x, bias, ctx.act, False, want_db, ctx.bias_dtype, False)
    return dx, (db if want_db else None), None


torch.library.register_autograd("culmen::act_fwd", _act_backward, setup_context=_act_setup)


def _glu_setup(ctx, inputs, output):
    x, u, act = inputs
    ctx.save_for_backward(x, u)
    ctx.act = act


def _glu_backward(ctx, dy):
    x, u = ctx.saved_tensors
    dx, du = glu_bwd_op(dy, x, u, ctx.act)
    return dx, du, None


torch.library.register_autograd("culmen::glu_fwd", _glu_backward, setup_context=_glu_setup)


class _BiasActFn(torch.autograd.Function):
    """Eager autograd of ``bias_act``: the launchers called directly (no ``torch.library`` dispatch), the
    backend chosen once per node.

    ReLU on the Triton path saves a 1-bit-per-element mask instead of its input (``launch.relu_mask_fwd``):
    the backward reads ``dy`` and the mask, 1.06 passes instead of 2, and ``x`` need not stay alive.
    """

    @staticmethod
    def forward(ctx, x, bias, act):
        bias_dtype = bias.dtype if bias is not None else x.dtype
        if _use_triton(x):
            launch = _launch()
            if act in MASK_ACTIVATIONS:
                y, mask, geometry = launch.relu_mask_fwd(x, bias, act)
                ctx.state = (act, bias is not None, bias_dtype, True, geometry, x.dtype)
                ctx.save_for_backward(mask)
                return y
            y = launch.act_fwd(x, bias, act)
            ctx.state = (act, bias is not None, bias_dtype, True, None, None)
        else:
            y = act_fwd_ref(x, bias, act)
            ctx.state = (act, bias is not None, bias_dtype, False, None, None)
        ctx.save_for_backward(x, bias)
        return y

    @staticmethod
    def backward(ctx, dy):
        act, has_bias, bias_dtype, triton, geometry, x_dtype = ctx.state
        want_db = has_bias and ctx.needs_input_grad[1]
        if geometry is not None:
            (mask,) = ctx.saved_tensors
            dx, db = _launch().relu_mask_bwd(dy, mask, geometry, x_dtype, want_db, bias_dtype)
            return dx, db, None
        x, bias = ctx.saved_tensors
        if triton:
            dx, db, _ = _launch().act_bwd(dy, x, bias, act, False, want_db, bias_dtype)
        else:
            dx, db, _ = act_bwd_ref(dy, x, bias, act, False, want_db, bias_dtype)
        return dx, (db if want_db else None), None


class _GluFn(torch.autograd.Function):
    """Eager autograd of ``gated_act`` (the backend chosen once per node)."""

    @staticmethod
    def forward(ctx, x, u, act):
        triton = _use_triton(x)
        ctx.state = (act, triton)
        ctx.save_for_backward(x, u)
        return _launch().glu_fwd(x, u, act) if triton else glu_fwd_ref(x, u, act)

    @staticmethod
    def backward(ctx, dy):
        act, triton = ctx.state
        x, u = ctx.saved_tensors
        dx, du = _launch().glu_bwd(dy, x, u, act) if triton else glu_bwd_ref(dy, x, u, act)
        return dx, du, None


def raw_apply(fn: type[torch.autograd.Function]):
    """``fn``'s C-level ``apply`` (for autograd functions without ``setup_context``): ``Function.apply``'s
    Python wrapper costs ~10 us of host time per call and only matters under functorch transforms,
    which callers check per call (``torch._C._are_functorch_transforms_active()``)."""
    try:
        return super(torch.autograd.Function, fn).apply
    except AttributeError:  # a torch without the C base class: the public path
        return fn.apply


def apply_function(fn: type[torch.autograd.Function], raw, *args):
    """``fn.apply(*args)``, through ``raw`` (``raw_apply(fn)``) in eager mode without functorch transforms
    (dynamo traces only the public ``apply``)."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return fn.apply(*args)
    return raw(*args)


_BIAS_ACT_APPLY = raw_apply(_BiasActFn)
_GLU_APPLY = raw_apply(_GluFn)


def _needs_graph(*ts: Tensor | None) -> bool:
    """Whether a call must record an autograd node (grad mode on and an input requiring grad)."""
    if not torch.is_grad_enabled():
        return False
    for t in ts:
        if t is not None and t.requires_grad:
            return True
    return False


# ------------------------------------------------------------------------------------ validation


def check_activation(act: str, allowed: tuple[str, ...] = ACTIVATIONS, name: str = "activation") -> str:
    """Return ``act`` when it is one of ``allowed``; else raise ``ValueError`` listing them."""
    if not isinstance(act, str) or act not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {act!r}")
    return act


def _check_tensor(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float16/bfloat16/float32/float64, got {t.dtype}")


def _check_bias(x: Tensor, bias: Tensor | None) -> Tensor | None:
    if bias is None:
        return None
    _check_tensor("bias", bias)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension when a bias is given")
    if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"bias must have shape ({x.shape[-1]},) (the last dim of x), got {tuple(bias.shape)}")
    if bias.device != x.device:
        raise ValueError(f"bias is on {bias.device} but x is on {x.device}")
    return bias.contiguous()


def _check_same(name: str, t: Tensor, x: Tensor, xname: str = "x") -> None:
    if t.shape != x.shape:
        raise ValueError(f"{name} must have the shape of {xname} {tuple(x.shape)}, got {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but {xname} is on {x.device}")


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
    _check_tensor("x", x)
    check_activation(activation)
    bias = _check_bias(x, bias)
    if torch.compiler.is_compiling():
        return act_fwd_op(x, bias, activation)
    if torch._C._are_functorch_transforms_active():
        return _BiasActFn.apply(x, bias, activation)
    if not _needs_graph(x, bias):
        return act_fwd_impl(x, bias, activation)
    return _BIAS_ACT_APPLY(x, bias, activation)


def gated_act(x: Tensor, u: Tensor, activation: str = "silu") -> Tensor:
    """Differentiable ``act(x) * u`` (``silu``: SwiGLU, ``gelu``/``gelu_tanh``: GeGLU, ``relu``: ReGLU,
    ``sigmoid``: GLU).

    Args:
        x: the gate ``(..., N)``; u: the value, same shape (any strides: halves of one packed tensor
            need no copy).

    Returns a contiguous tensor in ``x``'s dtype; math in fp32.
    """
    _check_tensor("x", x)
    _check_tensor("u", u)
    _check_same("u", u, x)
    check_activation(activation, GATED_ACTIVATIONS)
    if torch.compiler.is_compiling():
        return glu_fwd_op(x, u, activation)
    if torch._C._are_functorch_transforms_active():
        return _GluFn.apply(x, u, activation)
    if not _needs_graph(x, u):
        return glu_fwd_impl(x, u, activation)
    return _GLU_APPLY(x, u, activation)


def act_fwd(x: Tensor, bias: Tensor | None, activation: str, *, inplace: bool = False) -> Tensor:
    """Non-differentiable ``act(x + bias)`` for composite autograd functions; ``inplace`` writes into
    ``x`` (contiguous) in eager mode. Under ``torch.compile`` it is the out-of-place custom op."""
    if torch.compiler.is_compiling():
        return act_fwd_op(x, bias, activation)
    return act_fwd_impl(x, bias, activation, out=x if (inplace and x.is_contiguous()) else None)


def act_bwd(g: Tensor, x: Tensor, bias: Tensor | None, activation: str, *, from_output: bool = False,
            dbias_dtype: torch.dtype | None = None, store_out: bool = False, inplace: bool = False
            ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Non-differentiable backward of ``act(x + bias)``: ``(dx, dbias, y)``.

    ``from_output``: ``x`` is ``act``'s output (``FROM_OUTPUT_ACTIVATIONS``). ``dbias_dtype``: also the
    bias gradient (column sums of ``dx``) in that dtype. ``store_out``: also ``y = act(x + bias)``.
    ``inplace``: write ``dx`` into ``g`` (eager mode, ``g`` contiguous and of ``x``'s dtype).
    """
    if from_output and store_out:
        raise ValueError("store_out needs the pre-activation (from_output=False)")
    want_db = dbias_dtype is not None
    db_dtype = dbias_dtype if want_db else x.dtype
    if torch.compiler.is_compiling():
        dx, db, y = act_bwd_op(g, x, bias, activation, from_output, want_db, db_dtype, store_out)
        return dx, (db if want_db else None), (y if store_out else None)
    out = g if (inplace and g.is_contiguous() and g.dtype == x.dtype and g.shape == x.shape) else None
    return act_bwd_impl(g, x, bias, activation, from_output, want_db, db_dtype, store_out, out)


def glu_fwd(x: Tensor, u: Tensor, activation: str) -> Tensor:
    """Non-differentiable ``act(x) * u`` (the custom op under ``torch.compile``)."""
    return glu_fwd_op(x, u, activation) if torch.compiler.is_compiling() else glu_fwd_impl(x, u, activation)


def glu_bwd(g: Tensor, x: Tensor, u: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    """Non-differentiable ``(dx, du)`` of ``act(x) * u``."""
    return glu_bwd_op(g, x, u, activation) if torch.compiler.is_compiling() else glu_bwd_impl(g, x, u, activation)
