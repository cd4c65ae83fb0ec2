"""Pure-PyTorch ``index_mul_2d``: the oracle of the tests and the CPU path of the op.

``index_mul_2d_ref`` is plain indexing times ``in2`` (differentiable to any order by autograd). The
``*_fwd_ref`` / ``*_bwd_ref`` / ``*_bwd_bwd_ref`` functions compute what the kernels compute (products
in fp32, fp64 for fp64 inputs; scatter-adds with ``index_add_``, sequential on CPU) and back the
custom ops there.
"""

from __future__ import annotations

import torch
from torch import Tensor


def index_mul_2d_ref(in1: Tensor, in2: Tensor, idx: Tensor) -> Tensor:
    """``in1[idx] * in2`` for ``in1`` ``(M, F)``, ``in2`` ``(N, F)``, ``idx`` ``(N,)`` integers in ``[0, M)``."""
    return in1[idx] * in2


def _acc(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _scatter(a: Tensor, idx: Tensor, M: int, dtype: torch.dtype) -> Tensor:
    out = torch.zeros((M, a.shape[1]), device=a.device, dtype=a.dtype)
    return out.index_add_(0, idx, a).to(dtype)


def index_mul_2d_fwd_ref(in1: Tensor, in2: Tensor, idx: Tensor) -> Tensor:
    """What ``index_mul_2d_fwd`` returns: ``(N, F)`` in the dtype of ``in2``."""
    acc = _acc(in2)
    return (in1.index_select(0, idx).to(acc) * in2.to(acc)).to(in2.dtype)


def index_mul_2d_bwd_ref(gout: Tensor, in1: Tensor, in2: Tensor, idx: Tensor, need_gin1: bool, need_gin2: bool
                         ) -> tuple[Tensor | None, Tensor | None]:
    """``(gin1, gin2) = (zeros.index_add_(idx, gout * in2), gout * in1[idx])``; ``None`` where not needed."""
    acc = _acc(in2)
    g = gout.to(acc)
    gin1 = _scatter(g * in2.to(acc), idx, in1.shape[0], in1.dtype) if need_gin1 else None
    gin2 = (g * in1.index_select(0, idx).to(acc)).to(in2.dtype) if need_gin2 else None
    return gin1, gin2


def index_mul_2d_bwd_bwd_ref(gg1: Tensor | None, gg2: Tensor | None, gout: Tensor, in1: Tensor, in2: Tensor,
                             idx: Tensor, need_ggout: bool, need_gin1: bool, need_gin2: bool
                             ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Double backward: ``ggout = gg1[idx] * in2 + gg2 * in1[idx]``, ``gin1 = scatter(gg2 * gout)``,
    ``gin2 = gg1[idx] * gout``; missing ``gg1``/``gg2`` are zeros, unneeded outputs ``None``."""
    acc = _acc(in2)
    g = gout.to(acc)
    a1 = gg1.index_select(0, idx).to(acc) if gg1 is not None else None
    b2 = gg2.to(acc) if gg2 is not None else None
    ggout = gin1 = gin2 = None
    if need_ggout:
        ggout = torch.zeros_like(g)
        if a1 is not None:
            ggout = ggout + a1 * in2.to(acc)
        if b2 is not None:
            ggout = ggout + b2 * in1.index_select(0, idx).to(acc)
        ggout = ggout.to(gout.dtype)
    if need_gin1:
        if b2 is not None:
            gin1 = _scatter(b2 * g, idx, in1.shape[0], in1.dtype)
        else:
            gin1 = torch.zeros(in1.shape, device=in1.device, dtype=in1.dtype)
    if need_gin2:
        gin2 = (a1 * g).to(in2.dtype) if a1 is not None else torch.zeros(in2.shape, device=in2.device,
                                                                           dtype=in2.dtype)
    return ggout, gin1, gin2
