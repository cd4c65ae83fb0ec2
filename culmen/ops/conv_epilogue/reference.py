"""Pure-PyTorch references of the convolution epilogue (the CPU / fp64 path and the tests' oracle).

They take the tensors in any layout (broadcasting per-channel vectors over dim 1 of NCHW-shaped tensors),
compute in fp32 (fp64 for fp64 inputs) and return results in the input's dtype and memory format.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _stat_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _chan(v: Tensor | None, nd: int, dt: torch.dtype) -> Tensor | None:
    """A per-channel vector (any shape with ``C`` elements) shaped to broadcast over dim 1."""
    if v is None:
        return None
    return v.reshape(1, -1, *([1] * (nd - 2))).to(dt)


def conv_epilogue_fwd_ref(c: Tensor, scale: Tensor | None, bias: Tensor | None, res: Tensor | None,
                          res_scale: Tensor | None, mask: Tensor | None, relu: bool) -> Tensor:
    """``act((c * scale + bias + res * res_scale) * mask)`` in ``c``'s dtype and memory format."""
    dt = _stat_dtype(c)
    nd = c.dim()
    v = c.to(dt)
    if scale is not None:
        v = v * _chan(scale, nd, dt)
    if bias is not None:
        v = v + _chan(bias, nd, dt)
    if res is not None:
        r = res.to(dt)
        if res_scale is not None:
            r = r * _chan(res_scale, nd, dt)
        v = v + r
    if mask is not None:
        v = v * mask.to(dt)
    if relu:
        v = torch.relu(v)
    return v.to(c.dtype)


def conv_epilogue_bwd_ref(dy: Tensor, y: Tensor | None, mask: Tensor | None, scale: Tensor | None,
                          res_scale: Tensor | None, relu: bool, need_dc: bool, need_dr: bool,
                          need_sum: bool) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dc, dr, sum_g)`` for ``g = dy * [y > 0] * mask``: ``dc = g * scale``, ``dr = g * res_scale`` (in ``dy``'s
    dtype) and the fp32 (fp64) channel sums of ``g`` (``(C,)``), each ``None`` unless asked for."""
    dt = _stat_dtype(dy)
    nd = dy.dim()
    g = dy.to(dt)
    if relu:
        g = torch.where(y > 0, g, 0.0)
    if mask is not None:
        g = g * mask.to(dt)
    dc = dr = s = None
    if need_dc:
        dc = (g * _chan(scale, nd, dt) if scale is not None else g).to(dy.dtype)
    if need_dr:
        dr = (g * _chan(res_scale, nd, dt) if res_scale is not None else g).to(dy.dtype)
    if need_sum:
        s = g.sum(dim=[d for d in range(nd) if d != 1])
    return dc, dr, s
