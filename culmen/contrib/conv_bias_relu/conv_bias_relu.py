"""Apex's ``apex.contrib.conv_bias_relu``: a 2-D convolution fused with its bias / scale / mask / ReLU epilogue.

``ConvBiasReLU(x, weight, bias, padding, stride)``, ``ConvBias(...)``, ``ConvBiasMaskReLU(x, weight, bias, mask,
padding, stride)`` and ``ConvFrozenScaleBiasReLU(x, weight, scale, bias, padding, stride)`` with Apex's argument
order; ``ConvBiasReLU_`` ... are the autograd functions of the fused formulation (their ``apply`` always runs it).

Differences from Apex's cuDNN-frontend version: the convolution runs through PyTorch (``F.conv2d``, cuDNN on
NVIDIA GPUs) and the epilogue in one Triton pass (``culmen.ops.conv_epilogue``) instead of one cuDNN fused
graph; any device (CPU included), fp16 / bf16 / fp32 / fp64, ``padding`` and ``stride`` given as an int or a
pair, and inputs in any memory format (they are made channels-last, Apex's required layout; the output is
channels-last). As in Apex, CUDA autocast casts the inputs to fp16, and ``ConvFrozenScaleBiasReLU`` gives no
gradient to ``scale`` and ``bias``.

Routing (what a call runs; decided once per call signature, see ``ROUTING``). A Python autograd node costs the
host more than the C++ nodes of PyTorch's own ``relu(conv2d(x, w, b))``, and at ResNet batch-32 shapes the
forward + backward is host-bound (the H200 run measured 290-570 us of host time against 70-140 us on the GPU),
so the fused epilogue only pays where the GPU is the bottleneck:

* without autograd, ``ConvBiasReLU`` / ``ConvBiasMaskReLU`` / ``ConvFrozenScaleBiasReLU`` run the convolution
  and the Triton epilogue (one pass instead of PyTorch's bias add + ReLU: 1.3-1.5x on the H200);
* with autograd, outputs of at least ``ROUTING["fused_grad_min_numel"]`` elements run the fused autograd
  function (Triton epilogue forward; one Triton pass for the ReLU/mask gate and the bias sums backward); smaller
  ones run the PyTorch formulation (``relu_(conv2d(x, w, b))``, ``relu_(conv2d(x, w, b).mul_(mask))``,
  ``relu_(addcmul(bias, conv2d(x, w), scale))``), whose host cost is PyTorch's own;
* ``ConvBias`` always runs ``conv2d(x, w, b)``: a bias alone is one pass either way;
* under ``torch.compile``, ``ConvBiasReLU`` / ``ConvBiasMaskReLU`` / ``ConvFrozenScaleBiasReLU`` (and
  ``fused_conv_epilogue``) trace as ``conv2d`` followed by the custom op ``culmen::conv_epilogue_fwd`` (its fake
  implementation gives the graph the real output's shape, strides and dtype; its backward is the op
  ``culmen::conv_epilogue_bwd``): no graph break, and Inductor launches the Triton epilogue on GPUs;
* off the Triton backend (CPU, fp64) and under functorch transforms, in eager mode: the PyTorch formulation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from culmen.ops.common.function import raw_apply
from culmen.ops.common.launch import PlanTuning
from culmen.ops.common.plans import PlanCache, clear_plans
from culmen.ops.conv_epilogue import conv_epilogue, epilogue_plan

__all__ = ["ConvBias", "ConvBiasMaskReLU", "ConvBiasReLU", "ConvFrozenScaleBiasReLU", "ConvBiasReLU_",
           "ConvBiasMaskReLU_", "ConvBias_", "ConvFrozenScaleBiasReLU_", "ROUTING", "fused_conv_epilogue"]

_CL = torch.channels_last
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_conv_bwd = torch.ops.aten.convolution_backward.default
_CHECKED: set = set()  # fused_conv_epilogue's call signatures whose arguments passed the checks

ROUTING = PlanTuning({
    # Output elements (N * K * Ho * Wo) from which a call recording autograd takes the fused autograd function.
    # 2^25 (a 56x56x64 output at batch ~170): there the convolution's forward + backward takes longer on an
    # H100/H200 than the host needs to enqueue it, and the fused epilogue's saved passes show in the wall time.
    # Below, the call is host-bound and PyTorch's C++ autograd nodes are the cheaper host path.
    # scripts/sweep_conv_epilogue.py times both sides of the line.
    "fused_grad_min_numel": 1 << 25,
    # Output elements from which a call without autograd runs the Triton epilogue (0: always).
    "fused_fwd_min_numel": 0,
}, clear_plans)
_PLANS = PlanCache("conv_bias_relu")
_transforms_active = torch._C._are_functorch_transforms_active
_compiling = torch.compiler.is_compiling
_autocast_on = torch.is_autocast_enabled
_grad_on = torch.is_grad_enabled


def _pair(v, name: str, lo: int) -> tuple[int, int]:
    if isinstance(v, bool):
        raise TypeError(f"{name} must be an int or a pair of ints, got {v!r}")
    if isinstance(v, int):
        v = (v, v)
    if not (isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(i, int) and not isinstance(i, bool)
                                                                 for i in v)):
        raise TypeError(f"{name} must be an int or a pair of ints, got {v!r}")
    if min(v) < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v!r}")
    return int(v[0]), int(v[1])


def _check(x, weight, vectors: tuple, mask, padding, stride, res=None, res_weight=None, res_stride=None):
    """Validate a call (once per signature); returns ``(padding, stride)`` as pairs."""
    pad = _pair(padding, "padding", 0)
    st = _pair(stride, "stride", 1)
    try:
        key = (x.shape, x.dtype, x.device, weight.shape, weight.dtype, weight.device,
               tuple(None if v is None else (v.shape, v.device) for _, v in vectors),
               None if mask is None else (mask.shape, mask.device),
               None if res is None else (res.shape, res.device),
               None if res_weight is None else (res_weight.shape, res_weight.dtype), res_stride, pad, st)
    except AttributeError:
        key = None
    if key is not None and key in _CHECKED:
        return pad, st
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ((N, C, H, W) / (K, C, R, S)), got shape {tuple(t.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight has {weight.shape[1]} input channels, x has {x.shape[1]} (shape {tuple(x.shape)})")
    K = weight.shape[0]
    ho = (x.shape[2] + 2 * pad[0] - weight.shape[2]) // st[0] + 1
    wo = (x.shape[3] + 2 * pad[1] - weight.shape[3]) // st[1] + 1
    if ho < 1 or wo < 1:
        raise ValueError(f"the kernel {tuple(weight.shape[2:])} does not fit x {tuple(x.shape[2:])} padded by "
                         f"{pad}")
    for name, v in vectors:
        if v is None:
            continue
        if not isinstance(v, Tensor) or v.dtype not in _FLOATS:
            got = v.dtype if isinstance(v, Tensor) else type(v).__name__
            raise TypeError(f"{name} must be a floating-point tensor, got {got}")
        if v.numel() != K:
            raise ValueError(f"{name} must have one element per output channel ({K}), got shape {tuple(v.shape)}")
    out = (x.shape[0], K, ho, wo)
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
        if tuple(mask.shape) != out:
            raise ValueError(f"mask must have the output's shape {out}, got {tuple(mask.shape)}")
    if res is not None and res_weight is None and tuple(res.shape) != out:
        raise ValueError(f"the residual must have the output's shape {out}, got {tuple(res.shape)}")
    if key is not None:
        _CHECKED.add(key)
    return pad, st


def _vsig(v):
    return None if v is None else (v.shape, v.stride(), v.dtype, v.device)


class _Plan:
    """What a call signature of one API function derives once: validated ``padding`` / ``stride`` pairs, the
    layout conversions and vector reshapes still needed per call, and the route (see the module notes)."""

    __slots__ = ("pad", "st", "relu", "cvt_x", "cvt_w", "flat", "cast", "frozen_shape", "fused_fwd", "fused_grad",
                 "epi", "bias_meta")

    def __init__(self, kind: str, x, weight, scale, bias, mask, padding, stride) -> None:
        vectors = (("scale", scale), ("bias", bias)) if kind == "frozen" else (("bias", bias),)
        self.pad, self.st = _check(x, weight, vectors, mask, padding, stride)
        K = weight.shape[0]
        out = x.shape[0] * K * ((x.shape[2] + 2 * self.pad[0] - weight.shape[2]) // self.st[0] + 1) * \
            ((x.shape[3] + 2 * self.pad[1] - weight.shape[3]) // self.st[1] + 1)
        self.relu = kind != "bias"
        self.cvt_x = not x.is_contiguous(memory_format=_CL)
        self.cvt_w = not weight.is_contiguous(memory_format=_CL)
        # PyTorch formulation: conv2d's bias is (K,) in x's dtype; the frozen factors broadcast as (1, K, 1, 1).
        self.flat = bias is not None and bias.dim() != 1
        self.cast = bias is not None and bias.dtype != x.dtype
        self.frozen_shape = None
        if kind == "frozen":
            self.frozen_shape = tuple((v is not None and tuple(v.shape) != (1, K, 1, 1), v is not None
                                       and v.dtype != x.dtype) for v in (scale, bias))
        self.bias_meta = None if bias is None else (bias.shape, bias.dtype)
        kernel = kind != "bias" and _uses_kernel(x)
        self.fused_fwd = kernel and out >= ROUTING["fused_fwd_min_numel"]
        self.fused_grad = kernel and out >= ROUTING["fused_grad_min_numel"]
        self.epi = None  # the epilogue's plan, looked up on the first fused call (it keys on the conv output)


def _uses_kernel(x: Tensor) -> bool:
    from culmen.ops.backend import choose_backend

    return x.dtype != torch.float64 and choose_backend(x.device) == "triton"


def _plan(kind: str, x, weight, scale, bias, mask, padding, stride) -> _Plan:
    try:
        key = (kind, x.shape, x.stride(), x.dtype, x.device, weight.shape, weight.stride(), weight.dtype,
               weight.device, _vsig(scale), _vsig(bias), _vsig(mask), padding, stride)
        p = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors, or a list padding: the plan's checks sort it out
        key, p = None, None
    if p is None:
        p = _Plan(kind, x, weight, scale, bias, mask, padding, stride)
        if key is not None:
            _PLANS.put(key, p)
    return p


def _torch_form(p: _Plan, x, weight, scale, bias, mask) -> Tensor:
    """The PyTorch formulation of a call (autograd through PyTorch's own nodes)."""
    if p.frozen_shape is not None:  # relu(conv * scale + bias); no gradient for the frozen factors
        c = F.conv2d(x, weight, None, p.st, p.pad)
        (rs, cs), (rb, cb) = p.frozen_shape
        if scale.requires_grad:
            scale = scale.detach()
        if bias.requires_grad:
            bias = bias.detach()
        if rs:
            scale = scale.reshape(1, -1, 1, 1)
        if cs:
            scale = scale.to(x.dtype)
        if rb:
            bias = bias.reshape(1, -1, 1, 1)
        if cb:
            bias = bias.to(x.dtype)
        return torch.relu_(torch.addcmul(bias, c, scale))
    if p.flat:
        bias = bias.reshape(-1)
    if p.cast:
        bias = bias.to(x.dtype)
    c = F.conv2d(x, weight, bias, p.st, p.pad)
    if mask is not None:
        c = c.mul_(mask.detach() if mask.requires_grad else mask)
    return torch.relu_(c) if p.relu else c


def _fused_nograd(p: _Plan, x, weight, scale, bias, mask) -> Tensor:
    c = F.conv2d(x, weight, None, p.st, p.pad)
    epi = p.epi
    if epi is None:
        epi = p.epi = epilogue_plan(c, scale, bias, None, None, mask, True)
    return epi.forward(c, scale, bias, None, None, mask)


class _Fused(torch.autograd.Function):
    """The fused formulation with autograd: ``(x, weight, scale, bias, mask, plan)``; gradients for ``x``,
    ``weight`` and (unless frozen) ``bias``."""

    @staticmethod
    def forward(ctx, x, weight, scale, bias, mask, p):
        c = F.conv2d(x, weight, None, p.st, p.pad)
        epi = p.epi
        if epi is None:
            epi = p.epi = epilogue_plan(c, scale, bias, None, None, mask, True)
        y = epi.forward(c, scale, bias, None, None, mask)
        ctx.p = p
        ctx.save_for_backward(x, weight, scale, mask, y)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, scale, mask, y = ctx.saved_tensors
        p = ctx.p
        nx, nw, _, nb, _, _ = ctx.needs_input_grad
        nb = nb and p.frozen_shape is None
        dc, _, s = p.epi.backward(dy, y, mask, scale, None, nx or nw, False, nb)
        dx = dw = db = None
        if nx or nw:
            dx, dw, _ = _conv_bwd(dc, x, weight, None, p.st, p.pad, (1, 1), False, (0, 0), 1, (nx, nw, False))
        if s is not None:
            shape, dtype = p.bias_meta
            db = s.to(dtype).reshape(shape)
        return dx, dw, None, db, None, None


_fused = raw_apply(_Fused)


def _call(kind: str, x, weight, scale, bias, mask, padding, stride) -> Tensor:
    if _autocast_on("cuda") and x.is_cuda:
        return _amp_call(kind, x, weight, scale, bias, mask, padding, stride)
    p = _plan(kind, x, weight, scale, bias, mask, padding, stride)
    if p.cvt_x:
        x = x.contiguous(memory_format=_CL)
    if p.cvt_w:
        weight = weight.contiguous(memory_format=_CL)
    if _grad_on() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        if p.fused_grad and not (_transforms_active() or _compiling()):
            return _fused(x, weight, scale, bias, mask, p)
    elif p.fused_fwd and not _compiling():
        return _fused_nograd(p, x, weight, scale, bias, mask)
    if p.relu and _compiling():
        return _compiled_call(p, x, weight, scale, bias, mask)
    return _torch_form(p, x, weight, scale, bias, mask)


def _compiled_call(p: _Plan, x, weight, scale, bias, mask) -> Tensor:
    """A call while ``torch.compile`` traces: ``conv2d``, then the epilogue as one custom op."""
    c = F.conv2d(x, weight, None, p.st, p.pad)
    if p.frozen_shape is not None:  # frozen factors: no gradient, as in the eager paths
        scale, bias = scale.detach(), bias.detach()
    return conv_epilogue(c, scale, bias, None, None, None if mask is None else mask.detach(), True)


def _half(t):
    return t.to(torch.float16) if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float16 else t


def _amp_call(kind: str, x, weight, scale, bias, mask, padding, stride) -> Tensor:
    """Apex's autocast rule: the floating inputs in fp16, the call itself outside autocast."""
    args = (_half(x), _half(weight), _half(scale), _half(bias), _half(mask))
    with torch.autocast("cuda", enabled=False):
        return _call(kind, *args, padding, stride)


def ConvBiasReLU(x: Tensor, weight: Tensor, bias: Tensor, padding=0, stride=1) -> Tensor:
    """``relu(conv2d(x, weight, stride, padding) + bias)``.

    ``x`` ``(N, C, H, W)``, ``weight`` ``(K, C, R, S)`` of ``x``'s dtype, ``bias`` with ``K`` elements (Apex passes
    ``(1, K, 1, 1)``; its gradient has its shape), ``padding`` and ``stride`` ints (or pairs). Returns
    ``(N, K, Ho, Wo)`` channels-last in ``x``'s dtype; differentiable in ``x``, ``weight`` and ``bias``.
    """
    return _call("relu", x, weight, None, bias, None, padding, stride)


def ConvBias(x: Tensor, weight: Tensor, bias: Tensor, padding=0, stride=1) -> Tensor:
    """``conv2d(x, weight, stride, padding) + bias``; arguments and gradients as ``ConvBiasReLU``."""
    return _call("bias", x, weight, None, bias, None, padding, stride)


def ConvBiasMaskReLU(x: Tensor, weight: Tensor, bias: Tensor, mask: Tensor, padding=0, stride=1) -> Tensor:
    """``relu((conv2d(x, weight, stride, padding) + bias) * mask)``: as ``ConvBiasReLU`` plus ``mask`` of the
    output's shape ``(N, K, Ho, Wo)`` (Apex: int8 0/1; bool and float masks work too). No gradient for ``mask``."""
    return _call("mask", x, weight, None, bias, mask, padding, stride)


def ConvFrozenScaleBiasReLU(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor, padding=0, stride=1) -> Tensor:
    """``relu(conv2d(x, weight, stride, padding) * scale + bias)`` with a frozen (batch-norm) ``scale`` and ``bias``
    of ``K`` elements each. Gradients for ``x`` and ``weight`` only, as in Apex."""
    return _call("frozen", x, weight, scale, bias, None, padding, stride)


def _cl(t: Tensor | None) -> Tensor | None:
    if t is None or t.is_contiguous(memory_format=_CL):
        return t
    return t.contiguous(memory_format=_CL)


def _forward(ctx, x, weight, scale, bias, res, res_weight, res_scale, mask, pad, st, res_stride, relu):
    """Shared forward: conv(x) [+ conv(res) or res], epilogue; what the backward needs goes on ``ctx``."""
    x, weight = _cl(x), _cl(weight)
    c = F.conv2d(x, weight, None, st, pad)
    r = res
    if res_weight is not None:
        res, res_weight = _cl(res), _cl(res_weight)
        r = F.conv2d(res, res_weight, None, res_stride)
    plan = epilogue_plan(c, scale, bias, r, res_scale, mask, relu)
    y = plan.forward(c, scale, bias, r, res_scale, mask)
    ctx.plan = plan
    ctx.conv = (st, pad, res_stride)
    ctx.bias_meta = None if bias is None else (bias.shape, bias.dtype)
    ctx.has_res = res is not None
    ctx.save_for_backward(x, weight, res if res_weight is not None else None, res_weight, scale, res_scale, mask,
                          y if relu else None)
    return y


def _backward(ctx, dy, need_x: bool, need_w: bool, need_b: bool, need_res: bool, need_rw: bool):
    """Shared backward: ``(dx, dweight, dbias, dres, dres_weight)``, ``None`` where not needed."""
    x, weight, res, res_weight, scale, res_scale, mask, y = ctx.saved_tensors
    st, pad, res_stride = ctx.conv
    need_dr = ctx.has_res and (need_res or need_rw)
    dc, dr, s = ctx.plan.backward(dy, y, mask, scale, res_scale, need_x or need_w, need_dr,
                                  need_b and ctx.bias_meta is not None)
    dx = dw = db = dres = drw = None
    if need_x or need_w:
        dx, dw, _ = _conv_bwd(dc, x, weight, None, st, pad, (1, 1), False, (0, 0), 1, (need_x, need_w, False))
    if s is not None:
        shape, dtype = ctx.bias_meta
        db = s.to(dtype).reshape(shape)
    if need_dr:
        if res_weight is not None:
            dres, drw, _ = _conv_bwd(dr, res, res_weight, None, res_stride, (0, 0), (1, 1), False, (0, 0), 1,
                                     (need_res, need_rw, False))
        else:
            dres = dr
    return dx, dw, db, dres, drw


_fwd_amp = torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float16)
_bwd_amp = torch.amp.custom_bwd(device_type="cuda")


class _ConvBiasFunction(torch.autograd.Function):
    """The backward of the ``Conv*Bias*_`` functions whose inputs start ``(x, weight, bias, ...)``: gradients for
    those three, ``None`` for the rest (mask, padding, stride)."""

    @staticmethod
    @_bwd_amp
    def backward(ctx, grad_output):
        n = ctx.needs_input_grad
        dx, dw, db, _, _ = _backward(ctx, grad_output, n[0], n[1], n[2], False, False)
        return (dx, dw, db) + (None,) * (len(n) - 3)


class ConvBiasReLU_(_ConvBiasFunction):
    """``relu(conv2d(x, weight, stride, padding) + bias)``.

    ``forward(x, weight, bias, padding, stride)``: ``x`` ``(N, C, H, W)``, ``weight`` ``(K, C, R, S)`` of ``x``'s
    dtype, ``bias`` with ``K`` elements (Apex passes ``(1, K, 1, 1)``; its gradient has its shape), ``padding``
    and ``stride`` ints (or pairs). Returns ``(N, K, Ho, Wo)`` channels-last in ``x``'s dtype; gradients
    for ``x``, ``weight`` and ``bias``.
    """

    @staticmethod
    @_fwd_amp
    def forward(ctx, x, weight, bias, padding, stride):
        pad, st = _check(x, weight, (("bias", bias),), None, padding, stride)
        return _forward(ctx, x, weight, None, bias, None, None, None, None, pad, st, None, True)


class ConvBias_(_ConvBiasFunction):
    """``conv2d(x, weight, stride, padding) + bias``; arguments and gradients as ``ConvBiasReLU_``."""

    @staticmethod
    @_fwd_amp
    def forward(ctx, x, weight, bias, padding, stride):
        pad, st = _check(x, weight, (("bias", bias),), None, padding, stride)
        return _forward(ctx, x, weight, None, bias, None, None, None, None, pad, st, None, False)


class ConvBiasMaskReLU_(_ConvBiasFunction):
    """``relu((conv2d(x, weight, stride, padding) + bias) * mask)``.

    ``forward(x, weight, bias, mask, padding, stride)``: as ``ConvBiasReLU_`` plus ``mask`` of the output's shape
    ``(N, K, Ho, Wo)`` (Apex: int8 0/1; bool and float masks work too). No gradient for ``mask``.
    """

    @staticmethod
    @_fwd_amp
    def forward(ctx, x, weight, bias, mask, padding, stride):
        pad, st = _check(x, weight, (("bias", bias),), mask, padding, stride)
        return _forward(ctx, x, weight, None, bias, None, None, None, mask, pad, st, None, True)


class ConvFrozenScaleBiasReLU_(torch.autograd.Function):
    """``relu(conv2d(x, weight, stride, padding) * scale + bias)`` with a frozen (batch-norm) ``scale`` and ``bias``.

    ``forward(x, weight, scale, bias, padding, stride)``: ``scale`` and ``bias`` with ``K`` elements each.
    Gradients for ``x`` and ``weight`` only, as in Apex.
    """

    @staticmethod
    @_fwd_amp
    def forward(ctx, x, weight, scale, bias, padding, stride):
        pad, st = _check(x, weight, (("scale", scale), ("bias", bias)), None, padding, stride)
        return _forward(ctx, x, weight, scale, bias, None, None, None, None, pad, st, None, True)

    @staticmethod
    @_bwd_amp
    def backward(ctx, grad_output):
        n = ctx.needs_input_grad
        dx, dw, _, _, _ = _backward(ctx, grad_output, n[0], n[1], False, False, False)
        return dx, dw, None, None, None, None


class _FusedConvEpilogue(torch.autograd.Function):
    """``act(conv(x) * scale + bias + r * res_scale)`` with ``r = res`` or ``conv1x1(res, res_weight, res_stride)``:
    the last stage of a ResNet bottleneck. ``scale`` / ``res_scale`` are frozen; ``bias`` is frozen too."""

    @staticmethod
    def forward(ctx, x, weight, scale, bias, res, res_weight, res_scale, pad, st, res_stride, relu):
        return _forward(ctx, x, weight, scale, bias, res, res_weight, res_scale, None, pad, st, res_stride, relu)

    @staticmethod
    def backward(ctx, dy):
        n = ctx.needs_input_grad
        dx, dw, _, dres, drw = _backward(ctx, dy, n[0], n[1], False, n[4], n[5])
        return dx, dw, None, None, dres, drw, None, None, None, None, None


def fused_conv_epilogue(x: Tensor, weight: Tensor, scale: Tensor | None, bias: Tensor | None, padding=0, stride=1,
                        relu: bool = True, res: Tensor | None = None, res_weight: Tensor | None = None,
                        res_scale: Tensor | None = None, res_stride=1) -> Tensor:
    """``act(conv2d(x, weight) * scale + bias + r * res_scale)`` where ``r`` is ``res`` itself or, with
    ``res_weight`` ``(K, C', 1, 1)``, the 1x1 convolution of ``res`` with stride ``res_stride``.

    ``x`` ``(N, C, H, W)``; ``scale``, ``bias``, ``res_scale``: ``K`` elements or ``None``, constants (no
    gradient: frozen batch-norm factors). Differentiable in ``x``, ``weight``, ``res`` and ``res_weight``. Under
    ``torch.compile`` the convolutions trace as ``conv2d`` and the epilogue as the op ``culmen::conv_epilogue_fwd``.
    """
    pad, st = _check(x, weight, (("scale", scale), ("bias", bias), ("res_scale", res_scale)), None, padding, stride,
                     res, res_weight, None if res_weight is None else _pair(res_stride, "res_stride", 1))
    rst = _pair(res_stride, "res_stride", 1)
    if torch.compiler.is_compiling():
        c = F.conv2d(x, weight, None, st, pad)
        r = res if res_weight is None else F.conv2d(res, res_weight, None, rst)
        scale, bias, res_scale = (None if v is None else v.detach() for v in (scale, bias, res_scale))
        return conv_epilogue(c, scale, bias, r, res_scale, None, bool(relu))
    return _FusedConvEpilogue.apply(x, weight, scale, bias, res, res_weight, res_scale, pad, st, rst, bool(relu))
