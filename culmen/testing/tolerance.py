"""The tolerance rule of DESIGN.md: a kernel may be at most ``factor``× as wrong as PyTorch itself.

A fixed ``atol``/``rtol`` is either too loose for fp32 or too tight for bf16 and long reductions.
Instead the allowed error is measured: ``ref_hi`` is the computation in float64 (or fp32),
``ref_lo`` the same computation done by PyTorch in the input's low precision. The kernel passes
when ``max|actual - ref_hi| <= factor * max|ref_lo - ref_hi| + atol``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

# Rounding noise allowed on top of the measured baseline, per dtype of the tensor under test; it
# is scaled by max(1, max|ref_hi|) so that large-magnitude outputs are not held to absolute ulps.
DEFAULT_ATOL: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
}


class ToleranceResult(NamedTuple):
    """What ``assert_close_tolerance`` measured (returned when the check passes)."""

    err: float
    """``max|actual - ref_hi|`` over the finite positions."""
    baseline: float
    """``max|ref_lo - ref_hi|``: PyTorch's own error in low precision (0 without ``ref_lo``)."""
    allowed: float
    """``factor * baseline + atol``."""


def default_atol(dtype: torch.dtype) -> float:
    """The rounding-noise atol for ``dtype`` before scaling (0 for exact dtypes such as integers)."""
    return DEFAULT_ATOL.get(dtype, 0.0)


def _index(flat_idx: int, shape: torch.Size) -> tuple[int, ...]:
    idx = []
    for size in reversed(shape):
        idx.append(flat_idx % size)
        flat_idx //= size
    return tuple(reversed(idx))


def assert_close_tolerance(
    actual: Tensor,
    ref_hi: Tensor,
    ref_lo: Tensor | None,
    *,
    factor: float = 2.0,
    atol: float | None = None,
    name: str = "",
) -> ToleranceResult:
    """Assert that ``actual`` is within ``factor`` × PyTorch's low-precision error of ``ref_hi``.

    Args:
        actual: the kernel's output (any dtype, any strides).
        ref_hi: the high-precision reference (float64 or fp32), same shape.
        ref_lo: PyTorch's computation in the input's low precision, same shape; ``None`` when there
            is no such baseline (then only ``atol`` is allowed).
        factor: how many times PyTorch's own error the kernel may make.
        atol: extra absolute slack; default ``default_atol(actual.dtype) * max(1, max|ref_hi|)``.
        name: the tensor's name for the failure message (``"dx"``, ``"dweight"`` ...).

    NaN/inf in ``actual`` fail unless ``ref_hi`` holds the same value at the same place; a NaN in
    ``ref_hi`` where ``actual`` is finite fails too. Non-finite positions of ``ref_lo`` (low-precision
    overflow) are left out of the baseline rather than making it infinite.

    Returns:
        The measured ``ToleranceResult``. Raises ``AssertionError`` naming the tensor, both errors
        and the worst index when the check fails.
    """
    label = name or "tensor"
    if actual.shape != ref_hi.shape:
        raise AssertionError(f"{label}: shape {tuple(actual.shape)} != reference shape {tuple(ref_hi.shape)}")
    if ref_lo is not None and ref_lo.shape != ref_hi.shape:
        raise AssertionError(f"{label}: ref_lo shape {tuple(ref_lo.shape)} != ref_hi shape {tuple(ref_hi.shape)}")
    a = actual.detach().to(device=ref_hi.device, dtype=torch.float64)
    hi = ref_hi.detach().to(torch.float64)

    a_nan, hi_nan = torch.isnan(a), torch.isnan(hi)
    a_inf, hi_inf = torch.isinf(a), torch.isinf(hi)
    same_special = (a_nan & hi_nan) | (a_inf & hi_inf & (a == hi))
    bad_special = ((a_nan | hi_nan | a_inf | hi_inf) & ~same_special)
    if bool(bad_special.any()):
        flat = int(bad_special.reshape(-1).nonzero()[0].item())
        where = _index(flat, a.shape)
        count = int(bad_special.sum().item())
        raise AssertionError(
            f"{label}: {count} non-finite mismatch(es); first at index {where}: "
            f"actual={a.reshape(-1)[flat].item()!r}, ref_hi={hi.reshape(-1)[flat].item()!r}")
    finite = torch.isfinite(hi)

    def _max_abs(x: Tensor) -> tuple[float, int]:
        if x.numel() == 0:
            return 0.0, -1
        flat = x.reshape(-1)
        i = int(torch.argmax(flat).item())
        return float(flat[i].item()), i

    diff = torch.where(finite, (a - hi).abs(), torch.zeros_like(hi))
    err, worst = _max_abs(diff)

    baseline = 0.0
    lo = None
    if ref_lo is not None:
        lo = ref_lo.detach().to(device=ref_hi.device, dtype=torch.float64)
        ok = finite & torch.isfinite(lo)
        baseline, _ = _max_abs(torch.where(ok, (lo - hi).abs(), torch.zeros_like(hi)))

    if atol is None:
        scale = max(1.0, _max_abs(torch.where(finite, hi.abs(), torch.zeros_like(hi)))[0])
        atol = default_atol(actual.dtype) * scale
    allowed = factor * baseline + atol
    if err > allowed:
        where = _index(worst, a.shape)
        lo_val = f", ref_lo={lo.reshape(-1)[worst].item():.6g}" if lo is not None else ""
        raise AssertionError(
            f"{label}: max|actual - ref_hi| = {err:.4g} > allowed {allowed:.4g} "
            f"(= {factor:g} x max|ref_lo - ref_hi| = {baseline:.4g}, + atol {atol:.3g}); worst at index {where}: "
            f"actual={a.reshape(-1)[worst].item():.6g}, ref_hi={hi.reshape(-1)[worst].item():.6g}{lo_val}")
    return ToleranceResult(err, baseline, allowed)
