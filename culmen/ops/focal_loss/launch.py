"""Launchers of the focal-loss kernels: allocate, pick the tiles and grid, launch.

Inputs arrive as the op layer leaves them: ``x`` a contiguous ``(R, C)`` matrix, ``labels`` a
contiguous ``(R,)`` integer vector, ``num_pos`` a one-element fp32 tensor. ``TUNING`` holds the tile
rules so a sweep can change them at run time. Host work per call: one dict lookup for the plan of the
shape (tiles, grid, ``BoundLaunch`` of each kernel, which calls the compiled kernel directly after the
first launch) and the launches; no ``triton.cdiv`` / ``next_power_of_2`` (slow host calls in Triton 3.6).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import device_guard, interpreter_enabled, num_programs_hint
from culmen.ops.common.launch import BoundLaunch, FastLauncher, aligned_16, cdiv, next_pow2, raw_stream
from culmen.ops.focal_loss.kernels import _focal_loss_bwd_kernel, _focal_loss_finish_kernel, _focal_loss_fwd_kernel

_fwd = FastLauncher(_focal_loss_fwd_kernel)
_finish = FastLauncher(_focal_loss_finish_kernel)
_bwd = FastLauncher(_focal_loss_bwd_kernel)

TUNING = {
    # Elements per (rows x columns) tile of the forward and backward kernels (8 per thread at 8 warps).
    "fwd_tile": 2048,
    "bwd_tile": 2048,
    # Column-block candidates, widest first; the launcher takes the one wasting the fewest lanes.
    "block_c": (64, 32, 16, 8, 4),
    # Persistent forward programs per multiprocessor.
    "fwd_programs_per_sm": 4,
    "fwd_warps": 8,
    "bwd_warps": 8,
    # Hardware approximations of exp2 / log2 / 1/x for 16-bit logits on CUDA (see kernels.py).
    "fast_math": True,
}

_PLANS: dict = {}


def int_gamma(gamma: float) -> int:
    """``gamma`` as a small non-negative integer when it is one (multiplications instead of a pow), else -1."""
    g = float(gamma)
    return int(g) if g.is_integer() and 0.0 <= g <= 8.0 else -1


def _block_c(cols: int, elem: int) -> int:
    """The column block that wastes the fewest lanes on ``cols`` columns (ties: the widest), at least one
    16-byte vector of ``elem``-byte elements where the row allows it."""
    best, best_waste = 0, None
    for bc in TUNING["block_c"]:
        if bc * elem < 16 and best:
            break
        waste = cdiv(cols, bc) * bc - cols
        if best_waste is None or waste < best_waste:
            best, best_waste = bc, waste
    return best


def _fast(x: Tensor) -> bool:
    return (TUNING["fast_math"] and x.device.type == "cuda" and torch.version.hip is None
            and x.element_size() == 2 and not interpreter_enabled())


class _Plan:
    """Tiles, grid and bound launches of one (shape, dtypes, flags) of the forward or the backward."""

    __slots__ = ("main", "finish", "progs", "num_tiles")

    def __init__(self, x: Tensor, num_real: int, fwd: bool, meta: dict):
        R, C = x.shape
        bc = _block_c(max(1, num_real if fwd else C), x.element_size())
        br = max(1, min(TUNING["fwd_tile" if fwd else "bwd_tile"] // bc, next_pow2(R)))
        meta = dict(meta, FAST=_fast(x), BLOCK_R=br, BLOCK_C=bc)
        self.num_tiles = cdiv(R, br)
        if fwd:
            self.progs = max(1, min(self.num_tiles, TUNING["fwd_programs_per_sm"] * num_programs_hint(x.device)))
            self.main = BoundLaunch(_fwd, (self.progs,), meta, TUNING["fwd_warps"])
            self.finish = BoundLaunch(_finish, (1,), {"BLOCK_P": min(1024, next_pow2(self.progs))}, 4)
        else:
            self.progs = self.num_tiles
            self.main = BoundLaunch(_bwd, (self.num_tiles,), meta, TUNING["bwd_warps"])
            self.finish = None


def _plan(key: tuple, x: Tensor, num_real: int, fwd: bool, meta: dict) -> _Plan:
    key = (*key, *TUNING.values())
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) > 256:
            _PLANS.clear()
        plan = _PLANS[key] = _Plan(x, num_real, fwd, meta)
    return plan


def focal_loss_fwd(x: Tensor, labels: Tensor, num_pos: Tensor, num_real: int, alpha: float, gamma: float,
                   smoothing: float) -> Tensor:
    """Sum of the element losses of ``x`` ``(R, C)`` (fp16/bf16/fp32) divided by ``num_pos[0]``: a 0-dim
    fp32 tensor."""
    R, C = x.shape
    dev = x.device
    ig, sm = int_gamma(gamma), smoothing != 0.0
    plan = _plan((True, R, C, num_real, x.dtype, labels.dtype, num_pos.dtype, dev, ig, sm), x, num_real, True,
                 {"INT_GAMMA": ig, "SMOOTHING": sm})
    loss = torch.empty((), device=dev, dtype=torch.float32)
    part = torch.empty((plan.progs,), device=dev, dtype=torch.float32)
    stream = raw_stream(dev)
    aligned = aligned_16(x, labels, part, num_pos, loss)
    with device_guard(dev):
        plan.main((x, labels, part, R, C, num_real, plan.num_tiles, float(alpha), float(gamma), float(smoothing)),
                  aligned, stream)
        plan.finish((part, num_pos, loss, plan.progs), aligned, stream)
    return loss


def focal_loss_bwd(grad: Tensor | None, x: Tensor, labels: Tensor, num_pos: Tensor, num_real: int, alpha: float,
                   gamma: float, smoothing: float, out: Tensor | None = None) -> Tensor:
    """Gradient of ``focal_loss_fwd`` times ``grad[0]`` (``(R, C)``, dtype of ``x``), recomputed from ``x``.

    ``grad=None`` gives the gradient of the un-normalized summed loss (Apex's ``partial_grad``).
    ``out`` (contiguous, like ``x``) receives the result when given.
    """
    R, C = x.shape
    dx = torch.empty_like(x) if out is None else out
    if R * C == 0:
        return dx
    dev = x.device
    normalize = grad is not None
    g = grad if normalize else num_pos
    ig, sm = int_gamma(gamma), smoothing != 0.0
    plan = _plan((False, R, C, num_real, x.dtype, labels.dtype, g.dtype, dev, ig, sm, normalize), x, num_real,
                 False, {"INT_GAMMA": ig, "SMOOTHING": sm, "NORMALIZE": normalize})
    with device_guard(dev):
        plan.main((x, labels, dx, g, num_pos, R, C, num_real, float(alpha), float(gamma), float(smoothing)),
                  aligned_16(x, labels, dx, g, num_pos), raw_stream(dev))
    return dx
