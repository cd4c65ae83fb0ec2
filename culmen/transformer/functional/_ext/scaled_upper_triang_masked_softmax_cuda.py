"""``scaled_upper_triang_masked_softmax_cuda``: causal softmax of ``input * scale`` (column > row excluded)."""

from __future__ import annotations

from torch import Tensor

from culmen.ops.softmax import softmax_backward, softmax_forward
from culmen.transformer.functional._ext import check_dims, get_batch_per_block

__all__ = ["backward", "forward", "get_batch_per_block"]


def forward(input: Tensor, scale_factor: float) -> Tensor:
    """``input`` ``(attn_batches, sq, sk)``. Returns the probabilities (0 above the diagonal)."""
    check_dims("input", input, 3)
    return softmax_forward(input, None, scale_factor, causal=True)


def backward(output_grads: Tensor, softmax_results: Tensor, scale_factor: float) -> Tensor:
    """Input gradient of 3-D ``output_grads`` / ``softmax_results``."""
    check_dims("output_grads", output_grads, 3)
    check_dims("softmax_results", softmax_results, 3)
    return softmax_backward(output_grads, softmax_results, scale_factor, causal=True)
