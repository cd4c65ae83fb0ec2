"""Pure-PyTorch GroupNorm (+ SiLU): the oracle of the tests and the CPU path of the op.

``group_norm_ref`` is ``F.group_norm`` (+ ``F.silu``) in the input's dtype, kept differentiable, so its
autograd gradients check the hand-written backward. ``group_norm_fwd_ref`` / ``group_norm_bwd_ref``
compute what the kernels compute (fp32 statistics, fp64 for fp64 inputs, outputs in the memory
format of the input) and back the custom ops on CPU.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor


def spatial_strides(t: Tensor) -> tuple[int, int, int] | None:
    """``(stride_n, stride_c, stride_l)`` of ``t`` ``(N, C, *spatial)`` viewed as ``(N, C, L)``, or ``None``
    when the spatial dims do not collapse into one stride (then the caller makes a copy)."""
    shape, strides = t.shape, t.stride()
    if torch.compiler.is_compiling():  # dynamo traces the plain function
        return _spatial_strides(shape, strides)
    try:
        return _spatial_strides_cached(shape, strides)
    except TypeError:  # symbolic sizes (torch.compile) are not hashable
        return _spatial_strides(shape, strides)


def _spatial_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, int, int] | None:
    sl = None
    expected = None
    for size, stride in reversed(list(zip(shape[2:], strides[2:]))):
        if size == 1:
            continue
        if sl is None:
            sl = stride
        elif stride != expected:
            return None
        expected = stride * size
    return strides[0], strides[1], (1 if sl is None else sl)


_spatial_strides_cached = functools.lru_cache(maxsize=1024)(_spatial_strides)


def stats_dtype(x: Tensor) -> torch.dtype:
    """dtype of the saved mean / rstd: fp32, fp64 for fp64 inputs."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def group_norm_ref(x: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None,
                   eps: float = 1e-5, silu: bool = False) -> Tensor:
    """``silu?(F.group_norm(x, num_groups, weight, bias, eps))`` with the parameters cast to ``x.dtype``."""
    w = weight.to(x.dtype) if weight is not None else None
    b = bias.to(x.dtype) if bias is not None else None
    y = F.group_norm(x, num_groups, w, b, eps)
    return F.silu(y) if silu else y


def _acc(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _per_channel(t: Tensor | None, x: Tensor, fill: float) -> Tensor:
    """A ``(1, C, 1, ...)`` view of a parameter in the compute dtype (``fill`` without one)."""
    shape = (1, x.shape[1]) + (1,) * (x.dim() - 2)
    if t is None:
        return torch.full(shape, fill, device=x.device, dtype=_acc(x))
    return t.to(_acc(x)).reshape(shape)


def _grouped(t: Tensor, G: int) -> Tensor:
    """``t`` ``(N, C, *spatial)`` as ``(N, G, elements per group)`` (explicit sizes: ``N`` may be 0)."""
    N = t.shape[0]
    return t.reshape(N, G, t[0].numel() // G if N else math.prod(t.shape[1:]) // G)


def _xhat(x: Tensor, mean: Tensor, rstd: Tensor, G: int) -> Tensor:
    N = x.shape[0]
    xg = _grouped(x.to(_acc(x)), G)
    return ((xg - mean.reshape(N, G, 1)) * rstd.reshape(N, G, 1)).reshape(x.shape)


def _like(x: Tensor, values: Tensor, dtype: torch.dtype) -> Tensor:
    """``values`` in ``dtype`` with the strides of ``x`` (what ``torch.empty_like(x)`` gives)."""
    out = torch.empty_like(x, dtype=dtype)
    out.copy_(values)
    return out


def group_norm_fwd_ref(x: Tensor, weight: Tensor | None, bias: Tensor | None, G: int, eps: float,
                       silu: bool) -> tuple[Tensor, Tensor, Tensor]:
    """What ``group_norm_fwd`` returns: ``(y, mean, rstd)``."""
    xg = _grouped(x.to(_acc(x)), G)
    mean = xg.mean(-1)
    rstd = torch.rsqrt((xg - mean.unsqueeze(-1)).square().mean(-1) + eps)
    z = _xhat(x, mean, rstd, G) * _per_channel(weight, x, 1.0) + _per_channel(bias, x, 0.0)
    if silu:
        z = F.silu(z)
    return _like(x, z, x.dtype), mean, rstd


def group_norm_bwd_ref(dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor,
                       rstd: Tensor, G: int, silu: bool, need_dw: bool
                       ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """What ``group_norm_bwd`` returns: ``(dx, dweight, dbias)``."""
    N = x.shape[0]
    xhat = _xhat(x, mean, rstd, G)
    w = _per_channel(weight, x, 1.0)
    dz = dy.to(_acc(x))
    if silu:
        z = xhat * w + _per_channel(bias, x, 0.0)
        s = torch.sigmoid(z)
        dz = dz * s * (1.0 + z * (1.0 - s))
    dims = [0] + list(range(2, x.dim()))
    dw = (dz * xhat).sum(dims).to(weight.dtype) if (need_dw and weight is not None) else None
    db = dz.sum(dims).to(bias.dtype) if (need_dw and bias is not None) else None
    gh = _grouped(dz * w, G)
    xh = _grouped(xhat, G)
    c1 = (gh * xh).mean(-1, keepdim=True)
    c2 = gh.mean(-1, keepdim=True)
    dx = (rstd.reshape(N, G, 1) * (gh - xh * c1 - c2)).reshape(x.shape)
    return _like(x, dx, x.dtype), dw, db
