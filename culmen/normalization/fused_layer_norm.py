"""Apex's ``apex.normalization.fused_layer_norm`` on culmen's fused norm op.

Every functional here reshapes the input so the ``normalized_shape`` trailing dims become one last
dim of size ``N = prod(normalized_shape)`` and calls :func:`culmen.ops.layer_norm.layer_norm`, which
computes statistics in fp32 and runs the Triton kernel on GPUs and the PyTorch reference on CPU.

Differences from Apex (see also the module docstrings):

* Apex falls back to ``F.layer_norm`` / ``manual_rms_norm`` on CPU tensors and under
  ``torch.compile``; culmen always runs its own op (it has a CPU path and a fake implementation), so
  results and dtypes are the same on every device and inside compiled graphs.
* A non-mixed affine call whose parameter dtype differs from the input dtype raises ``TypeError``
  (Apex fails later inside the extension, or silently on some paths); the message points at the
  ``MixedFused*`` / ``mixed_dtype_*`` variants, which return the parameter dtype.
* Autocast follows Apex (inputs and parameters are cast to the autocast dtype, then the op runs with
  autocast off) but checks the autocast state of the input's device type, not only CUDA's.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor
from torch.nn import init
from torch.nn.parameter import Parameter

from culmen.normalization.stats_api import (  # noqa: F401 - Apex's names in this module
    fused_layer_norm_affine_bwd,
    fused_layer_norm_affine_bwd_fake,
    fused_layer_norm_affine_fwd,
    fused_layer_norm_affine_fwd_fake,
    fused_layer_norm_bwd,
    fused_layer_norm_bwd_fake,
    fused_layer_norm_fwd,
    fused_layer_norm_fwd_fake,
    fused_rms_norm_affine_bwd,
    fused_rms_norm_affine_bwd_fake,
    fused_rms_norm_affine_fwd,
    fused_rms_norm_affine_fwd_fake,
    fused_rms_norm_bwd,
    fused_rms_norm_bwd_fake,
    fused_rms_norm_fwd,
    fused_rms_norm_fwd_fake,
    supports_custom_op,
)
from culmen.ops.common.plans import PlanCache
from culmen.ops.layer_norm import layer_norm

__all__ = [
    "FusedLayerNorm",
    "FusedRMSNorm",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    "fused_layer_norm_affine",
    "fused_layer_norm",
    "mixed_dtype_fused_layer_norm_affine",
    "fused_rms_norm_affine",
    "fused_rms_norm",
    "mixed_dtype_fused_rms_norm_affine",
    "manual_rms_norm",
    "FusedLayerNormAffineFunction",
    "FusedLayerNormFunction",
    "FusedLayerNormAffineMixedDtypesFunction",
    "FusedRMSNormAffineFunction",
    "FusedRMSNormFunction",
    "FusedRMSNormAffineMixedDtypesFunction",
]

ShapeLike = int | Sequence[int] | torch.Size

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------------
# Shared helpers (also used by culmen.contrib.layer_norm)
# ---------------------------------------------------------------------------------------------


def _cast_if_autocast_enabled(device_type: str, *args: Any) -> tuple[Any, ...]:
    """Apex's ``_cast_if_autocast_enabled`` for ``device_type``: floating tensors on that device type
    go to the autocast dtype; everything else is returned unchanged."""
    if not torch.is_autocast_enabled(device_type):
        return args
    dtype = torch.get_autocast_dtype(device_type)

    def cast(a):
        if isinstance(a, Tensor) and a.is_floating_point() and a.device.type == device_type and a.dtype != dtype:
            return a.to(dtype)
        return a

    return tuple(cast(a) for a in args)


def _autocast_off(device_type: str):
    """Context that switches autocast off for ``device_type`` when it is on (the op must see the
    dtypes the caller chose, as in Apex, not those autocast would pick)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return nullcontext()


def _to_shape(normalized_shape: ShapeLike) -> tuple[int, ...]:
    """``normalized_shape`` as a tuple of positive ints (an int, a sequence of ints, a ``torch.Size``);
    anything else raises naming the argument and the value."""
    if isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        dims: Sequence[Any] = (normalized_shape,)
    else:
        try:
            if isinstance(normalized_shape, (str, bytes, bool)):
                raise TypeError
            dims = tuple(normalized_shape)
        except TypeError:
            raise TypeError(
                f"normalized_shape must be an int or a sequence of ints, got {type(normalized_shape).__name__} "
                f"{normalized_shape!r}"
            ) from None
    if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) for s in dims):
        raise TypeError(f"normalized_shape must hold ints, got {normalized_shape!r}")
    shape = tuple(int(s) for s in dims)
    if len(shape) == 0:
        raise ValueError(f"normalized_shape must have at least one dimension, got {normalized_shape!r}")
    if any(s <= 0 for s in shape):
        raise ValueError(f"normalized_shape must hold positive sizes, got {normalized_shape!r}")
    return shape


def _check_eps(eps: Any) -> float:
    """A module's ``eps``: a positive finite number (it keeps ``1 / sqrt(var + eps)`` finite)."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a positive number, got {type(eps).__name__} {eps!r}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")
    return eps


def _check_input(fn: str, input: Tensor) -> None:
    if not isinstance(input, Tensor):
        raise TypeError(f"{fn}: input must be a torch.Tensor, got {type(input).__name__}")
    if input.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{fn}: input must be a floating-point tensor (float16/bfloat16/float32/float64), got {input.dtype}"
        )


def _check_param(fn: str, name: str, p: Tensor | None, shape: tuple[int, ...]) -> None:
    if p is None:
        return
    if not isinstance(p, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor or None, got {type(p).__name__}")
    if p.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{fn}: {name} must be a floating-point tensor, got {p.dtype}")
    if tuple(p.shape) != shape:
        raise ValueError(f"{fn}: {name} has shape {tuple(p.shape)}, expected normalized_shape {shape}")


def _rows_view(fn: str, input: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``input`` viewed as ``(..., N)``: the normalized trailing dims folded into one."""
    k = len(shape)
    if input.dim() < k or tuple(input.shape[input.dim() - k:]) != shape:
        raise ValueError(
            f"{fn}: normalized_shape {shape} does not match the trailing dimensions of input of shape "
            f"{tuple(input.shape)}"
        )
    if k == 1:
        return input
    return input.reshape(*input.shape[: input.dim() - k], math.prod(shape))


_CHECKED = PlanCache("apex_normalization")


def _norm(
    fn: str,
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    normalized_shape: ShapeLike,
    eps: float,
    memory_efficient: bool,
    *,
    rms: bool,
    mixed: bool,
) -> Tensor:
    """The one body behind every functional of this module. The checks run once per call signature
    (and on every call under autocast, which casts first); later calls go straight to the op."""
    try:
        key = (fn, input.shape, input.dtype, None if weight is None else (weight.shape, weight.dtype),
               None if bias is None else (bias.shape, bias.dtype), normalized_shape, rms, mixed)
        if torch.is_autocast_enabled(input.device.type):  # casts first: never cached
            entry, key = None, None
        else:
            entry = _CHECKED.get(key)
    except (AttributeError, TypeError):  # not a tensor, an unhashable normalized_shape: the checks say why
        entry, key = None, None
    if entry is None:
        return _norm_checked(fn, input, weight, bias, normalized_shape, eps, memory_efficient, rms=rms, mixed=mixed,
                             key=key)
    out_dtype, folded = entry
    if folded is not None:
        return layer_norm(input.reshape(folded), weight, bias, eps=eps, is_rms_norm=rms, out_dtype=out_dtype,
                          memory_efficient=memory_efficient).y.reshape(input.shape)
    return layer_norm(input, weight, bias, eps=eps, is_rms_norm=rms, out_dtype=out_dtype,
                      memory_efficient=memory_efficient).y


def _norm_checked(fn, input, weight, bias, normalized_shape, eps, memory_efficient, *, rms, mixed, key):
    """``_norm`` with every check (and autocast's casts); records the signature in ``_CHECKED``."""
    _check_input(fn, input)
    shape = _to_shape(normalized_shape)
    device_type = input.device.type
    input, weight, bias = _cast_if_autocast_enabled(device_type, input, weight, bias)
    _check_param(fn, "weight", weight, shape)
    _check_param(fn, "bias", bias, shape)
    if not mixed:
        for name, p in (("weight", weight), ("bias", bias)):
            if p is not None and p.dtype != input.dtype:
                variant = "MixedFusedRMSNorm / mixed_dtype_fused_rms_norm_affine" if rms else (
                    "MixedFusedLayerNorm / mixed_dtype_fused_layer_norm_affine")
                raise TypeError(
                    f"{fn}: {name} dtype {p.dtype} does not match input dtype {input.dtype}; cast them to one "
                    f"dtype, run under autocast, or use {variant}, which returns the parameter dtype"
                )
    out_dtype = weight.dtype if (mixed and weight is not None) else input.dtype
    x = _rows_view(fn, input, shape)
    if key is not None:
        _CHECKED.put(key, (out_dtype, None if len(shape) == 1 else x.shape))
    with _autocast_off(device_type):
        y = layer_norm(x, weight, bias, eps=eps, is_rms_norm=rms, out_dtype=out_dtype,
                       memory_efficient=bool(memory_efficient)).y
    return y.reshape(input.shape)


# ---------------------------------------------------------------------------------------------
# Functionals (Apex names, argument names and defaults)
# ---------------------------------------------------------------------------------------------


def fused_layer_norm_affine(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    normalized_shape: ShapeLike,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> Tensor:
    """LayerNorm over the trailing ``normalized_shape`` dims with elementwise affine.

    Args:
        input: ``(*, *normalized_shape)``, fp16/bf16/fp32/fp64.
        weight, bias: ``normalized_shape``, same dtype as ``input`` (else ``TypeError``; use
            :func:`mixed_dtype_fused_layer_norm_affine` for other parameter dtypes).
        eps: added to the variance. memory_efficient: save the output instead of the input for backward.

    Returns the normalized tensor, shape and dtype of ``input``. Statistics are fp32.
    """
    return _norm("fused_layer_norm_affine", input, weight, bias, normalized_shape, eps, memory_efficient,
                 rms=False, mixed=False)


def fused_layer_norm(
    input: Tensor, normalized_shape: ShapeLike, eps: float = 1e-6, memory_efficient: bool = False
) -> Tensor:
    """LayerNorm over the trailing ``normalized_shape`` dims without affine parameters.

    ``input``: ``(*, *normalized_shape)`` float; returns the same shape and dtype.
    """
    return _norm("fused_layer_norm", input, None, None, normalized_shape, eps, memory_efficient,
                 rms=False, mixed=False)


def mixed_dtype_fused_layer_norm_affine(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    normalized_shape: ShapeLike,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> Tensor:
    """LayerNorm with parameters in any float dtype; the output has the **parameter** dtype
    (Megatron-style: bf16 activations with fp32 weights give an fp32 output).

    ``input``: ``(*, *normalized_shape)``; ``weight``/``bias``: ``normalized_shape``.
    """
    return _norm("mixed_dtype_fused_layer_norm_affine", input, weight, bias, normalized_shape, eps,
                 memory_efficient, rms=False, mixed=True)


def fused_rms_norm_affine(
    input: Tensor,
    weight: Tensor,
    normalized_shape: ShapeLike,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> Tensor:
    """RMSNorm ``x / sqrt(mean(x^2) + eps) * weight`` over the trailing ``normalized_shape`` dims.

    ``input``: ``(*, *normalized_shape)``; ``weight``: ``normalized_shape``, dtype of ``input``.
    Returns the shape and dtype of ``input``.
    """
    return _norm("fused_rms_norm_affine", input, weight, None, normalized_shape, eps, memory_efficient,
                 rms=True, mixed=False)


def fused_rms_norm(
    input: Tensor, normalized_shape: ShapeLike, eps: float = 1e-6, memory_efficient: bool = False
) -> Tensor:
    """RMSNorm over the trailing ``normalized_shape`` dims without a weight; same shape and dtype."""
    return _norm("fused_rms_norm", input, None, None, normalized_shape, eps, memory_efficient,
                 rms=True, mixed=False)


def mixed_dtype_fused_rms_norm_affine(
    input: Tensor,
    weight: Tensor,
    normalized_shape: ShapeLike,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> Tensor:
    """RMSNorm with a weight of any float dtype; the output has the weight's dtype."""
    return _norm("mixed_dtype_fused_rms_norm_affine", input, weight, None, normalized_shape, eps,
                 memory_efficient, rms=True, mixed=True)


def manual_rms_norm(input: Tensor, normalized_shape: ShapeLike, weight: Tensor | None, eps: float) -> Tensor:
    """Apex's pure-PyTorch RMSNorm (its CPU fallback), kept with Apex's dtype behaviour.

    The mean square is taken in fp32 over the trailing ``len(normalized_shape)`` dims; the scaled input
    is therefore fp32 for half inputs. With a half/bf16 ``weight`` it is cast to the weight dtype before
    the multiply; without a weight it is returned as is (fp32 for half inputs, unlike the fused path).
    """
    shape = _to_shape(normalized_shape)
    dims = tuple(range(-len(shape), 0))
    mean_sq = input.to(torch.float32).pow(2).mean(dims, keepdim=True)
    scaled = input * torch.rsqrt(mean_sq + eps)
    if weight is None:
        return scaled
    if weight.dtype in (torch.float16, torch.bfloat16):
        scaled = scaled.to(weight.dtype)
    return weight * scaled


# ---------------------------------------------------------------------------------------------
# ``*Function`` shims: scripts (Megatron-LM, NeMo) call ``FusedLayerNormAffineFunction.apply(...)``
# directly. These take Apex's positional arguments and skip the autocast cast, as Apex's do.
# ---------------------------------------------------------------------------------------------


class FusedLayerNormAffineFunction:
    """``apply(input, weight, bias, normalized_shape, eps, memory_efficient=False)``; see
    :func:`fused_layer_norm_affine`."""

    @staticmethod
    def apply(input: Tensor, weight: Tensor, bias: Tensor | None, normalized_shape: ShapeLike, eps: float,
              memory_efficient: bool = False) -> Tensor:
        return _norm("FusedLayerNormAffineFunction", input, weight, bias, normalized_shape, eps, memory_efficient,
                     rms=False, mixed=False)


class FusedLayerNormAffineMixedDtypesFunction:
    """``apply(input, weight, bias, normalized_shape, eps, memory_efficient=False)``; output in the
    parameter dtype."""

    @staticmethod
    def apply(input: Tensor, weight: Tensor, bias: Tensor | None, normalized_shape: ShapeLike, eps: float,
              memory_efficient: bool = False) -> Tensor:
        return _norm("FusedLayerNormAffineMixedDtypesFunction", input, weight, bias, normalized_shape, eps,
                     memory_efficient, rms=False, mixed=True)


class FusedLayerNormFunction:
    """``apply(input, normalized_shape, eps, memory_efficient=False)``; see :func:`fused_layer_norm`."""

    @staticmethod
    def apply(input: Tensor, normalized_shape: ShapeLike, eps: float, memory_efficient: bool = False) -> Tensor:
        return _norm("FusedLayerNormFunction", input, None, None, normalized_shape, eps, memory_efficient,
                     rms=False, mixed=False)


class FusedRMSNormAffineFunction:
    """``apply(input, weight, normalized_shape, eps, memory_efficient=False)``."""

    @staticmethod
    def apply(input: Tensor, weight: Tensor, normalized_shape: ShapeLike, eps: float,
              memory_efficient: bool = False) -> Tensor:
        return _norm("FusedRMSNormAffineFunction", input, weight, None, normalized_shape, eps, memory_efficient,
                     rms=True, mixed=False)


class FusedRMSNormAffineMixedDtypesFunction:
    """``apply(input, weight, normalized_shape, eps, memory_efficient=False)``; output in the weight dtype."""

    @staticmethod
    def apply(input: Tensor, weight: Tensor, normalized_shape: ShapeLike, eps: float,
              memory_efficient: bool = False) -> Tensor:
        return _norm("FusedRMSNormAffineMixedDtypesFunction", input, weight, None, normalized_shape, eps,
                     memory_efficient, rms=True, mixed=True)


class FusedRMSNormFunction:
    """``apply(input, normalized_shape, eps, memory_efficient=False)``."""

    @staticmethod
    def apply(input: Tensor, normalized_shape: ShapeLike, eps: float, memory_efficient: bool = False) -> Tensor:
        return _norm("FusedRMSNormFunction", input, None, None, normalized_shape, eps, memory_efficient,
                     rms=True, mixed=False)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


class FusedLayerNorm(torch.nn.Module):
    r"""LayerNorm over the trailing ``normalized_shape`` dims (``apex.normalization.FusedLayerNorm``).

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot \gamma + \beta

    Args:
        normalized_shape: int or sequence; the input must end with these dims.
        eps: added to the variance. Default ``1e-5``.
        elementwise_affine: learnable ``weight`` (ones) and ``bias`` (zeros) of ``normalized_shape``.
        memory_efficient: save the output instead of the input for backward (one activation less).
        device, dtype: factory kwargs for the parameters (a culmen extension, as in ``torch.nn.LayerNorm``).

    Shape: input ``(*, *normalized_shape)``, output the same, in the input dtype (parameters must have the
    input dtype outside autocast; see :class:`MixedFusedLayerNorm`). Works on CPU and GPU, and under
    ``torch.compile`` without graph breaks.
    """

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        memory_efficient: bool = False,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = torch.Size(_to_shape(normalized_shape))
        self.eps = _check_eps(eps)
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        factory = {"device": device, "dtype": dtype}
        if self.elementwise_affine:
            self.weight = Parameter(torch.empty(self.normalized_shape, **factory))
            self.bias = Parameter(torch.empty(self.normalized_shape, **factory))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            init.ones_(self.weight)
            init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        if self.elementwise_affine:
            return fused_layer_norm_affine(input, self.weight, self.bias, self.normalized_shape, self.eps,
                                           self.memory_efficient)
        return fused_layer_norm(input, self.normalized_shape, self.eps, self.memory_efficient)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class FusedRMSNorm(torch.nn.Module):
    r"""RMSNorm over the trailing ``normalized_shape`` dims (``apex.normalization.FusedRMSNorm``).

    .. math:: y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} \cdot \gamma

    Args as :class:`FusedLayerNorm` (``weight`` only, initialised to ones). Shape: input
    ``(*, *normalized_shape)``, output the same, in the input dtype.
    """

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        memory_efficient: bool = False,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = torch.Size(_to_shape(normalized_shape))
        self.eps = _check_eps(eps)
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        if self.elementwise_affine:
            self.weight = Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            init.ones_(self.weight)

    def forward(self, input: Tensor) -> Tensor:
        if self.elementwise_affine:
            return fused_rms_norm_affine(input, self.weight, self.normalized_shape, self.eps, self.memory_efficient)
        return fused_rms_norm(input, self.normalized_shape, self.eps, self.memory_efficient)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


def _mixed_kwargs(cls_name: str, kwargs: dict) -> dict:
    """Apex's handling of ``**kwargs`` in the Mixed modules, plus torch's factory kwargs."""
    if "elementwise_affine" in kwargs:
        warnings.warn(f"{cls_name} does not support `elementwise_affine` argument", stacklevel=3)
        if not kwargs.pop("elementwise_affine"):
            raise RuntimeError(f"{cls_name} does not support `elementwise_affine = False`")
    factory = {k: kwargs.pop(k) for k in ("device", "dtype") if k in kwargs}
    if kwargs:
        # Apex ignores unknown keyword arguments silently; keep accepting them, but say so.
        warnings.warn(f"{cls_name} ignores keyword arguments {sorted(kwargs)}", stacklevel=3)
    return factory


class MixedFusedLayerNorm(FusedLayerNorm):
    """LayerNorm that always has ``weight``/``bias`` and returns the **parameter** dtype.

    ``MixedFusedLayerNorm(normalized_shape, eps=1e-5, *, memory_efficient=False, **kwargs)``; passing
    ``elementwise_affine`` warns, and ``elementwise_affine=False`` raises ``RuntimeError`` (as Apex).
    ``device``/``dtype`` kwargs create the parameters there. Input ``(*, *normalized_shape)`` in any
    float dtype; output the same shape in ``weight.dtype``.
    """

    def __init__(self, normalized_shape: ShapeLike, eps: float = 1e-5, *, memory_efficient: bool = False,
                 **kwargs: Any) -> None:
        factory = _mixed_kwargs("MixedFusedLayerNorm", kwargs)
        super().__init__(normalized_shape=normalized_shape, eps=eps, elementwise_affine=True,
                         memory_efficient=memory_efficient, **factory)

    def forward(self, input: Tensor) -> Tensor:
        return mixed_dtype_fused_layer_norm_affine(input, self.weight, self.bias, self.normalized_shape, self.eps,
                                                   self.memory_efficient)


class MixedFusedRMSNorm(FusedRMSNorm):
    """RMSNorm that always has ``weight`` and returns the weight dtype; arguments as
    :class:`MixedFusedLayerNorm`."""

    def __init__(self, normalized_shape: ShapeLike, eps: float = 1e-5, *, memory_efficient: bool = False,
                 **kwargs: Any) -> None:
        factory = _mixed_kwargs("MixedFusedRMSNorm", kwargs)
        super().__init__(normalized_shape=normalized_shape, eps=eps, elementwise_affine=True,
                         memory_efficient=memory_efficient, **factory)

    def forward(self, input: Tensor) -> Tensor:
        return mixed_dtype_fused_rms_norm_affine(input, self.weight, self.normalized_shape, self.eps,
                                                 self.memory_efficient)
