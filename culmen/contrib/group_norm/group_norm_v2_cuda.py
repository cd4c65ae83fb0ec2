"""Apex's compiled ``group_norm_v2_cuda`` module (the Blackwell kernels), in Python on culmen's kernels.

``gn(x, weight, bias, eps, with_swish, G, mean_var_out=None, sm_margin=0) -> y`` (the statistics go to
``mean_var_out`` when given) and ``gn_bwd(grad_output, x, weight, bias, mean_var, eps, with_swish, G,
sm_margin=0) -> [dx, dweight, dbias]``. ``mean_var`` holds culmen's per-group ``(mean, rstd)`` pairs
(``(2 * N * G,)`` fp32). Any GPU and shape; ``sm_margin`` is accepted and ignored.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.contrib.group_norm.group_norm import group_norm_nhwc_bprop, group_norm_nhwc_fprop

__all__ = ["gn", "gn_bwd"]


def gn(x: Tensor, weight: Tensor, bias: Tensor, eps: float, with_swish: bool, G: int,
       mean_var_out: Tensor | None = None, sm_margin: int = 0) -> Tensor:
    """GroupNorm (+ SiLU) of ``x``; writes the statistics into ``mean_var_out`` when given."""
    with torch.no_grad():
        y, sums = group_norm_nhwc_fprop(x, G, weight, bias, eps, "silu" if with_swish else "")
        if mean_var_out is not None:
            if mean_var_out.numel() != sums.numel():
                raise ValueError(f"gn: mean_var_out must have 2 * N * G = {sums.numel()} elements, got "
                                 f"{mean_var_out.numel()}")
            mean_var_out.copy_(sums.reshape(mean_var_out.shape))
    return y


def gn_bwd(grad_output: Tensor, x: Tensor, weight: Tensor, bias: Tensor, mean_var: Tensor, eps: float,
           with_swish: bool, G: int, sm_margin: int = 0) -> list[Tensor | None]:
    """``[dx, dweight, dbias]`` from the statistics ``gn`` wrote."""
    return list(group_norm_nhwc_bprop(grad_output, mean_var, x, G, weight, bias, eps, "silu" if with_swish else ""))
