"""``scaled_softmax_cuda``: softmax of ``input * scale``, no mask."""

from __future__ import annotations

from torch import Tensor

from culmen.ops.softmax import softmax_backward, softmax_forward
from culmen.transformer.functional._ext import check_dims, get_batch_per_block

__all__ = ["backward", "forward", "get_batch_per_block"]


def forward(input: Tensor, scale_factor: float) -> Tensor:
    """``input`` ``(b, np, sq, sk)``. Returns the probabilities in its dtype."""
    check_dims("input", input, 4)
    return softmax_forward(input, None, scale_factor)


def backward(output_grads: Tensor, softmax_results: Tensor, scale_factor: float) -> Tensor:
    """Input gradient ``scale * y * (dy - sum(y * dy))`` of 4-D ``output_grads`` / ``softmax_results``."""
    check_dims("output_grads", output_grads, 4)
    check_dims("softmax_results", softmax_results, 4)
    return softmax_backward(output_grads, softmax_results, scale_factor)
