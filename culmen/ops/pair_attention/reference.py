"""Pure-PyTorch attention with a pair bias and a logit mask: the oracle of the tests and the CPU path.

It is OpenFold's formulation (Apex's ``AttnBiasJIT`` body): ``matmul(q * scale, k^T)``, plus
``(mask - 1) * inf``, plus ``bias``, ``softmax``, ``matmul(., v)``, computed in fp32 (fp64 for fp64
inputs) and returned in ``q``'s dtype. It is differentiable through autograd, so its gradients check the
kernels' hand-written backward (including the bias gradient summed over broadcast dims).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def pair_attention_ref(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None, mask: Tensor | None = None,
                       inf: float = 1e9, scale: float | None = None,
                       compute_dtype: torch.dtype | None = None) -> Tensor:
    """``softmax(q k^T * scale + (mask - 1) * inf + bias) v`` over the last dim.

    Args:
        q: ``[*, H, M, D]``; k, v: ``[*, H, N, D]`` (same ``*``).
        bias: broadcastable to ``[*, H, M, N]`` (any float dtype) or ``None``.
        mask: broadcastable to ``[*, H, M, N]``; 1 keeps a logit, 0 masks it (any dtype) or ``None``.
        inf: the finite "infinity" masked logits are pushed down by.
        scale: logit scale (default ``1 / sqrt(D)``).
        compute_dtype: dtype of the math (default fp32, fp64 for fp64 ``q``).

    Returns ``[*, H, M, D]`` in ``q.dtype``.
    """
    cd = compute_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q.to(cd) * scale, k.to(cd).transpose(-1, -2))
    if mask is not None:
        s = s + (mask.to(cd) - 1.0) * inf
    if bias is not None:
        s = s + bias.to(cd)
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v.to(cd)).to(q.dtype)
