"""``apex.contrib.torchsched.ops.layer_norm``: LayerNorm returning its statistics, with an explicit backward.

Apex runs these through the cuDNN frontend (``cudnn`` Python package: a handle, a stream, compiled graphs).
culmen has no cuDNN-frontend dependency: ``layer_norm`` / ``layer_norm_backward`` compute the same results with
PyTorch's native LayerNorm kernels (``aten.native_layer_norm`` and its backward), on any device and float dtype;
``CuDNNManager``, ``get_cudnn_manager`` and ``LayerNormGraphFactory`` (cuDNN-frontend handles and graphs) raise
``NotImplementedError`` naming these functions. culmen's pre-grad pass ``"cudnn_layer_norm"``
(``culmen.contrib.torchsched.passes``) uses culmen's fused LayerNorm op instead.

Shapes: ``x`` ``(*batch, *normalized_shape)``; ``m = prod(batch)``; statistics ``x_mean`` / ``x_invstd`` are
float32 ``(m, 1, 1, 1)`` (Apex's layout); ``weight`` / ``bias`` ``normalized_shape``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["get_cudnn_manager"]

_NO_CUDNN_FRONTEND = ("culmen does not use the cuDNN frontend; call culmen.contrib.torchsched.ops.layer_norm."
                      "layer_norm / layer_norm_backward (PyTorch's native kernels), or culmen.normalization."
                      "FusedLayerNorm for a module")


class CuDNNManager:
    """Apex: owner of a cuDNN-frontend handle and stream. Raises ``NotImplementedError`` (no cuDNN frontend)."""

    def __init__(self) -> None:
        raise NotImplementedError(f"CuDNNManager: {_NO_CUDNN_FRONTEND}")


def get_cudnn_manager() -> CuDNNManager:
    """Apex: the process-wide ``CuDNNManager``. Raises ``NotImplementedError`` (no cuDNN frontend)."""
    raise NotImplementedError(f"get_cudnn_manager: {_NO_CUDNN_FRONTEND}")


class LayerNormGraphFactory:
    """Apex: cache of compiled cuDNN-frontend LayerNorm graphs; its ``get_forward_graph`` /
    ``get_backward_graph`` raise ``NotImplementedError`` (no cuDNN frontend)."""

    @classmethod
    def get_forward_graph(cls, m: int, n: int, xdtype: torch.dtype, wdtype: torch.dtype) -> Any:
        raise NotImplementedError(f"LayerNormGraphFactory.get_forward_graph: {_NO_CUDNN_FRONTEND}")

    @classmethod
    def get_backward_graph(cls, m: int, n: int, xdtype: torch.dtype, wdtype: torch.dtype) -> Any:
        raise NotImplementedError(f"LayerNormGraphFactory.get_backward_graph: {_NO_CUDNN_FRONTEND}")


def _rows(x: Tensor, normalized_shape: list[int]) -> int:
    shape = tuple(int(s) for s in normalized_shape)
    if not shape or tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise ValueError(f"x.shape[-{len(shape)}:] must equal normalized_shape, got x.shape={tuple(x.shape)}, "
                         f"normalized_shape={list(normalized_shape)}")
    return math.prod(x.shape[: x.dim() - len(shape)])


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def layer_norm(x: Tensor, normalized_shape: list[int], weight: Tensor, bias: Tensor,
               eps: float = 1e-05) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, x_mean, x_invstd)``: ``y = (x - mean) * invstd * weight + bias`` over the trailing
    ``normalized_shape`` dims (``x``'s shape and dtype), statistics float32 ``(m, 1, 1, 1)``. Differentiable
    through PyTorch's LayerNorm autograd."""
    m = _rows(x, normalized_shape)
    if weight is None or bias is None or weight.dtype != bias.dtype:
        raise ValueError("weight and bias must be given, with the same dtype")
    c = _compute_dtype(x)
    # fp16/bf16 run in fp32 so the statistics are fp32-accurate (PyTorch's CPU kernel keeps them in x's dtype).
    y, mean, rstd = torch.native_layer_norm(x.to(c), list(normalized_shape), weight.to(c), bias.to(c), eps)
    return y.to(x.dtype), mean.float().reshape(m, 1, 1, 1), rstd.float().reshape(m, 1, 1, 1)


def layer_norm_fake(x: Tensor, normalized_shape: list[int], weight: Tensor, bias: Tensor,
                    eps: float = 1e-05) -> tuple[Tensor, Tensor, Tensor]:
    """Uninitialized outputs with ``layer_norm``'s shapes, dtypes and device (a fake / meta implementation)."""
    m = _rows(x, normalized_shape)
    stat = torch.empty(m, 1, 1, 1, dtype=torch.float32, device=x.device)
    return torch.empty_like(x), stat, torch.empty_like(stat)


def layer_norm_backward(d_y: Tensor, x_mean: Tensor, x_invstd: Tensor, x: Tensor, normalized_shape: list[int],
                        weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(d_x, d_weight, d_bias)`` of ``layer_norm`` from the upstream gradient ``d_y`` (``x``'s shape) and the
    saved statistics (``(m, 1, 1, 1)`` float32, as ``layer_norm`` returns them)."""
    _rows(x, normalized_shape)
    stat_shape = (*x.shape[: x.dim() - len(normalized_shape)], *([1] * len(normalized_shape)))
    c = _compute_dtype(x)
    mean = x_mean.reshape(stat_shape).to(c)
    rstd = x_invstd.reshape(stat_shape).to(c)
    d_x, d_w, d_b = torch.ops.aten.native_layer_norm_backward(d_y.to(c).contiguous(), x.to(c), list(normalized_shape),
                                                              mean, rstd, weight.to(c), bias.to(c), [True, True, True])
    return d_x.to(x.dtype), d_w.to(weight.dtype), d_b.to(bias.dtype)


def layer_norm_backward_fake(d_y: Tensor, x_mean: Tensor, x_invstd: Tensor, x: Tensor, normalized_shape: list[int],
                             weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Uninitialized outputs with ``layer_norm_backward``'s shapes and dtypes."""
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias)


def layer_norm_setup_context(ctx: Any, inputs: tuple, output: tuple) -> Tensor:
    """Autograd setup for ``layer_norm`` (``torch.library.register_autograd`` style): saves ``x``, ``weight``,
    ``bias`` and the statistics on ``ctx`` and returns ``y``."""
    x, normalized_shape, weight, bias, _eps = inputs
    y, x_mean, x_invstd = output
    ctx.save_for_backward(x, weight, bias, x_mean, x_invstd)
    ctx.normalized_shape = list(normalized_shape)
    return y


def layer_norm_backward_wrapper(ctx: Any, d_y: Tensor, d_x_mean: Tensor | None,
                                d_x_invstd: Tensor | None) -> tuple[Tensor, None, Tensor, Tensor, None]:
    """Autograd backward for ``layer_norm`` (gradients of the statistics outputs are ignored, as in Apex):
    ``(d_x, None, d_weight, d_bias, None)`` for ``(x, normalized_shape, weight, bias, eps)``."""
    x, weight, bias, x_mean, x_invstd = ctx.saved_tensors
    d_x, d_w, d_b = layer_norm_backward(d_y, x_mean, x_invstd, x, ctx.normalized_shape, weight, bias)
    return d_x, None, d_w, d_b, None
