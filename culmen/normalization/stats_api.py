"""Apex's functional normalization API with explicit statistics (``apex.normalization.fused_layer_norm``'s
``fused_layer_norm_affine_fwd`` / ``_bwd``, ``fused_rms_norm_affine_fwd`` / ``_bwd``, ``fused_layer_norm_fwd``
/ ``_bwd``, ``fused_rms_norm_fwd`` / ``_bwd``, their ``*_fake`` shape functions and ``supports_custom_op``).

Forward functions return the output and the per-row statistics Apex's kernels keep (``mean`` and
``invvar = 1 / sqrt(var + eps)``, flat ``(rows,)``, fp32 for 16-bit inputs); backward functions take them
back with the input (or, ``memory_efficient``, the output) and return the gradients. This API serves code
that calls Apex's custom ops by name; it is written in PyTorch with fp32 statistics and accumulation (the
outputs are differentiable through those ops), not on culmen's fused kernels, which the modules and the
``fused_layer_norm*`` / ``fused_rms_norm*`` functions use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "fused_layer_norm_affine_bwd", "fused_layer_norm_affine_bwd_fake", "fused_layer_norm_affine_fwd",
    "fused_layer_norm_affine_fwd_fake", "fused_layer_norm_bwd", "fused_layer_norm_bwd_fake", "fused_layer_norm_fwd",
    "fused_layer_norm_fwd_fake", "fused_rms_norm_affine_bwd", "fused_rms_norm_affine_bwd_fake",
    "fused_rms_norm_affine_fwd", "fused_rms_norm_affine_fwd_fake", "fused_rms_norm_bwd", "fused_rms_norm_bwd_fake",
    "fused_rms_norm_fwd", "fused_rms_norm_fwd_fake", "supports_custom_op",
]


def supports_custom_op() -> bool:
    """Whether this torch has ``torch.library.custom_op`` (Apex registers the functions as custom ops then)."""
    return hasattr(torch.library, "custom_op")


def _rows(x: Tensor, normalized_shape: Sequence[int]) -> tuple[Tensor, int]:
    shape = tuple(int(s) for s in normalized_shape)
    if tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise ValueError(f"normalized_shape {list(shape)} must be the trailing dims of input {tuple(x.shape)}")
    n = math.prod(shape)
    return x.reshape(-1, n), n


def _stat_dtype(x: Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _forward(x: Tensor, weight: Tensor | None, bias: Tensor | None, normalized_shape, eps: float, rms: bool):
    x2, n = _rows(x, normalized_shape)
    acc = x2.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    mean = None if rms else acc.mean(-1)
    centered = acc if rms else acc - mean[:, None]
    invvar = torch.rsqrt(centered.square().mean(-1) + eps)
    y = centered * invvar[:, None]
    if weight is not None:
        y = y * weight.reshape(-1).to(y.dtype)
    if bias is not None:
        y = y + bias.reshape(-1).to(y.dtype)
    st = _stat_dtype(x)
    out = y.to(x.dtype).reshape(x.shape)
    return out, (None if mean is None else mean.to(st)), invvar.to(st)


def _backward(dy: Tensor, mean: Tensor | None, invvar: Tensor, x_or_y: Tensor, normalized_shape,
              weight: Tensor | None, bias: Tensor | None, memory_efficient: bool, rms: bool):
    g2, n = _rows(dy, normalized_shape)
    src, _ = _rows(x_or_y, normalized_shape)
    ft = torch.float64 if x_or_y.dtype == torch.float64 else torch.float32
    g2, src, inv = g2.to(ft), src.to(ft), invvar.reshape(-1).to(ft)[:, None]
    w = weight.reshape(-1).to(ft) if weight is not None else None
    if memory_efficient:  # the normalized input from the output: (y - b) / w
        xhat = src - bias.reshape(-1).to(ft) if bias is not None else src
        xhat = xhat / w if w is not None else xhat
    else:
        xhat = (src if rms else src - mean.reshape(-1).to(ft)[:, None]) * inv
    gw = g2 * w if w is not None else g2
    proj = (gw * xhat).mean(-1, keepdim=True)
    dx = inv * (gw - xhat * proj if rms else gw - gw.mean(-1, keepdim=True) - xhat * proj)
    dx = dx.to(dy.dtype).reshape(x_or_y.shape)
    dw = (g2 * xhat).sum(0).to(weight.dtype).reshape(weight.shape) if weight is not None else None
    db = g2.sum(0).to(bias.dtype).reshape(bias.shape) if bias is not None else None
    return dx, dw, db


def fused_layer_norm_affine_fwd(input: Tensor, weight: Tensor, bias: Tensor, normalized_shape: list[int],  # noqa: A002
                                eps: float, memory_efficient: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm with weight and bias: ``(output like input, mean (rows,), invvar (rows,))``."""
    return _forward(input, weight, bias, normalized_shape, eps, False)


def fused_layer_norm_affine_bwd(grad_output: Tensor, mean: Tensor, invvar: Tensor, input_or_output: Tensor,
                                normalized_shape: list[int], weight: Tensor, bias: Tensor, eps: float,
                                memory_efficient: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_input, grad_weight, grad_bias)`` of ``fused_layer_norm_affine_fwd`` (``input_or_output``: the
    output when ``memory_efficient``, then ``mean`` is not read)."""
    return _backward(grad_output, mean, invvar, input_or_output, normalized_shape, weight, bias, memory_efficient,
                     False)


def fused_rms_norm_affine_fwd(input: Tensor, weight: Tensor, normalized_shape: list[int], eps: float,  # noqa: A002
                              memory_efficient: bool = False) -> tuple[Tensor, Tensor]:
    """RMSNorm with weight: ``(output like input, invvar (rows,))``."""
    out, _, invvar = _forward(input, weight, None, normalized_shape, eps, True)
    return out, invvar


def fused_rms_norm_affine_bwd(grad_output: Tensor, invvar: Tensor, input_or_output: Tensor,
                              normalized_shape: list[int], weight: Tensor, eps: float,
                              memory_efficient: bool = False) -> tuple[Tensor, Tensor]:
    """``(grad_input, grad_weight)`` of ``fused_rms_norm_affine_fwd``."""
    dx, dw, _ = _backward(grad_output, None, invvar, input_or_output, normalized_shape, weight, None,
                          memory_efficient, True)
    return dx, dw


def fused_layer_norm_fwd(input: Tensor, normalized_shape: list[int], eps: float,  # noqa: A002
                         memory_efficient: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm without parameters: ``(output, mean, invvar)``."""
    return _forward(input, None, None, normalized_shape, eps, False)


def fused_layer_norm_bwd(grad_output: Tensor, mean: Tensor, invvar: Tensor, input_or_output: Tensor,
                         normalized_shape: list[int], eps: float, memory_efficient: bool = False) -> Tensor:
    """``grad_input`` of ``fused_layer_norm_fwd``."""
    return _backward(grad_output, mean, invvar, input_or_output, normalized_shape, None, None, memory_efficient,
                     False)[0]


def fused_rms_norm_fwd(input: Tensor, normalized_shape: list[int], eps: float,  # noqa: A002
                       memory_efficient: bool = False) -> tuple[Tensor, Tensor]:
    """RMSNorm without weight: ``(output, invvar)``."""
    out, _, invvar = _forward(input, None, None, normalized_shape, eps, True)
    return out, invvar


def fused_rms_norm_bwd(grad_output: Tensor, invvar: Tensor, input_or_output: Tensor, normalized_shape: list[int],
                       eps: float, memory_efficient: bool = False) -> Tensor:
    """``grad_input`` of ``fused_rms_norm_fwd``."""
    return _backward(grad_output, None, invvar, input_or_output, normalized_shape, None, None, memory_efficient,
                     True)[0]


# Shape functions (Apex's fake implementations for tracing): empty tensors of the outputs' shapes and dtypes.

def _stats_like(x: Tensor, normalized_shape) -> Tensor:
    rows = x.numel() // max(1, math.prod(int(s) for s in normalized_shape))
    return torch.empty(rows, dtype=_stat_dtype(x), device=x.device)


def fused_layer_norm_affine_fwd_fake(input, weight, bias, normalized_shape, eps, memory_efficient=False):  # noqa: A002
    return torch.empty_like(input), _stats_like(input, normalized_shape), _stats_like(input, normalized_shape)


def fused_layer_norm_affine_bwd_fake(grad_output, mean, invvar, input_or_output, normalized_shape, weight, bias, eps,
                                     memory_efficient=False):
    return torch.empty_like(input_or_output), torch.empty_like(weight), torch.empty_like(bias)


def fused_rms_norm_affine_fwd_fake(input, weight, normalized_shape, eps, memory_efficient=False):  # noqa: A002
    return torch.empty_like(input), _stats_like(input, normalized_shape)


def fused_rms_norm_affine_bwd_fake(grad_output, invvar, input_or_output, normalized_shape, weight, eps,
                                   memory_efficient=False):
    return torch.empty_like(input_or_output), torch.empty_like(weight)


def fused_layer_norm_fwd_fake(input, normalized_shape, eps, memory_efficient=False):  # noqa: A002
    return torch.empty_like(input), _stats_like(input, normalized_shape), _stats_like(input, normalized_shape)


def fused_layer_norm_bwd_fake(grad_output, mean, invvar, input_or_output, normalized_shape, eps,
                              memory_efficient=False):
    return torch.empty_like(input_or_output)


def fused_rms_norm_fwd_fake(input, normalized_shape, eps, memory_efficient=False):  # noqa: A002
    return torch.empty_like(input), _stats_like(input, normalized_shape)


def fused_rms_norm_bwd_fake(grad_output, invvar, input_or_output, normalized_shape, eps, memory_efficient=False):
    return torch.empty_like(input_or_output)
