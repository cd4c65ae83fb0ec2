"""Pure-PyTorch references of the scaled (+ masked / causal) softmax.

``scaled_masked_softmax_ref`` is the oracle: differentiable PyTorch in the input's dtype (float64
inputs for the oracle, low-precision inputs for the baseline of the tolerance rule).
``softmax_fwd_ref`` / ``softmax_bwd_ref`` are the CPU path of the plans (fp32 math, the kernels'
contract; traceable by ``torch.compile``).
"""

from __future__ import annotations

import torch
from torch import Tensor

MASK_VALUE = -10000.0
"""Score of a masked element (Megatron's convention, kept by Apex's fused kernels)."""


def _causal_mask(sq: int, sk: int, device: torch.device) -> Tensor:
    """True above the diagonal (column > row): the excluded entries of the causal softmax."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)


def scaled_masked_softmax_ref(x: Tensor, mask: Tensor | None = None, scale: float = 1.0,
                              causal: bool = False) -> Tensor:
    """``softmax(where(mask, -10000, x * scale))`` over the last dim; differentiable.

    Shapes: ``x`` ``(B, NP, SQ, SK)`` (any float dtype; the math runs in it); ``mask`` bool/uint8
    broadcastable to ``x``, nonzero = masked. ``causal`` excludes columns past the row index
    (probability exactly 0). A row with every element masked or excluded is all zeros.
    """
    z = x * scale
    dead = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    if mask is not None:
        m = mask.to(torch.bool).expand(x.shape)
        z = z.masked_fill(m, MASK_VALUE)
        dead = dead | m
    if causal:
        c = _causal_mask(x.shape[-2], x.shape[-1], x.device).expand(x.shape)
        z = z.masked_fill(c, float("-inf"))
        dead = dead | c
    all_dead = dead.all(dim=-1, keepdim=True)
    # A fully excluded causal row would be softmax(-inf...) = NaN: give it a finite input first.
    z = torch.where(all_dead, torch.zeros_like(z), z)
    y = torch.softmax(z, dim=-1)
    return torch.where(all_dead, torch.zeros_like(y), y)


def softmax_fwd_ref(x: Tensor, mask: Tensor | None, scale: float, causal: bool) -> Tensor:
    """The forward kernel's contract: ``x`` ``(B, NP, SQ, SK)`` or ``(A, SQ, SK)``, ``mask`` bool/uint8
    broadcastable to x or ``None``; fp32 math (fp64 for fp64), contiguous output in x's dtype."""
    cdt = torch.promote_types(x.dtype, torch.float32)
    return scaled_masked_softmax_ref(x.to(cdt), mask, scale, causal).to(x.dtype).contiguous()


def softmax_bwd_ref(dy: Tensor, y: Tensor, scale: float, causal: bool) -> Tensor:
    """The backward kernel's contract: ``scale * y * (dy - sum(y * dy))`` in fp32 (fp64 for fp64),
    contiguous, in dy's dtype."""
    cdt = torch.promote_types(dy.dtype, torch.float32)
    yf, g = y.to(cdt), dy.to(cdt)
    dx = scale * yf * (g - (yf * g).sum(-1, keepdim=True))
    return dx.to(dy.dtype).contiguous()
