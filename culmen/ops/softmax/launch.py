"""Launchers of the scaled masked softmax kernels: allocate, pick the algorithm and blocks, launch.

``TUNING`` holds the block rules so a sweep can change them at run time without editing code.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from culmen.ops.backend import device_guard
from culmen.ops.common.launch import FastLauncher, warps_for
from culmen.ops.softmax.kernels import (
    _softmax_bwd_chunked_kernel,
    _softmax_bwd_kernel,
    _softmax_fwd_chunked_kernel,
    _softmax_fwd_kernel,
)

_fwd = FastLauncher(_softmax_fwd_kernel)
_fwd_chunked = FastLauncher(_softmax_fwd_chunked_kernel)
_bwd = FastLauncher(_softmax_bwd_kernel)
_bwd_chunked = FastLauncher(_softmax_bwd_chunked_kernel)

TUNING = {
    # Longest row (elements) a program keeps in registers; longer rows take the chunked kernels.
    "fwd_max_resident": 16384,
    "bwd_max_resident": 8192,
    # Elements per program the resident kernels aim for (several short rows per program).
    "fwd_elems": 4096,
    "bwd_elems": 4096,
    # Chunk width of the chunked kernels.
    "chunk": 4096,
    # Elements per thread before another warp is added.
    "elems_per_thread": 16,
    "max_warps": 16,
}


def _empty(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> Tensor:
    """Every output buffer comes from here (tests poison it to catch elements a kernel forgets)."""
    return torch.empty(shape, device=device, dtype=dtype)


def _warps(elems: int) -> int:
    return warps_for(elems, TUNING["elems_per_thread"], TUNING["max_warps"])


def _blocks(SK: int, rows: int, target: int) -> tuple[int, int]:
    block_n = triton.next_power_of_2(max(SK, 1))
    block_m = max(1, min(target // block_n, 64, triton.next_power_of_2(max(rows, 1))))
    return block_m, block_n


def _mask_strides(mask: Tensor | None) -> tuple[int, int, int, int]:
    return tuple(mask.stride()) if mask is not None else (0, 0, 0, 0)  # type: ignore[return-value]


def softmax_fwd(x: Tensor, mask: Tensor | None, scale: float, causal: bool) -> Tensor:
    """Forward on ``x`` ``(B, NP, SQ, SK)`` with unit column stride; ``mask`` uint8 expanded to x's shape
    (any strides) or ``None``. Returns the probabilities, contiguous, in x's dtype."""
    B, NP, SQ, SK = x.shape
    y = _empty((B, NP, SQ, SK), x.device, x.dtype)
    n_rows = B * NP * SQ
    if n_rows == 0 or SK == 0:
        return y
    args = (x, mask, y, n_rows, SK, NP, SQ, *x.stride()[:3], *_mask_strides(mask), float(scale))
    flags = dict(HAS_MASK=mask is not None, CAUSAL=bool(causal))
    with device_guard(x.device):
        if SK <= TUNING["fwd_max_resident"]:
            block_m, block_n = _blocks(SK, n_rows, TUNING["fwd_elems"])
            _fwd((triton.cdiv(n_rows, block_m),), args, dict(**flags, BLOCK_M=block_m, BLOCK_N=block_n),
                 _warps(block_m * block_n))
        else:
            block_n = min(TUNING["chunk"], triton.next_power_of_2(SK))
            _fwd_chunked((n_rows,), args, dict(**flags, BLOCK_M=1, BLOCK_N=block_n), _warps(block_n))
    return y


def softmax_bwd(dy: Tensor, y: Tensor, scale: float, causal: bool) -> Tensor:
    """Backward: ``dy``, ``y`` ``(B, NP, SQ, SK)`` with unit column stride. Returns dx, contiguous, in
    dy's dtype."""
    B, NP, SQ, SK = dy.shape
    dx = _empty((B, NP, SQ, SK), dy.device, dy.dtype)
    n_rows = B * NP * SQ
    if n_rows == 0 or SK == 0:
        return dx
    args = (dy, y, dx, n_rows, SK, NP, SQ, *dy.stride()[:3], *y.stride()[:3], float(scale))
    with device_guard(dy.device):
        if SK <= TUNING["bwd_max_resident"]:
            block_m, block_n = _blocks(SK, n_rows, TUNING["bwd_elems"])
            _bwd((triton.cdiv(n_rows, block_m),), args,
                 dict(CAUSAL=bool(causal), BLOCK_M=block_m, BLOCK_N=block_n), _warps(block_m * block_n))
        else:
            block_n = min(TUNING["chunk"], triton.next_power_of_2(SK))
            _bwd_chunked((n_rows,), args, dict(CAUSAL=bool(causal), BLOCK_M=1, BLOCK_N=block_n), _warps(block_n))
    return dx
