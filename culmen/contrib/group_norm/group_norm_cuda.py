"""Apex's compiled ``group_norm_cuda`` module, in Python on culmen's kernels (for ``culmen.compat``).

``forward(x, G, weight, bias, eps, passes, with_swish) -> [y, sums]`` and
``backward(grad_output, sums, x, G, weight, bias, eps, passes, with_swish) -> [dx, dweight, dbias]``.
``sums`` holds culmen's per-group ``(mean, rstd)`` pairs (``(2 * N * G,)`` fp32); pass it back unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.contrib.group_norm.group_norm import group_norm_nhwc_bprop, group_norm_nhwc_fprop

__all__ = ["OnePass", "TwoPass", "backward", "forward"]

# Older Apex passes an algorithm enum; culmen accepts and ignores it.
OnePass = 1
TwoPass = 2


def forward(x: Tensor, G: int, weight: Tensor, bias: Tensor, eps: float, passes: int = 1,
            with_swish: bool = False) -> list[Tensor]:
    """``[y, sums]``; nothing is differentiable."""
    with torch.no_grad():
        y, sums = group_norm_nhwc_fprop(x, G, weight, bias, eps, "silu" if with_swish else "", int(passes))
    return [y, sums]


def backward(grad_output: Tensor, sums: Tensor, x: Tensor, G: int, weight: Tensor, bias: Tensor, eps: float,
             passes: int = 1, with_swish: bool = False) -> list[Tensor | None]:
    """``[dx, dweight, dbias]``."""
    return list(group_norm_nhwc_bprop(grad_output, sums, x, G, weight, bias, eps, "silu" if with_swish else "",
                                      int(passes)))
