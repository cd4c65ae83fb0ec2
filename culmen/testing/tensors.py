"""Test inputs that catch the bugs zeros and contiguous tensors hide (DESIGN.md, Numerics)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

# Sizes around block boundaries and powers of two: 1, 63, 123, 1000, 4097.
_ODD_SHAPES: tuple[tuple[int, int], ...] = ((1, 1), (3, 63), (5, 123), (7, 1000), (2, 4097))


def odd_shapes() -> list[tuple[int, int]]:
    """``(rows, cols)`` shapes that do not fit power-of-two blocks, small enough for the interpreter."""
    return list(_ODD_SHAPES)


def poison_(t: Tensor) -> Tensor:
    """Fill ``t`` in place with a value no correct kernel writes: NaN for floats, max for integers.

    Poison output buffers before a kernel writes them so an element it forgets stands out.
    Returns ``t``.
    """
    with torch.no_grad():
        if t.dtype == torch.bool:
            t.fill_(True)
        elif t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        else:
            t.fill_(torch.iinfo(t.dtype).max)
    return t


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Every ``torch.empty`` / ``torch.empty_like`` inside is poisoned (``poison_``), so an element a kernel
    leaves unwritten shows."""
    empty, empty_like = torch.empty, torch.empty_like
    torch.empty = lambda *a, **k: poison_(empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison_(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def randn(
    shape: Sequence[int] | int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    scale: float = 1.0,
    *,
    requires_grad: bool = False,
) -> Tensor:
    """Fresh normal random data (never zeros) of ``dtype``, drawn in fp32 and scaled by ``scale``."""
    if isinstance(shape, int):
        shape = (shape,)
    t = (torch.randn(tuple(shape), dtype=torch.float32, device=device) * scale).to(dtype)
    return t.requires_grad_(requires_grad)


def _finish(view: Tensor, like: Tensor) -> Tensor:
    # A view of a buffer that needs no grad is a leaf, so requires_grad_ makes a usable test input.
    return view.requires_grad_(like.requires_grad)


def make_noncontiguous(t: Tensor, pad: int = 3) -> Tensor:
    """A view with ``t``'s values whose rows are ``pad`` elements apart (last-dim stride stays 1).

    The padding is poisoned (NaN / max int) so a kernel that reads past a row end is caught. The
    result is non-contiguous whenever ``t`` has at least two rows (PyTorch calls a single row
    contiguous whatever its stride); a 1-D ``t`` gets a stride-2 view instead.
    """
    if t.dim() <= 1:
        return make_strided_lastdim(t)
    *lead, n = t.shape
    buf = poison_(torch.empty((*lead, n + pad), dtype=t.dtype, device=t.device))
    view = buf[..., :n]
    with torch.no_grad():
        view.copy_(t)
    return _finish(view, t)


def make_strided_lastdim(t: Tensor) -> Tensor:
    """A view with ``t``'s values and last-dim stride 2 (odd slots of the buffer are poisoned)."""
    if t.dim() == 0:
        raise ValueError("make_strided_lastdim needs at least one dimension")
    *lead, n = t.shape
    buf = poison_(torch.empty((*lead, 2 * n), dtype=t.dtype, device=t.device))
    view = buf[..., ::2]
    with torch.no_grad():
        view.copy_(t)
    return _finish(view, t)
