"""``apex.contrib.layer_norm.layer_norm`` on culmen's fused norm op.

Apex's ``FastLayerNorm`` is a persistent CUDA kernel compiled for 26 hidden sizes (768 ... 65536).
culmen's version accepts any hidden size and runs on CPU too. As in Apex, the output has the
parameter dtype (``weight``/``bias`` must share one dtype) and the input is viewed as
``(-1, hidden_size)``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import init

from culmen.normalization.fused_layer_norm import _autocast_off, _cast_if_autocast_enabled
from culmen.ops.layer_norm import layer_norm

__all__ = ["FastLayerNorm", "FastLayerNormFN", "FastRMSNorm", "FastRMSNormFN", "_fast_layer_norm", "_fast_rms_norm"]


def _fast_ln(x: Tensor, gamma: Tensor, beta: Tensor, epsilon: float, memory_efficient: bool) -> Tensor:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"FastLayerNorm: x must be a floating-point tensor, got {got}")
    hidden_size = gamma.numel()
    if beta.numel() != hidden_size:
        raise ValueError(f"FastLayerNorm: weight has {hidden_size} elements but bias has {beta.numel()}")
    if beta.dtype != gamma.dtype:
        raise TypeError(f"FastLayerNorm: weight dtype {gamma.dtype} and bias dtype {beta.dtype} must match")
    if x.dim() == 0 or x.shape[-1] != hidden_size:
        raise ValueError(
            f"FastLayerNorm: the last dim of x (shape {tuple(x.shape)}) must equal hidden_size {hidden_size}"
        )
    return layer_norm(x, gamma, beta, eps=epsilon, out_dtype=gamma.dtype, memory_efficient=bool(memory_efficient)).y


class FastLayerNormFN:
    """Stand-in for Apex's autograd function: ``FastLayerNormFN.apply(x, gamma, beta, epsilon,
    memory_efficient=False)`` returns the normalized ``x`` (same shape, dtype of ``gamma``).
    Differentiable for ``x``, ``gamma`` and ``beta``; no autocast cast (as Apex's)."""

    @staticmethod
    def apply(x: Tensor, gamma: Tensor, beta: Tensor, epsilon: float, memory_efficient: bool = False) -> Tensor:
        return _fast_ln(x, gamma, beta, epsilon, memory_efficient)


def _fast_layer_norm(x: Tensor, weight: Tensor, bias: Tensor, epsilon: float,
                     memory_efficient: bool = False) -> Tensor:
    """LayerNorm of ``x`` (``(..., hidden_size)``) over its last dim with ``weight``/``bias``
    (``(hidden_size,)``, one float dtype, which is also the output dtype).

    Under autocast for ``x``'s device type all tensors are cast to the autocast dtype first, as in Apex.
    ``memory_efficient`` saves the output instead of the input for backward.
    """
    device_type = x.device.type if isinstance(x, Tensor) else "cpu"
    x, weight, bias = _cast_if_autocast_enabled(device_type, x, weight, bias)
    with _autocast_off(device_type):
        return _fast_ln(x, weight, bias, epsilon, memory_efficient)


class FastLayerNorm(torch.nn.Module):
    """``apex.contrib.layer_norm.FastLayerNorm``: LayerNorm over the last dim.

    Args:
        hidden_size: size of the last dim (any value; Apex accepts only a fixed list).
        eps: added to the variance (stored as ``self.epsilon``, as in Apex).
        memory_efficient: save the output instead of the input for backward.
        device, dtype: factory kwargs for ``weight`` (ones) and ``bias`` (zeros); a culmen extension.

    Shape: input ``(*, hidden_size)``; output the same shape in the parameter dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, memory_efficient: bool = False,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.epsilon = eps
        self.memory_efficient = memory_efficient
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.ones_(self.weight)
        init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return _fast_layer_norm(x, self.weight, self.bias, self.epsilon, self.memory_efficient)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.epsilon}, memory_efficient={self.memory_efficient}"


def _fast_rms(x: Tensor, gamma: Tensor, epsilon: float, memory_efficient: bool) -> Tensor:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"FastRMSNorm: x must be a floating-point tensor, got {got}")
    hidden_size = gamma.numel()
    if x.dim() == 0 or x.shape[-1] != hidden_size:
        raise ValueError(
            f"FastRMSNorm: the last dim of x (shape {tuple(x.shape)}) must equal hidden_size {hidden_size}"
        )
    return layer_norm(x, gamma, None, eps=epsilon, is_rms_norm=True, out_dtype=gamma.dtype,
                      memory_efficient=bool(memory_efficient)).y


class FastRMSNormFN:
    """Stand-in for Apex's autograd function: ``FastRMSNormFN.apply(x, gamma, epsilon, memory_efficient=False)``
    returns ``x / rms(x) * gamma`` (same shape, dtype of ``gamma``); no autocast cast (as Apex's)."""

    @staticmethod
    def apply(x: Tensor, gamma: Tensor, epsilon: float, memory_efficient: bool = False) -> Tensor:
        return _fast_rms(x, gamma, epsilon, memory_efficient)


def _fast_rms_norm(x: Tensor, weight: Tensor, epsilon: float, memory_efficient: bool = False) -> Tensor:
    """RMSNorm of ``x`` (``(..., hidden_size)``) over its last dim with ``weight`` (``(hidden_size,)``, whose
    dtype is the output dtype). Under autocast both are cast to the autocast dtype first, as in Apex."""
    device_type = x.device.type if isinstance(x, Tensor) else "cpu"
    x, weight = _cast_if_autocast_enabled(device_type, x, weight)
    with _autocast_off(device_type):
        return _fast_rms(x, weight, epsilon, memory_efficient)


class FastRMSNorm(torch.nn.Module):
    """``apex.contrib.layer_norm.FastRMSNorm``: RMSNorm over the last dim (no bias).

    Args:
        hidden_size: size of the last dim (any value; Apex accepts only a fixed list).
        eps: added to the mean square (stored as ``self.epsilon``).
        memory_efficient: save the output instead of the input for backward.
        device, dtype: factory kwargs for ``weight`` (ones); a culmen extension.

    Shape: input ``(*, hidden_size)``; output the same shape in the parameter dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, memory_efficient: bool = False,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.epsilon = eps
        self.memory_efficient = memory_efficient
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return _fast_rms_norm(x, self.weight, self.epsilon, self.memory_efficient)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.epsilon}, memory_efficient={self.memory_efficient}"
