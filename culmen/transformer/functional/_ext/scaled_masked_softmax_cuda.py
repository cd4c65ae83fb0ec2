"""``scaled_masked_softmax_cuda``: softmax of ``input * scale`` with a padding mask (nonzero = masked)."""

from __future__ import annotations

from torch import Tensor

from culmen.transformer.functional._ext import check_4d, check_dims, get_batch_per_block, softmax_bwd, softmax_fwd

__all__ = ["backward", "forward", "get_batch_per_block"]


def _check(input: Tensor, mask: Tensor) -> None:
    check_dims("input", input, 4)
    check_dims("mask", mask, 4)


def forward(input: Tensor, mask: Tensor, scale_factor: float) -> Tensor:
    """``input`` ``(b, np, sq, sk)``; ``mask`` ``(b or 1, 1, sq, sk)`` bool/uint8. Returns the probabilities."""
    return softmax_fwd(input, mask, scale_factor, False, _check)


def backward(output_grads: Tensor, softmax_results: Tensor, scale_factor: float) -> Tensor:
    """Input gradient ``scale * y * (dy - sum(y * dy))`` of 4-D ``output_grads`` / ``softmax_results``."""
    return softmax_bwd(output_grads, softmax_results, scale_factor, False, check_4d)
