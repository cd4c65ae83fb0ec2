"""``scaled_masked_softmax_cuda``: softmax of ``input * scale`` with a padding mask (nonzero = masked)."""

from __future__ import annotations

from torch import Tensor

from culmen.ops.softmax import softmax_backward, softmax_forward
from culmen.transformer.functional._ext import check_dims, get_batch_per_block

__all__ = ["backward", "forward", "get_batch_per_block"]


def forward(input: Tensor, mask: Tensor, scale_factor: float) -> Tensor:
    """``input`` ``(b, np, sq, sk)``; ``mask`` ``(b or 1, 1, sq, sk)`` bool/uint8. Returns the probabilities."""
    check_dims("input", input, 4)
    check_dims("mask", mask, 4)
    return softmax_forward(input, mask, scale_factor)


def backward(output_grads: Tensor, softmax_results: Tensor, scale_factor: float) -> Tensor:
    """Input gradient ``scale * y * (dy - sum(y * dy))`` of 4-D ``output_grads`` / ``softmax_results``."""
    check_dims("output_grads", output_grads, 4)
    check_dims("softmax_results", softmax_results, 4)
    return softmax_backward(output_grads, softmax_results, scale_factor)
