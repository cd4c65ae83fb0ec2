"""Apex's ``fast_layer_norm`` extension module (``import fast_layer_norm`` through ``culmen.compat``).

The raw entry points Apex's contrib LayerNorm / RMSNorm wrap; statistics are fp32 and 1-D (one per row,
the input viewed as ``(-1, hidden)``), outputs in the weight dtype, input gradients in the input dtype.
They compute in fp32 with plain PyTorch (these are testing / porting entry points; the modules
``FastLayerNorm`` / ``FastRMSNorm`` run culmen's fused kernels).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ln_bwd", "ln_fwd", "rmsnorm_bwd", "rmsnorm_fwd"]


def _rows(x: Tensor, gamma: Tensor, name: str) -> Tensor:
    if x.shape[-1] != gamma.numel():
        raise ValueError(f"{name}: the last dim of x (shape {tuple(x.shape)}) must equal gamma's size {gamma.numel()}")
    return x.reshape(-1, gamma.numel()).float()


def ln_fwd(x: Tensor, gamma: Tensor, beta: Tensor, epsilon: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(z, mu, rsigma)``: LayerNorm of ``x`` ``(..., H)`` -> ``z`` (``x``'s shape, ``gamma.dtype``), ``mu`` and
    ``rsigma`` ``(rows,)`` fp32."""
    xf = _rows(x, gamma, "ln_fwd")
    mu = xf.mean(1)
    rsigma = torch.rsqrt((xf - mu[:, None]).square().mean(1) + epsilon)
    z = (xf - mu[:, None]) * rsigma[:, None] * gamma.float() + beta.float()
    return z.to(gamma.dtype).view(x.shape), mu, rsigma


def ln_bwd(dz: Tensor, x: Tensor, mu: Tensor, rsigma: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dgamma, dbeta)`` of ``ln_fwd`` from its saved ``mu`` / ``rsigma``."""
    xf = _rows(x, gamma, "ln_bwd")
    dzf = dz.reshape(xf.shape).float()
    y = (xf - mu.float()[:, None]) * rsigma.float()[:, None]
    dgamma = (dzf * y).sum(0)
    dbeta = dzf.sum(0)
    dy = dzf * gamma.float()
    dx = rsigma.float()[:, None] * (dy - dy.mean(1, keepdim=True) - y * (dy * y).mean(1, keepdim=True))
    return dx.to(x.dtype).view(x.shape), dgamma.to(gamma.dtype), dbeta.to(gamma.dtype)


def rmsnorm_fwd(x: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    """``(z, rsigma)``: RMSNorm of ``x`` ``(..., H)`` -> ``z`` (``gamma.dtype``), ``rsigma`` ``(rows,)`` fp32."""
    xf = _rows(x, gamma, "rmsnorm_fwd")
    rsigma = torch.rsqrt(xf.square().mean(1) + epsilon)
    # Apex's kernel rounds the normalized row to the weight dtype before scaling by gamma (in that dtype).
    z = (xf * rsigma[:, None]).to(gamma.dtype) * gamma
    return z.view(x.shape), rsigma


def rmsnorm_bwd(dz: Tensor, x: Tensor, rsigma: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dgamma, dgamma_part)`` of ``rmsnorm_fwd``; ``dgamma_part`` is ``dgamma`` as one fp32 partial row
    (Apex returns its per-CTA partial sums there)."""
    xf = _rows(x, gamma, "rmsnorm_bwd")
    dzf = dz.reshape(xf.shape).float()
    y = xf * rsigma.float()[:, None]
    dgamma = (dzf * y).sum(0)
    dy = dzf * gamma.float()
    dx = rsigma.float()[:, None] * (dy - y * (dy * y).mean(1, keepdim=True))
    return dx.to(x.dtype).view(x.shape), dgamma.to(gamma.dtype), dgamma[None]
