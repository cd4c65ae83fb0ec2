"""Shared pieces of the channel-permutation searches: the 2:4 kept-magnitude score and its batched
forms, in PyTorch (on the GPU when there is one, so no compiled extension is needed).

A permutation reorders the input channels (columns) of a weight matrix ``(rows, C)``; the score of an
order is the magnitude a 2:4 mask keeps, i.e. per row and per group ("stripe") of 4 consecutive
columns, the two largest ``|w|``. The searches only move columns between stripes, since the order
inside a stripe does not change its score.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "apply_2_to_4",
    "as_search_tensor",
    "find_permutation",
    "stripe_scores",
    "sum_after_2_to_4",
    "top2_of_4",
    "try_swap",
    "use_gpu",
]

GROUP_WIDTH = 4  # the searches target N:4 sparsity, as Apex's do


def use_gpu(initial_override: bool = True) -> bool:
    """Whether the searches run on the GPU (CUDA available and not overridden off)."""
    return bool(initial_override) and torch.cuda.is_available()


def search_device() -> torch.device:
    return torch.device("cuda") if use_gpu() else torch.device("cpu")


def as_search_tensor(matrix: Tensor | np.ndarray, device: torch.device | None = None) -> Tensor:
    """``|matrix|`` as a float32 tensor on the search device (magnitudes are all the searches need)."""
    t = torch.as_tensor(matrix).detach()
    if t.dim() != 2:
        raise ValueError(f"matrix must be 2-D (rows, channels), got shape {tuple(t.shape)}")
    return t.to(device or search_device(), torch.float32).abs()


def top2_of_4(x: Tensor) -> Tensor:
    """Sum of the two largest of the last dimension (size 4) of ``x``."""
    # A sorting network on the 4 lanes: cheaper than topk for this tiny fixed width.
    a, b, c, d = x.unbind(-1)
    hi1, lo1 = torch.maximum(a, b), torch.minimum(a, b)
    hi2, lo2 = torch.maximum(c, d), torch.minimum(c, d)
    return torch.maximum(hi1, hi2) + torch.maximum(torch.minimum(hi1, hi2), torch.maximum(lo1, lo2))


def stripe_scores(absmat: Tensor) -> Tensor:
    """Per-stripe kept magnitude of a nonnegative ``(rows, C)`` matrix: float32 ``(C // 4,)``."""
    rows, c = absmat.shape
    return top2_of_4(absmat.reshape(rows, c // GROUP_WIDTH, GROUP_WIDTH)).sum(0)


def _check_width(matrix: Tensor | np.ndarray) -> None:
    if matrix.shape[1] % GROUP_WIDTH:
        raise ValueError(f"matrix has {matrix.shape[1]} channels (dim 1), not a multiple of {GROUP_WIDTH}")


def sum_after_2_to_4(matrix: Tensor | np.ndarray) -> float:
    """Magnitude kept by a 2:4 mask of ``matrix`` ``(rows, C)``, ``C`` a multiple of 4 (float64 sum)."""
    _check_width(matrix)
    t = torch.as_tensor(matrix).detach()
    groups = t.reshape(-1, GROUP_WIDTH).abs().to(torch.float64)
    return float(top2_of_4(groups).sum())


def apply_2_to_4(matrix: Tensor | np.ndarray) -> Tensor | np.ndarray:
    """Zero the two smallest magnitudes of every group of 4 columns of ``matrix`` in place; returns it."""
    _check_width(matrix)
    t = torch.as_tensor(matrix)  # shares memory with a numpy array
    groups = t.view(-1, GROUP_WIDTH) if t.is_contiguous() else t.reshape(-1, GROUP_WIDTH)
    drop = torch.topk(groups.abs(), 2, dim=1, largest=False).indices
    groups.scatter_(1, drop, 0)
    if not t.is_contiguous():
        t.copy_(groups.view(t.shape))
    return matrix


def try_swap(matrix: Tensor | np.ndarray, dst: int, src: int) -> tuple[float, float]:
    """Score change of swapping columns ``src`` and ``dst``: returns ``(new score of the two stripes,
    improvement)``. ``matrix`` is left unchanged."""
    t = torch.as_tensor(matrix).detach()
    s0, s1 = src // GROUP_WIDTH, dst // GROUP_WIDTH
    cols = sorted({s0, s1})
    before = sum(sum_after_2_to_4(t[:, s * GROUP_WIDTH:(s + 1) * GROUP_WIDTH]) for s in cols)
    swapped = t.clone()
    swapped[:, [src, dst]] = swapped[:, [dst, src]]
    after = sum(sum_after_2_to_4(swapped[:, s * GROUP_WIDTH:(s + 1) * GROUP_WIDTH]) for s in cols)
    return after, after - before


def find_permutation(A: Tensor | np.ndarray, B: Tensor | np.ndarray) -> list[int]:
    """The column order ``p`` with ``A[:, j] == B[:, p[j]]`` (first match for repeated columns)."""
    a, b = torch.as_tensor(A), torch.as_tensor(B)
    eq = (a.t()[:, None, :] == b.t()[None, :, :]).all(-1)  # (colsA, colsB)
    if not bool(eq.any(1).all()):
        raise ValueError("A and B do not hold the same columns")
    return [int(i) for i in eq.to(torch.int8).argmax(1)]


def permutation_gain(matrix: Tensor | np.ndarray, permutation: list[int]) -> float:
    """Kept 2:4 magnitude of ``matrix[:, permutation]`` minus that of ``matrix`` (float64)."""
    t = torch.as_tensor(matrix).detach()
    return sum_after_2_to_4(t[:, list(permutation)]) - sum_after_2_to_4(t)
