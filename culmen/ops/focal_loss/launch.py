"""Launchers of the focal-loss kernels: allocate, pick the grid, launch.

Inputs arrive as the op layer leaves them: ``x`` a contiguous ``(R, C)`` matrix, ``labels`` a
contiguous ``(R,)`` integer vector, ``num_pos`` a one-element fp32 tensor. ``TUNING`` holds the block
rules so a sweep can change them at run time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from culmen.ops.backend import device_guard, num_programs_hint
from culmen.ops.common.launch import FastLauncher
from culmen.ops.focal_loss.kernels import _focal_loss_bwd_kernel, _focal_loss_finish_kernel, _focal_loss_fwd_kernel

_fwd = FastLauncher(_focal_loss_fwd_kernel)
_finish = FastLauncher(_focal_loss_finish_kernel)
_bwd = FastLauncher(_focal_loss_bwd_kernel)

TUNING = {
    # Elements per tile of the forward (persistent) and backward kernels.
    "fwd_block": 4096,
    "bwd_block": 2048,
    # Persistent forward programs per multiprocessor.
    "fwd_programs_per_sm": 4,
    "num_warps": 8,
}


def int_gamma(gamma: float) -> int:
    """``gamma`` as a small non-negative integer when it is one (multiplications instead of a pow), else -1."""
    g = float(gamma)
    return int(g) if g.is_integer() and 0.0 <= g <= 8.0 else -1


def focal_loss_fwd(x: Tensor, labels: Tensor, num_pos: Tensor, num_real: int, alpha: float, gamma: float,
                   smoothing: float) -> Tensor:
    """Sum of the element losses of ``x`` ``(R, C)`` (fp16/bf16/fp32) divided by ``num_pos[0]``: a 0-dim
    fp32 tensor."""
    R, C = x.shape
    total = R * C
    dev = x.device
    loss = torch.empty((), device=dev, dtype=torch.float32)
    block = TUNING["fwd_block"]
    num_tiles = triton.cdiv(total, block)
    progs = max(1, min(num_tiles, TUNING["fwd_programs_per_sm"] * num_programs_hint(dev)))
    part = torch.empty((progs,), device=dev, dtype=torch.float32)
    with device_guard(dev):
        _fwd((progs,), (x, labels, part, total, C, num_real, num_tiles, float(alpha), float(gamma), float(smoothing)),
             {"ACC": tl.float32, "INT_GAMMA": int_gamma(gamma), "SMOOTHING": smoothing != 0.0, "BLOCK": block},
             num_warps=TUNING["num_warps"])
        bp = min(1024, triton.next_power_of_2(progs))
        _finish((1,), (part, num_pos, loss, progs), {"BLOCK_P": bp}, num_warps=4)
    return loss


def focal_loss_bwd(grad: Tensor | None, x: Tensor, labels: Tensor, num_pos: Tensor, num_real: int, alpha: float,
                   gamma: float, smoothing: float, out: Tensor | None = None) -> Tensor:
    """Gradient of ``focal_loss_fwd`` times ``grad[0]`` (``(R, C)``, dtype of ``x``), recomputed from ``x``.

    ``grad=None`` gives the gradient of the un-normalized summed loss (Apex's ``partial_grad``).
    ``out`` (contiguous, like ``x``) receives the result when given.
    """
    R, C = x.shape
    total = R * C
    dx = torch.empty_like(x) if out is None else out
    if total == 0:
        return dx
    block = TUNING["bwd_block"]
    normalize = grad is not None
    with device_guard(x.device):
        _bwd((triton.cdiv(total, block),),
             (x, labels, dx, grad if normalize else num_pos, num_pos, total, C, num_real, float(alpha), float(gamma),
              float(smoothing)),
             {"ACC": tl.float32, "INT_GAMMA": int_gamma(gamma), "SMOOTHING": smoothing != 0.0, "NORMALIZE": normalize,
              "BLOCK": block},
             num_warps=TUNING["num_warps"])
    return dx
