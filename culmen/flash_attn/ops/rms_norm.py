"""flash_attn's legacy ``flash_attn.ops.rms_norm``: the RMSNorm flavour of ``flash_attn.ops.layer_norm``.

Same arguments, conventions and returns as the LayerNorm functions there, with
``y = x / sqrt(mean(x^2) + eps) * weight (+ bias)``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import init

from culmen.flash_attn.ops.layer_norm import (
    LegacyReturn,
    _dropout_add_norm,
    _dropout_add_norm_parallel,
    _dropout_add_norm_subset,
)

__all__ = [
    "rms_norm",
    "dropout_add_rms_norm",
    "dropout_add_rms_norm_subset",
    "dropout_add_rms_norm_parallel_residual",
    "DropoutAddRMSNorm",
    "RMSNorm",
]


def rms_norm(x: Tensor, weight: Tensor, epsilon: float) -> Tensor:
    """RMSNorm over the last dim: ``x`` ``(..., N)``, ``weight`` ``(N,)``; returns the dtype of ``x``."""
    return dropout_add_rms_norm(x, None, weight, None, 0.0, epsilon)


def dropout_add_rms_norm(
    x0: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    bias: Tensor | None,
    dropout_p: float,
    epsilon: float,
    rowscale: Tensor | None = None,
    layerscale: Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    return_dropout_mask: bool = False,
) -> LegacyReturn:
    """``RMSNorm(dropout(x0 * rowscale * layerscale) + residual)``; see
    :func:`culmen.flash_attn.ops.layer_norm.dropout_add_layer_norm` for shapes and returns."""
    return _dropout_add_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale, layerscale, prenorm,
                             residual_in_fp32, return_dropout_mask, True)


def dropout_add_rms_norm_subset(
    x0: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    bias: Tensor | None,
    dropout_p: float,
    epsilon: float,
    layerscale: Tensor | None = None,
    x0_subset: Tensor | None = None,
    out_subset: Tensor | None = None,
    rowscale_const: float = 1.0,
    out_numrows: int = 0,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    return_dropout_mask: bool = False,
) -> LegacyReturn:
    """RMSNorm version of :func:`culmen.flash_attn.ops.layer_norm.dropout_add_layer_norm_subset`."""
    return _dropout_add_norm_subset(x0, residual, weight, bias, dropout_p, epsilon, layerscale, x0_subset,
                                    out_subset, rowscale_const, out_numrows, prenorm, residual_in_fp32,
                                    return_dropout_mask, True)


def dropout_add_rms_norm_parallel_residual(
    x0: Tensor,
    x1: Tensor | None,
    residual: Tensor | None,
    weight0: Tensor,
    bias0: Tensor | None,
    weight1: Tensor | None,
    bias1: Tensor | None,
    dropout_p: float,
    epsilon: float,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    return_dropout_mask: bool = False,
) -> LegacyReturn:
    """RMSNorm version of
    :func:`culmen.flash_attn.ops.layer_norm.dropout_add_layer_norm_parallel_residual`."""
    return _dropout_add_norm_parallel(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, prenorm,
                                      residual_in_fp32, return_dropout_mask, True)


class DropoutAddRMSNorm(torch.nn.Module):
    """``RMSNorm(dropout(x0) + residual)`` with a learnable ``weight`` (ones; ``bias`` is ``None``).

    Arguments and ``forward(x0, residual=None)`` as
    :class:`culmen.flash_attn.ops.layer_norm.DropoutAddLayerNorm`.
    """

    def __init__(self, hidden_size: int, prenorm: bool = False, p: float = 0.0, eps: float = 1e-5,
                 residual_in_fp32: bool = False, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.prenorm = prenorm
        self.p = p
        self.epsilon = eps
        self.residual_in_fp32 = residual_in_fp32
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    @property
    def eps(self) -> float:
        return self.epsilon

    def reset_parameters(self) -> None:
        init.ones_(self.weight)

    def forward(self, x0: Tensor, residual: Tensor | None = None) -> LegacyReturn:
        return dropout_add_rms_norm(x0, residual, self.weight, None, self.p if self.training else 0.0, self.epsilon,
                                    prenorm=self.prenorm, residual_in_fp32=self.residual_in_fp32)


class RMSNorm(torch.nn.Module):
    """Plain RMSNorm module over the last dim: ``weight`` ``(hidden_size,)`` initialised to ones.

    ``forward(x)``: ``x`` ``(..., hidden_size)``; returns the same shape in ``x``'s dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)
