"""Pure-PyTorch references of the batch-norm ops.

``bn_*_ref`` are the reference path of ``BNPlan`` (CPU, fp64, the ``reference`` backend): each computes what
one kernel step computes, on the canonical ``(N, C, L)`` / ``(M, C)`` layouts with the same packed
statistics rows, in fp32 (fp64 for fp64 inputs). ``sync_batch_norm_ref`` is the oracle of the tests: plain
differentiable PyTorch on the whole (concatenated) batch, in whatever dtype its inputs have.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def stat_dtype(x: Tensor) -> torch.dtype:
    """dtype of the statistics of ``x``: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def pack_stats(mean: Tensor, m2: Tensor, count: int) -> Tensor:
    """One packed row ``[mean (C) | M2 (C) | count]``, the count an int64 in the last two slots."""
    C = mean.numel()
    out = torch.empty((2 * C + 2,), device=mean.device, dtype=mean.dtype)
    out[:C] = mean
    out[C:2 * C] = m2
    out[2 * C:].view(torch.int64)[0] = int(count)
    return out


def packed_counts(stats: Tensor) -> Tensor:
    """The int64 counts of packed rows ``(..., 2C + 2)``: shape ``(...)``."""
    C = (stats.shape[-1] - 2) // 2
    return stats[..., 2 * C:].contiguous().view(torch.int64)[..., 0]


def _dims(channel_last: bool) -> tuple[int, ...]:
    return (0,) if channel_last else (0, 2)


def _per_channel(t: Tensor, channel_last: bool) -> Tensor:
    """Shape a ``(C,)`` vector to broadcast against the canonical layout."""
    return t.view(1, -1) if channel_last else t.view(1, -1, 1)


def bn_stats_ref(x: Tensor, channel_last: bool) -> Tensor:
    """Packed ``(mean, M2, count)`` of ``x`` (``(N, C, L)`` or ``(M, C)``) as one ``(1, 2C + 2)`` row; zeros
    with count 0 when empty."""
    sd = stat_dtype(x)
    C = x.shape[1]
    n = x.numel() // C if C else 0
    if n == 0:
        z = torch.zeros((C,), device=x.device, dtype=sd)
        return pack_stats(z, z, 0).unsqueeze(0)
    xf = x.to(sd)
    dims = _dims(channel_last)
    mean = xf.mean(dims)
    m2 = (xf - _per_channel(mean, channel_last)).square().sum(dims)
    return pack_stats(mean, m2, n).unsqueeze(0)


def bn_combine_ref(stats: Tensor, running_mean: Tensor | None, running_var: Tensor | None, momentum: float,
                   eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Merge packed rows ``(R, 2C + 2)``; returns ``(mean, invstd, count)`` and updates the running stats
    in place (unbiased variance) when given. See ``launch.bn_combine``."""
    C = (stats.shape[1] - 2) // 2
    n = packed_counts(stats)
    total = n.sum()
    nf = n.to(stats.dtype)[:, None]
    used = (n > 0)[:, None]
    means = torch.where(used, stats[:, :C], 0.0)
    m2s = torch.where(used, stats[:, C:2 * C], 0.0)
    mean = (means * nf).sum(0) / total.to(stats.dtype)
    m2 = (m2s + nf * (means - mean).square() * used).sum(0)
    tf = total.to(stats.dtype)
    invstd = torch.rsqrt(m2 / tf + eps)
    if running_mean is not None:
        with torch.no_grad():
            unbiased = m2 / (tf - 1)
            running_mean.copy_(running_mean.to(stats.dtype) * (1 - momentum) + mean * momentum)
            running_var.copy_(running_var.to(stats.dtype) * (1 - momentum) + unbiased * momentum)
    return mean, invstd, total.reshape(1)


def bn_fwd_ref(x: Tensor, z: Tensor | None, mean: Tensor, invstd: Tensor, weight: Tensor | None,
               bias: Tensor | None, fuse_relu: bool, channel_last: bool) -> Tensor:
    """``relu?((x - mean) * invstd * weight + bias + z)`` in ``x``'s dtype."""
    sd = stat_dtype(x)
    scale = invstd.to(sd) if weight is None else invstd.to(sd) * weight.to(sd)
    shift = -mean.to(sd) * scale
    if bias is not None:
        shift = shift + bias.to(sd)
    y = x.to(sd) * _per_channel(scale, channel_last) + _per_channel(shift, channel_last)
    if z is not None:
        y = y + z.to(sd)
    if fuse_relu:
        y = torch.relu(y)
    return y.to(x.dtype)


def _masked_dy(dy: Tensor, y: Tensor | None, fuse_relu: bool, sd: torch.dtype) -> Tensor:
    dyf = dy.to(sd)
    if fuse_relu:
        dyf = torch.where(y > 0, dyf, 0.0)
    return dyf


def bn_bwd_reduce_ref(dy: Tensor, x: Tensor, y: Tensor | None, mean: Tensor, invstd: Tensor,
                      weight: Tensor | None, bias: Tensor | None, fuse_relu: bool, channel_last: bool,
                      store_dz: bool):
    """``(sums, dweight, dbias, dz)`` as ``launch.bn_bwd_reduce``."""
    sd = stat_dtype(x)
    dyf = _masked_dy(dy, y, fuse_relu, sd)
    dims = _dims(channel_last)
    sum_dy = dyf.sum(dims)
    sum_dyx = (dyf * (x.to(sd) - _per_channel(mean.to(sd), channel_last))).sum(dims)
    dw = (sum_dyx * invstd.to(sd)).to(weight.dtype) if weight is not None else None
    db = sum_dy.to(bias.dtype) if bias is not None else None
    dz = dyf.to(dy.dtype) if store_dz else None
    return torch.cat([sum_dy, sum_dyx]), dw, db, dz


def bn_bwd_ref(dy: Tensor, x: Tensor, y: Tensor | None, mean: Tensor, invstd: Tensor, weight: Tensor | None,
               sums: Tensor, count: Tensor | None, fuse_relu: bool, training: bool, channel_last: bool) -> Tensor:
    """``dx`` as ``launch.bn_bwd``."""
    sd = stat_dtype(x)
    dyf = _masked_dy(dy, y, fuse_relu, sd)
    C = x.shape[1]
    inv = invstd.to(sd)
    a = inv if weight is None else inv * weight.to(sd)
    dx = dyf * _per_channel(a, channel_last)
    if training:
        n = count.to(sd)
        mdy = sums[:C].to(sd) / n
        mdyx = sums[C:].to(sd) / n
        k = -a * inv * inv * mdyx
        b = -a * mdy - mean.to(sd) * k
        dx = dx + x.to(sd) * _per_channel(k, channel_last) + _per_channel(b, channel_last)
    return dx.to(x.dtype)


def sync_batch_norm_ref(x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
                        running_var: Tensor | None, training: bool, momentum: float, eps: float, *,
                        z: Tensor | None = None, channel_last: bool = False, fuse_relu: bool = False) -> Tensor:
    """Oracle: ``relu?(batch_norm(x) + z)`` on the whole batch with ``F.batch_norm``, differentiable.

    ``x``: ``(N, C, *)``, or ``(..., C)`` with ``channel_last``. Updates the running stats like
    ``torch.nn.BatchNorm`` (unbiased variance).
    """
    if channel_last and x.dim() > 2:
        perm = (0, x.dim() - 1, *range(1, x.dim() - 1))
        inv = (0, *range(2, x.dim()), 1)
        out = sync_batch_norm_ref(x.permute(perm), weight, bias, running_mean, running_var, training, momentum,
                                  eps, z=None if z is None else z.permute(perm), fuse_relu=fuse_relu)
        return out.permute(inv)
    y = F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)
    if z is not None:
        y = y + z
    return torch.relu(y) if fuse_relu else y
