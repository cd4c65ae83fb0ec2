"""``apex.contrib.multihead_attn.mask_softmax_dropout_func``: masked softmax + dropout of attention scores
on culmen's fused scaled masked softmax kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from culmen.contrib.multihead_attn._core import check_mask
from culmen.ops.softmax import scaled_masked_softmax


def fast_mask_softmax_dropout_func(is_training: bool, heads: int, inputs: Tensor, pad_mask: Tensor | None,
                                   mask_additive: bool, dropout_prob: float) -> Tensor:
    """``dropout(softmax(inputs [masked]))`` over the last dim of ``inputs (batch * heads, sq, sk)``.

    Args:
        is_training: apply dropout with ``dropout_prob``.
        heads: heads per batch row (divides ``inputs.shape[0]``).
        inputs: fp16/bf16/fp32/fp64 scores.
        pad_mask: ``(batch, sk)`` or ``None``: nonzero marks padded keys (their score becomes -10000, as in
            Apex's kernels), or with ``mask_additive`` a float mask added to the scores.

    The softmax runs in fp32; the result is ``(batch * heads, sq, sk)`` in ``inputs``' dtype,
    differentiable in ``inputs``.
    """
    if not isinstance(inputs, Tensor) or inputs.dim() != 3:
        raise ValueError("inputs must be a 3-D tensor (batch * heads, sq, sk), got "
                         f"{tuple(inputs.shape) if isinstance(inputs, Tensor) else type(inputs).__name__}")
    if isinstance(heads, bool) or not isinstance(heads, int) or heads <= 0 or inputs.shape[0] % heads:
        raise ValueError(f"heads must be a positive int dividing inputs.shape[0] ({inputs.shape[0]}), got {heads!r}")
    bh, sq, sk = inputs.shape
    x = inputs.view(bh // heads, heads, sq, sk)
    if pad_mask is None:
        probs = scaled_masked_softmax(x, None, 1.0)
    else:
        check_mask(pad_mask, "pad_mask", (bh // heads, sk), bool(mask_additive))
        if mask_additive:
            probs = scaled_masked_softmax(x + pad_mask[:, None, None, :].to(x.dtype), None, 1.0)
        else:
            m = pad_mask if pad_mask.dtype in (torch.bool, torch.uint8) else pad_mask.ne(0)
            probs = scaled_masked_softmax(x, m[:, None, None, :], 1.0)
    if is_training and dropout_prob > 0.0:
        probs = F.dropout(probs, dropout_prob)
    return probs.view(bh, sq, sk)


class MaskSoftmaxDropout:
    """Apex's autograd-function name: ``MaskSoftmaxDropout.apply(...)`` is ``fast_mask_softmax_dropout_func``."""

    apply = staticmethod(fast_mask_softmax_dropout_func)


__all__ = ["MaskSoftmaxDropout", "fast_mask_softmax_dropout_func"]
