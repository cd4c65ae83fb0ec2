"""``scaled_upper_triang_masked_softmax_cuda``: causal softmax of ``input * scale`` (column > row excluded)."""

from __future__ import annotations

from torch import Tensor

from culmen.transformer.functional._ext import check_dims, get_batch_per_block, softmax_bwd, softmax_fwd

__all__ = ["backward", "forward", "get_batch_per_block"]


def _check(input: Tensor, mask: None) -> None:
    check_dims("input", input, 3)


def _check_bwd(output_grads: Tensor, softmax_results: Tensor) -> None:
    check_dims("output_grads", output_grads, 3)
    check_dims("softmax_results", softmax_results, 3)


def forward(input: Tensor, scale_factor: float) -> Tensor:
    """``input`` ``(attn_batches, sq, sk)``. Returns the probabilities (0 above the diagonal)."""
    return softmax_fwd(input, None, scale_factor, True, _check)


def backward(output_grads: Tensor, softmax_results: Tensor, scale_factor: float) -> Tensor:
    """Input gradient of 3-D ``output_grads`` / ``softmax_results``."""
    return softmax_bwd(output_grads, softmax_results, scale_factor, True, _check_bwd)
