"""``scaled_softmax_cuda``: softmax of ``input * scale``, no mask."""

from __future__ import annotations

from torch import Tensor

from culmen.transformer.functional._ext import check_4d, check_dims, get_batch_per_block, softmax_bwd, softmax_fwd

__all__ = ["backward", "forward", "get_batch_per_block"]


def _check(input: Tensor, mask: None) -> None:
    check_dims("input", input, 4)


def forward(input: Tensor, scale_factor: float) -> Tensor:
    """``input`` ``(b, np, sq, sk)``. Returns the probabilities in its dtype."""
    return softmax_fwd(input, None, scale_factor, False, _check)


def backward(output_grads: Tensor, softmax_results: Tensor, scale_factor: float) -> Tensor:
    """Input gradient ``scale * y * (dy - sum(y * dy))`` of 4-D ``output_grads`` / ``softmax_results``."""
    return softmax_bwd(output_grads, softmax_results, scale_factor, False, check_4d)
