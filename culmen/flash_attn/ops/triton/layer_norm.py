"""``flash_attn.ops.triton.layer_norm`` (flash_attn 2.8) on culmen's fused norm op.

``layer_norm_fn`` / ``rms_norm_fn`` compute ``norm(dropout(x * rowscale) + dropout(x1) + residual)``
over the last dim, optionally with a second affine output (``weight1``/``bias1``), the pre-norm sum
(``prenorm``), the dropout masks, zero-centred weights and an fp32 residual stream, with flash_attn's
argument names, defaults and return conventions. They call :func:`culmen.ops.layer_norm.layer_norm`.

Differences from flash_attn 2.8:

* ``rowscale`` may be combined with ``x1`` (it scales ``x`` only); flash_attn asserts it is ``None``.
* ``weight`` may be ``None`` (no affine scale).
* ``out`` / ``residual_out`` buffers are filled with ``copy_`` after the op rather than written by the
  kernel, so they cost one extra pass; a given ``residual_out`` is always filled (flash_attn 2.8 drops
  it and returns ``x`` when no residual output is needed).
* ``layer_norm_linear_fn`` keeps the normalized activations for the linear's backward instead of
  recomputing them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from culmen.ops.layer_norm import layer_norm
from culmen.ops.layer_norm.reference import layer_norm_ref, rms_norm_ref

__all__ = [
    "layer_norm_fn",
    "rms_norm_fn",
    "layer_norm_linear_fn",
    "LayerNormFn",
    "LayerNormLinearFn",
    "RMSNorm",
    "layer_norm_ref",
    "rms_norm_ref",
]

NormReturn = Tensor | tuple[Tensor | None, ...]


def _check_buffer(name: str, buf: Tensor | None, x: Tensor) -> None:
    if buf is None:
        return
    if not isinstance(buf, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(buf).__name__}")
    if buf.shape != x.shape:
        raise ValueError(f"{name} must have the shape of x {tuple(x.shape)}, got {tuple(buf.shape)}")
    if buf.device != x.device:
        raise ValueError(f"{name} is on {buf.device} but x is on {x.device}")


def layer_norm_fn(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None = None,
    x1: Tensor | None = None,
    weight1: Tensor | None = None,
    bias1: Tensor | None = None,
    eps: float = 1e-6,
    dropout_p: float = 0.0,
    rowscale: Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    zero_centered_weight: bool = False,
    is_rms_norm: bool = False,
    return_dropout_mask: bool = False,
    out_dtype: torch.dtype | None = None,
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
) -> NormReturn:
    """Fused dropout + add + LayerNorm / RMSNorm over the last dim.

    Args:
        x: ``(..., N)`` fp16/bf16/fp32/fp64. residual, x1: like ``x`` or ``None``.
        weight, bias, weight1, bias1: ``(N,)`` any float dtype, or ``None``.
        eps: added to the variance. dropout_p: in ``[0, 1)``, applied to ``x`` and ``x1``.
        rowscale: ``x.shape[:-1]``, scales ``x`` before dropout.
        prenorm: also return the pre-norm sum (in the residual dtype).
        residual_in_fp32: without ``residual``, keep the pre-norm sum in fp32.
        zero_centered_weight: use ``1 + weight`` (and ``1 + weight1``).
        is_rms_norm: RMSNorm instead of LayerNorm.
        return_dropout_mask: also return the bool keep-masks of ``x`` and ``x1`` (``None`` where absent).
        out_dtype: dtype of the outputs (default ``x.dtype``; ``out.dtype`` when ``out`` is given).
        out, residual_out: preallocated ``x``-shaped buffers, filled and returned.

    Returns ``y``, or a tuple ``(y[, y1][, residual_out][, dropout_mask, dropout_mask1])``: ``y1`` when
    ``weight1`` is given, ``residual_out`` when ``prenorm``, the masks when ``return_dropout_mask``.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    _check_buffer("out", out, x)
    _check_buffer("residual_out", residual_out, x)
    if out is not None:
        out_dtype = out.dtype
    if residual_out is not None and residual is None and residual_out.dtype == torch.float32:
        # The buffer's dtype names the residual stream's dtype, as the kernel would write it.
        residual_in_fp32 = True
    res = layer_norm(
        x, weight, bias, residual=residual, x1=x1, weight1=weight1, bias1=bias1, eps=eps, dropout_p=dropout_p,
        rowscale=rowscale, is_rms_norm=is_rms_norm, zero_centered_weight=zero_centered_weight,
        residual_in_fp32=residual_in_fp32, out_dtype=out_dtype, return_residual=prenorm or residual_out is not None,
        return_dropout_mask=return_dropout_mask,
    )
    y, y1, pre = res.y, res.y1, res.residual_out
    if out is not None:
        y = out.copy_(y)
    if residual_out is not None:
        pre = residual_out.copy_(pre)
    ret: list[Tensor | None] = [y]
    if weight1 is not None:
        ret.append(y1)
    if prenorm:
        ret.append(pre)
    if return_dropout_mask:
        ret += [res.dropout_mask, res.dropout_mask1]
    return ret[0] if len(ret) == 1 else tuple(ret)


def rms_norm_fn(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None = None,
    x1: Tensor | None = None,
    weight1: Tensor | None = None,
    bias1: Tensor | None = None,
    eps: float = 1e-6,
    dropout_p: float = 0.0,
    rowscale: Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    zero_centered_weight: bool = False,
    return_dropout_mask: bool = False,
    out_dtype: torch.dtype | None = None,
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
) -> NormReturn:
    """:func:`layer_norm_fn` with ``is_rms_norm=True``; same arguments, shapes and returns."""
    return layer_norm_fn(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                         residual_in_fp32, zero_centered_weight, True, return_dropout_mask, out_dtype, out,
                         residual_out)


class LayerNormFn:
    """Stand-in for flash_attn's autograd function, for scripts that call ``LayerNormFn.apply`` with
    its positional arguments ``(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale,
    prenorm, residual_in_fp32, zero_centered_weight, is_rms_norm, return_dropout_mask, out_dtype, out,
    residual_out)``. Returns what :func:`layer_norm_fn` returns."""

    @staticmethod
    def apply(x: Tensor, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None = None,
              x1: Tensor | None = None, weight1: Tensor | None = None, bias1: Tensor | None = None,
              eps: float = 1e-6, dropout_p: float = 0.0, rowscale: Tensor | None = None, prenorm: bool = False,
              residual_in_fp32: bool = False, zero_centered_weight: bool = False, is_rms_norm: bool = False,
              return_dropout_mask: bool = False, out_dtype: torch.dtype | None = None, out: Tensor | None = None,
              residual_out: Tensor | None = None) -> NormReturn:
        return layer_norm_fn(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                             residual_in_fp32, zero_centered_weight, is_rms_norm, return_dropout_mask, out_dtype,
                             out, residual_out)


class RMSNorm(torch.nn.Module):
    """flash_attn's Triton ``RMSNorm`` module (weight only; ``bias`` is registered as ``None``).

    Args:
        hidden_size: size of the last dim. eps: added to the mean square (default ``1e-5``).
        dropout_p: dropout on the input before the residual add, only in training mode.
        zero_centered_weight: the weight is stored as ``weight - 1`` (initialised to zeros).
        device, dtype: factory kwargs for ``weight``.

    ``forward(x, residual=None, prenorm=False, residual_in_fp32=False)``: ``x``/``residual``
    ``(..., hidden_size)``; returns ``y`` (dtype of ``x``) or ``(y, residual_out)`` with ``prenorm``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, dropout_p: float = 0.0,
                 zero_centered_weight: bool = False, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.drop = torch.nn.Dropout(dropout_p) if dropout_p > 0.0 else None
        self.zero_centered_weight = zero_centered_weight
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.zero_centered_weight:
            torch.nn.init.zeros_(self.weight)
        else:
            torch.nn.init.ones_(self.weight)

    def forward(self, x: Tensor, residual: Tensor | None = None, prenorm: bool = False,
                residual_in_fp32: bool = False) -> NormReturn:
        return rms_norm_fn(
            x, self.weight, self.bias, residual=residual, eps=self.eps,
            dropout_p=self.drop.p if (self.drop is not None and self.training) else 0.0,
            prenorm=prenorm, residual_in_fp32=residual_in_fp32, zero_centered_weight=self.zero_centered_weight,
        )


def layer_norm_linear_fn(
    x: Tensor,
    norm_weight: Tensor | None,
    norm_bias: Tensor | None,
    linear_weight: Tensor,
    linear_bias: Tensor | None,
    residual: Tensor | None = None,
    eps: float = 1e-6,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    is_rms_norm: bool = False,
) -> NormReturn:
    """``F.linear(norm(x + residual), linear_weight, linear_bias)``.

    Args:
        x, residual: ``(..., N)``. norm_weight, norm_bias: ``(N,)``.
        linear_weight: ``(out_features, N)``; linear_bias: ``(out_features,)`` or ``None``.

    Under autocast for ``x``'s device type the norm writes the autocast dtype and the linear runs in it
    (flash_attn's behaviour); otherwise the linear runs in ``x``'s dtype. Returns ``out``
    ``(..., out_features)``, or ``(out, residual_out)`` with ``prenorm``.
    """
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    res = layer_norm(x, norm_weight, norm_bias, residual=residual, eps=eps, is_rms_norm=is_rms_norm,
                     residual_in_fp32=residual_in_fp32, out_dtype=dtype, return_residual=prenorm)
    y = res.y
    w = linear_weight.to(y.dtype)
    b = linear_bias.to(y.dtype) if linear_bias is not None else None
    out = F.linear(y, w, b)
    return out if not prenorm else (out, res.residual_out)


class LayerNormLinearFn:
    """Stand-in for flash_attn's ``LayerNormLinearFn``: ``apply(x, norm_weight, norm_bias, linear_weight,
    linear_bias, residual=None, eps=1e-6, prenorm=False, residual_in_fp32=False, is_rms_norm=False)``."""

    @staticmethod
    def apply(x: Tensor, norm_weight: Tensor | None, norm_bias: Tensor | None, linear_weight: Tensor,
              linear_bias: Tensor | None, residual: Tensor | None = None, eps: float = 1e-6, prenorm: bool = False,
              residual_in_fp32: bool = False, is_rms_norm: bool = False) -> NormReturn:
        return layer_norm_linear_fn(x, norm_weight, norm_bias, linear_weight, linear_bias, residual, eps, prenorm,
                                    residual_in_fp32, is_rms_norm)
