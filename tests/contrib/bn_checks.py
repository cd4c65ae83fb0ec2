"""Shared by the group-synchronized batch-norm tests (test_groupbn.py, test_cudnn_gbn.py): the float64 comparison
a distributed worker reports instead of asserting (a failing assert in one rank would leave the other waiting)."""

from __future__ import annotations

from torch import Tensor


def relative_failures(pairs: tuple[tuple[str, Tensor, Tensor], ...], prefix: str = "") -> list[str]:
    """``"<prefix>name max err E"`` for each ``(name, got, want)`` whose max abs error exceeds 1e-9 of ``want``'s
    largest magnitude (at least 1): float64 on both sides, so only rounding may differ."""
    failures = []
    for name, got, want in pairs:
        err = (got - want).abs().max().item()
        if err > 1e-9 * max(1.0, want.abs().max().item()):
            failures.append(f"{prefix}{name} max err {err:.3g}")
    return failures
