"""Custom ops ``culmen::group_norm_fwd`` / ``culmen::group_norm_bwd``, their autograd, and ``group_norm``.

``group_norm`` is the op-level entry point of ``culmen.contrib.group_norm`` (Apex's NHWC GroupNorm
with fused SiLU), for NCHW and channels-last inputs alike.

Eager calls on the Triton backend take a lean path (host time decides the wall time of small
activations): the arguments of each call signature are validated once (``_fast_entry``), and one
``autograd.Function`` with a single output keeps the statistics in the forward's workspace on ``ctx``.
``torch.compile``, ``return_stats`` and unusual arguments go through the custom ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import choose_backend, register_op
from culmen.ops.common.outputs import nothing
from culmen.ops.group_norm.reference import group_norm_bwd_ref, group_norm_fwd_ref, spatial_strides, stats_dtype

_launch = None  # culmen.ops.group_norm.launch, imported at the first Triton call (it imports triton)


def _launcher():
    global _launch
    if _launch is None:
        from culmen.ops.group_norm import launch

        _launch = launch
    return _launch

register_op("group_norm_fwd", "normalization", "GroupNorm (+ SiLU), NCHW or channels-last, fp32 statistics")
register_op("group_norm_bwd", "normalization", "backward of group_norm_fwd (dx, dweight, dbias)")

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_PARAM_TYPES = (Tensor, torch.nn.Parameter)
_ACTS = {None: False, "": False, "none": False, "silu": True, "swish": True}


def _fwd_impl(x, weight, bias, G, eps, silu):
    if choose_backend(x.device) == "triton":
        return _launcher().group_norm_fwd(x, weight, bias, G, eps, silu)
    return group_norm_fwd_ref(x, weight, bias, G, eps, silu)


def _bwd_impl(dy, x, weight, bias, mean, rstd, G, silu, need_dw):
    if choose_backend(x.device) == "triton":
        return _launcher().group_norm_bwd(dy, x, weight, bias, mean, rstd, G, silu, need_dw)
    return group_norm_bwd_ref(dy, x, weight, bias, mean, rstd, G, silu, need_dw)


@torch.library.custom_op("culmen::group_norm_fwd", mutates_args=())
def group_norm_fwd_op(x: Tensor, weight: Tensor | None, bias: Tensor | None, num_groups: int, eps: float,
                      silu: bool) -> tuple[Tensor, Tensor, Tensor]:
    """GroupNorm of ``x`` ``(N, C, *spatial)`` (spatial dims collapsible into one stride) with ``(C,)``
    parameters. Returns ``(y, mean, rstd)``: ``y`` like ``x``; ``mean``/``rstd`` ``(N, num_groups)`` fp32."""
    return _fwd_impl(x, weight, bias, num_groups, eps, silu)


@group_norm_fwd_op.register_fake
def _(x, weight, bias, num_groups, eps, silu):
    stats = x.new_empty((x.shape[0], num_groups), dtype=stats_dtype(x))
    return torch.empty_like(x), stats, torch.empty_like(stats)


@torch.library.custom_op("culmen::group_norm_bwd", mutates_args=())
def group_norm_bwd_op(dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor,
                      rstd: Tensor, num_groups: int, silu: bool, need_dw: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Backward: ``(dx, dweight, dbias)``; an absent parameter gradient is an empty tensor."""
    dx, dw, db = _bwd_impl(dy, x, weight, bias, mean, rstd, num_groups, silu, need_dw)
    return (dx, dw if dw is not None else nothing(x.device, x.dtype),
            db if db is not None else nothing(x.device, x.dtype))


@group_norm_bwd_op.register_fake
def _(dy, x, weight, bias, mean, rstd, num_groups, silu, need_dw):
    dw = torch.empty_like(weight) if (need_dw and weight is not None) else nothing(x.device, x.dtype)
    db = torch.empty_like(bias) if (need_dw and bias is not None) else nothing(x.device, x.dtype)
    return torch.empty_like(x), dw, db


def _setup_context(ctx, inputs, output):
    x, weight, bias, num_groups, eps, silu = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.num_groups = num_groups
    ctx.silu = silu


def _backward(ctx, dy, dmean=None, drstd=None, bwd=None):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    if spatial_strides(dy) is None:
        dy = dy.contiguous()
    need = ctx.needs_input_grad
    need_dw = bool(need[1] or need[2])
    dx, dw, db = (bwd or group_norm_bwd_op)(dy, x, weight, bias, mean, rstd, ctx.num_groups, ctx.silu, need_dw)
    return (dx if need[0] else None, dw if (need[1] and weight is not None) else None,
            db if (need[2] and bias is not None) else None, None, None, None)


torch.library.register_autograd("culmen::group_norm_fwd", _backward, setup_context=_setup_context)


class _GroupNormFn(torch.autograd.Function):
    """Eager path: the same implementations without ``torch.library`` dispatch overhead."""

    @staticmethod
    def forward(ctx, x, weight, bias, num_groups, eps, silu):
        out = _fwd_impl(x, weight, bias, num_groups, eps, silu)
        _setup_context(ctx, (x, weight, bias, num_groups, eps, silu), out)
        ctx.mark_non_differentiable(out[1], out[2])
        return out

    @staticmethod
    def backward(ctx, dy, dmean, drstd):
        return _backward(ctx, dy, bwd=_bwd_impl)


def parse_act(act: str | None) -> bool:
    """``True`` for SiLU (``"silu"`` / ``"swish"``, any case), ``False`` for none (``None``, ``""``, ``"none"``)."""
    key = act.lower() if isinstance(act, str) else act
    if key not in _ACTS:
        raise ValueError(f"group_norm: act must be None, '', 'silu' or 'swish', got {act!r}")
    return _ACTS[key]


def _param(name: str, t: Tensor | None, x: Tensor, C: int) -> Tensor | None:
    if t is None:
        return None
    if (type(t) in _PARAM_TYPES and t.dtype in _FLOATS and t.shape == (C,) and t.is_contiguous()
            and t.device == x.device):
        return t  # the usual (C,) parameter: nothing to check further or copy
    if not isinstance(t, Tensor) or t.dtype not in _FLOATS:
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"group_norm: {name} must be a floating-point tensor, got {got}")
    if t.numel() != C:
        raise ValueError(f"group_norm: {name} must have num_channels = {C} elements, got shape {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"group_norm: {name} is on {t.device} but x on {x.device}")
    return t.reshape(C).contiguous()


class _Entry:
    """What ``group_norm`` validated once for one call signature (shapes, strides, dtypes, devices, groups,
    eps, act): the normalized arguments and the Triton plans (rebuilt when ``TUNING`` changes)."""

    __slots__ = ("G", "eps", "silu", "fplan", "bplans")

    def __init__(self, G: int, eps: float, silu: bool):
        self.G, self.eps, self.silu = G, eps, silu
        self.fplan = None
        self.bplans: dict = {}

    def fwd_plan(self, x, weight, bias):
        launch = _launcher()
        if x.numel() == 0:
            return None
        plan = self.fplan
        if plan is None or plan.version != launch.VERSION[0]:
            plan = self.fplan = launch.fwd_plan(x, weight, bias, self.G, self.silu, packed=True)
        return plan


_FRONT: dict = {}


def _param_key(t):
    return None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device)


def _fast_entry(x, num_groups, weight, bias, eps, act) -> _Entry | None:
    """The cached ``_Entry`` of this call signature, made (after full validation) on first sight; ``None``
    when the arguments need the general path (parameters to reshape, tensor subclasses, bad arguments:
    the general path raises the errors)."""
    try:
        key = (type(x), x.shape, x.stride(), x.dtype, x.device, num_groups, eps, act, _param_key(weight),
               _param_key(bias))
        e = _FRONT.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable arguments
        return None
    if e is not None:
        return e
    if not (type(x) is Tensor and x.dtype in _FLOATS and x.dim() >= 2 and spatial_strides(x) is not None):
        return None
    C = x.shape[1]
    G = num_groups
    if type(G) is not int or G <= 0 or C % G != 0 or type(eps) not in (int, float) or eps < 0:
        return None
    try:
        silu = parse_act(act)
    except ValueError:
        return None
    for t in (weight, bias):
        if t is not None and not (type(t) in _PARAM_TYPES and t.dtype in _FLOATS and t.dim() == 1 and t.shape[0] == C
                                  and t.is_contiguous() and t.device == x.device):
            return None
    if len(_FRONT) > 1024:
        _FRONT.clear()
    e = _FRONT[key] = _Entry(G, float(eps), silu)
    return e


class _GroupNormPackedFn(torch.autograd.Function):
    """The eager fast path: one output, the statistics in one workspace kept on ``ctx``, plans from the entry."""

    @staticmethod
    def forward(ctx, x, weight, bias, e):
        y, ws = _launcher().group_norm_fwd_packed(x, weight, bias, e.G, e.eps, e.silu, e.fwd_plan(x, weight, bias))
        ctx.save_for_backward(x, weight, bias)
        ctx.ws = ws
        ctx.e = e
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensors
        e = ctx.e
        need = ctx.needs_input_grad
        need_dw = bool(need[1] or need[2])
        launch = _launcher()
        key = (dy.stride(), dy.dtype, need_dw)
        plan = e.bplans.get(key)
        if x.numel() == 0:
            plan = None
        elif plan is None or plan.version != launch.VERSION[0]:
            if spatial_strides(dy) is None:
                dy = dy.contiguous()
                plan = launch.bwd_plan(dy, x, weight, bias, e.G, e.silu, need_dw, True)
            else:
                plan = e.bplans[key] = launch.bwd_plan(dy, x, weight, bias, e.G, e.silu, need_dw, True)
        ws = ctx.ws
        dx, dw, db = launch.group_norm_bwd(dy, x, weight, bias, ws, ws, e.G, e.silu, need_dw, True, plan)
        return dx if need[0] else None, dw if need[1] else None, db if need[2] else None, None


def group_norm(x: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5, act: str | None = "", return_stats: bool = False
               ) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """GroupNorm over ``num_groups`` groups of channels, optionally followed by SiLU, in one pass.

    Args:
        x: ``(N, C, *spatial)``, fp16/bf16/fp32/fp64, NCHW or channels-last (or any layout whose spatial
            dims collapse into one stride; others are copied first).
        num_groups: divides ``C`` (any value; Apex's fast path takes only 16 or 32).
        weight, bias: ``(C,)`` of any float dtype (independent of ``x``'s), or ``None``.
        eps: added to the variance.
        act: ``None`` / ``""`` (none) or ``"silu"`` / ``"swish"``.
        return_stats: also return the per-group ``mean`` and ``rstd`` (``(N, num_groups)``, not differentiable).

    Returns:
        ``y`` with the shape, dtype and memory format of ``x`` (``(y, mean, rstd)`` with ``return_stats``).
        Statistics are fp32 (fp64 for fp64 ``x``); gradients for ``x``, ``weight`` and ``bias`` (in their
        own dtypes).
    """
    if not return_stats and not torch.compiler.is_compiling():
        e = _fast_entry(x, num_groups, weight, bias, eps, act)
        if e is not None and choose_backend(x.device) == "triton":
            if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)
                                            or (bias is not None and bias.requires_grad)):
                return _GroupNormPackedFn.apply(x, weight, bias, e)
            plan = e.fwd_plan(x, weight, bias)
            return _launcher().group_norm_fwd_packed(x, weight, bias, e.G, e.eps, e.silu, plan)[0]
    if not isinstance(x, Tensor) or x.dtype not in _FLOATS:
        got = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"group_norm: x must be a float16/bfloat16/float32/float64 tensor, got {got}")
    if x.dim() < 2:
        raise ValueError(f"group_norm: x must be (N, C, *spatial), got shape {tuple(x.shape)}")
    C = x.shape[1]
    G = int(num_groups)
    if G <= 0 or C % G != 0:
        raise ValueError(f"group_norm: num_groups must be positive and divide the {C} channels of x, got {num_groups}")
    if float(eps) < 0.0:
        raise ValueError(f"group_norm: eps must be non-negative, got {eps}")
    silu = parse_act(act)
    w = _param("weight", weight, x, C)
    b = _param("bias", bias, x, C)
    if spatial_strides(x) is None:
        x = x.contiguous()
    if torch.compiler.is_compiling():
        y, mean, rstd = group_norm_fwd_op(x, w, b, G, float(eps), silu)
    elif torch.is_grad_enabled() and (x.requires_grad or (w is not None and w.requires_grad)
                                      or (b is not None and b.requires_grad)):
        y, mean, rstd = _GroupNormFn.apply(x, w, b, G, float(eps), silu)
    else:  # nothing to differentiate: no autograd node
        y, mean, rstd = _fwd_impl(x, w, b, G, float(eps), silu)
    return (y, mean, rstd) if return_stats else y


def group_norm_backward(grad_output: Tensor, x: Tensor, num_groups: int, weight: Tensor | None, bias: Tensor | None,
                        mean: Tensor, rstd: Tensor, act: str | None = ""
                        ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(dx, dweight, dbias)`` of ``group_norm`` from its saved ``mean`` / ``rstd``; not differentiable.

    ``grad_output`` has the shape of ``x`` (any layout); the parameter gradients are ``None`` without the
    parameter.
    """
    if tuple(grad_output.shape) != tuple(x.shape):
        raise ValueError(f"group_norm: grad_output must have the shape of x {tuple(x.shape)}, got "
                         f"{tuple(grad_output.shape)}")
    C, G = x.shape[1], int(num_groups)
    if G <= 0 or C % G != 0:
        raise ValueError(f"group_norm: num_groups must be positive and divide the {C} channels of x, got {num_groups}")
    stats = (x.shape[0], G)
    if tuple(mean.shape) != stats or tuple(rstd.shape) != stats:
        raise ValueError(f"group_norm: mean and rstd must have shape {stats}, got {tuple(mean.shape)} and "
                         f"{tuple(rstd.shape)}")
    silu = parse_act(act)
    w = _param("weight", weight, x, C)
    b = _param("bias", bias, x, C)
    if spatial_strides(x) is None:
        x = x.contiguous()
    dy = grad_output if spatial_strides(grad_output) is not None else grad_output.contiguous()
    sd = stats_dtype(x)
    with torch.no_grad():
        return _bwd_impl(dy, x, w, b, mean.to(sd).contiguous(), rstd.to(sd).contiguous(), G, silu, True)
