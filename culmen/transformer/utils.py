"""Helpers shared by ``tensor_parallel`` and ``pipeline_parallel`` (Apex's ``apex.transformer.utils``).

``ensure_divisibility`` / ``divide`` raise :class:`DivisibilityError`, a ``ValueError`` that is also an
``AssertionError`` (Apex asserted), naming both numbers.
"""

from __future__ import annotations

import torch

from culmen.ops.common.collectives import all_gather_single
from culmen.transformer import parallel_state

__all__ = ["DivisibilityError", "ensure_divisibility", "divide", "split_tensor_into_1d_equal_chunks",
           "gather_split_1d_tensor"]



class DivisibilityError(ValueError, AssertionError):
    """A size that must divide another does not (a ``ValueError``; also an ``AssertionError`` as in Apex)."""


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Raise :class:`DivisibilityError` unless ``numerator % denominator == 0``."""
    if denominator == 0 or numerator % denominator != 0:
        raise DivisibilityError(f"{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int) -> int:
    """``numerator // denominator``, raising :class:`DivisibilityError` when it leaves a remainder."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor) -> torch.Tensor:
    """This tensor-parallel rank's equal slice of ``tensor`` flattened: shape ``(numel // tp,)``, a view.

    ``tensor`` must be viewable as 1-D (contiguous) with ``numel`` divisible by the tensor-parallel
    world size (Apex silently dropped the remainder; here it is a :class:`DivisibilityError`).
    """
    data = tensor.view(-1)
    world = parallel_state.get_tensor_model_parallel_world_size()
    if data.numel() % world != 0:
        raise DivisibilityError(
            f"tensor.numel() ({data.numel()}) is not divisible by the tensor model parallel world size ({world})")
    size = data.numel() // world
    start = size * parallel_state.get_tensor_model_parallel_rank()
    return data[start:start + size]


def gather_split_1d_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """All-gather the tensor-parallel ranks' 1-D slices: shape ``(tp * numel,)``, ``tensor``'s dtype and device.

    The inverse of :func:`split_tensor_into_1d_equal_chunks` (Apex allocated on the current CUDA
    device whatever ``tensor``'s device; here the result lives where ``tensor`` does).
    """
    world = parallel_state.get_tensor_model_parallel_world_size()
    gathered = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    all_gather_single(gathered, tensor.contiguous().view(-1),
                           group=parallel_state.get_tensor_model_parallel_group())
    return gathered
