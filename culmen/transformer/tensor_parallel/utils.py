"""Small helpers of ``apex.transformer.tensor_parallel.utils``: splitting tensors and vocabularies by rank.

``divide`` / ``ensure_divisibility`` are ``culmen.transformer.utils``'s (a ``ValueError`` that names both
numbers and is also an ``AssertionError``, as Apex asserted), re-exported as Apex's module did.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from culmen.transformer.utils import divide, ensure_divisibility

__all__ = ["VocabUtility", "divide", "ensure_divisibility", "split_tensor_along_last_dim"]


def split_tensor_along_last_dim(
    tensor: Tensor,
    num_partitions: int,
    contiguous_split_chunks: bool = False,
) -> Sequence[Tensor]:
    """Split ``tensor (..., n)`` into ``num_partitions`` equal chunks ``(..., n / num_partitions)``.

    Args:
        tensor: any dtype, at least 1-D.
        num_partitions: must divide the last dimension (``ValueError`` naming both numbers otherwise).
        contiguous_split_chunks: return contiguous copies (a tuple) instead of views (what
            ``torch.split`` returns).

    Returns:
        The chunks, views of ``tensor`` unless ``contiguous_split_chunks``.
    """
    if tensor.dim() == 0:
        raise ValueError("split_tensor_along_last_dim needs a tensor with at least 1 dimension, got a 0-d tensor")
    last_dim_size = divide(tensor.shape[-1], num_partitions)
    chunks = torch.split(tensor, last_dim_size, dim=-1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


class VocabUtility:
    """The vocabulary range ``[first, last)`` that rank ``rank`` of ``world_size`` holds (equal shards)."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> Sequence[int]:
        """``(rank * per_partition_vocab_size, (rank + 1) * per_partition_vocab_size)``."""
        index_f = rank * per_partition_vocab_size
        return index_f, index_f + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> Sequence[int]:
        """The range of ``rank`` when ``global_vocab_size`` (divisible by ``world_size``) is split evenly."""
        per_partition = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)
