"""Shared by the group-synchronized batch-norm tests (test_groupbn.py, test_cudnn_gbn.py): the float64 comparison
a distributed worker reports instead of asserting (a failing assert in one rank would leave the other waiting)."""

from __future__ import annotations

import torch
from torch import Tensor


def relative_failures(pairs: tuple[tuple[str, Tensor, Tensor], ...], prefix: str = "", tol: float = 1e-9) -> list[str]:
    """``"<prefix>name max err E"`` for each ``(name, got, want)`` whose max abs error exceeds ``tol`` of ``want``'s
    largest magnitude (at least 1). ``got`` may be on another device or in fp32 (compared in float64 on the CPU);
    the default ``tol`` is for float64 on both sides, where only rounding may differ."""
    failures = []
    for name, got, want in pairs:
        err = (got.detach().double().cpu() - want).abs().max().item()
        if err > tol * max(1.0, want.abs().max().item()):
            failures.append(f"{prefix}{name} max err {err:.3g}")
    return failures


def rank_device(rank: int, device: str) -> tuple[torch.device, torch.dtype, float]:
    """A distributed worker's ``(device, dtype, tolerance)``: float64 on the CPU (gloo), fp32 on GPU ``rank``
    (NCCL), whose kernels round each op to fp32 (relative error ~1e-6; the budget is 1e-4)."""
    if device == "cpu":
        return torch.device("cpu"), torch.float64, 1e-9
    return torch.device("cuda", rank), torch.float32, 1e-4
