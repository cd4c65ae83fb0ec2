"""Launchers of the cross-entropy kernels: allocate, pick blocks, launch.

``TUNING`` holds the block-size rules so a sweep (``scripts/tune_cross_entropy.py``) can change them at
run time without editing code. The defaults are set from register counts, not yet from GPU timings.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from culmen.ops.backend import device_guard, num_programs_hint
from culmen.ops.common.launch import FastLauncher, warps_for
from culmen.ops.cross_entropy.kernels import (
    _cross_entropy_bwd_kernel,
    _cross_entropy_combine_kernel,
    _cross_entropy_fwd_kernel,
)

_fwd = FastLauncher(_cross_entropy_fwd_kernel)
_combine = FastLauncher(_cross_entropy_combine_kernel)
_bwd = FastLauncher(_cross_entropy_bwd_kernel)

TUNING = {
    # Widest vocab chunk a forward program loads per step, and elements per program it aims for
    # (several short rows per program when the vocab is small).
    "fwd_block_v": 4096,
    "fwd_elems": 4096,
    # Tile width / elements per program of the backward (one tile per program).
    "bwd_block_v": 4096,
    "bwd_elems": 4096,
    # 8 elements (one 16-byte bf16 load) per thread: 40 registers for the forward at 16 warps (sm_90,
    # ptxas of Triton 3.9), so three programs (48 warps) share a multiprocessor; 16 elements per thread
    # took 64-84 registers and left one or two.
    "elems_per_thread": 8,
    "max_warps": 16,
    # Below this many row programs per multiprocessor the forward splits each row's vocab over
    # several programs (and merges them in a second small kernel).
    "fwd_programs_per_sm": 4,
}


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Output allocation (one place, so tests can poison every buffer before a kernel writes it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _warps(elems: int) -> int:
    return warps_for(elems, TUNING["elems_per_thread"], TUNING["max_warps"])


def _blocks(N: int, V: int, max_block_v: int, elems: int) -> tuple[int, int]:
    block_v = min(triton.next_power_of_2(max(V, 1)), max_block_v)
    block_m = max(1, min(elems // block_v, 64, triton.next_power_of_2(max(N, 1))))
    return block_m, block_v


def cross_entropy_fwd(logits: Tensor, labels: Tensor, lse_in: Tensor | None, label_smoothing: float,
                      logit_scale: float, lse_square_scale: float, ignore_index: int, softcap: float,
                      vocab_start: int, total_classes: int, add_lse: bool,
                      grad_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Forward on ``logits (N, V)`` (last dim contiguous, any row stride) and ``labels (N,)`` int32/int64.

    Returns fp32 ``(loss, z_loss, lse)``, each ``(N,)``. With ``add_lse=False`` (vocab-parallel)
    ``loss`` is the partial ``-(1 - s) z_t - s sum(z) / total_classes`` of this shard and ``z_loss``
    is zeros. ``lse_in`` skips the LSE sweep (no smoothing, scale 1, no softcap). ``grad_scale``, a
    1-element fp32 tensor, also overwrites ``logits`` in place with ``grad_scale * d loss / d logits``.
    """
    N, V = logits.shape
    dev = logits.device
    loss = _alloc((N,), torch.float32, dev)
    zloss = _alloc((N,), torch.float32, dev)
    if not add_lse:
        zloss.zero_()
    precomputed = lse_in is not None
    lse = lse_in.to(torch.float32).contiguous() if precomputed else _alloc((N,), torch.float32, dev)
    block_m, block_v = _blocks(N, V, TUNING["fwd_block_v"], TUNING["fwd_elems"])
    row_programs = triton.cdiv(N, block_m)
    n_splits, cols_per_split = 1, V
    target = num_programs_hint(dev) * TUNING["fwd_programs_per_sm"]
    if row_programs < target and V > block_v and grad_scale is None and not precomputed:
        want = min(triton.cdiv(V, block_v), triton.cdiv(target, row_programs))
        cols_per_split = triton.cdiv(triton.cdiv(V, want), block_v) * block_v
        n_splits = triton.cdiv(V, cols_per_split)
    split = n_splits > 1
    part = _alloc((3, n_splits, N), torch.float32, dev) if split else None
    flags = dict(HAS_SMOOTHING=label_smoothing > 0.0, HAS_SOFTCAP=softcap > 0.0)
    common = (vocab_start, total_classes, ignore_index, label_smoothing, logit_scale, lse_square_scale, softcap)
    with device_guard(dev):
        _fwd((row_programs, n_splits),
             (logits, labels, lse_in, grad_scale, loss, zloss, lse, part,
              logits.stride(0), N, V, cols_per_split, *common),
             dict(**flags, PRECOMPUTED_LSE=precomputed, ADD_LSE=add_lse, SPLIT=split,
                  WRITE_GRAD=grad_scale is not None, BLOCK_M=block_m, BLOCK_V=block_v),
             _warps(block_m * block_v))
        if split:
            block_s = triton.next_power_of_2(n_splits)
            cm = max(1, min(64, 2048 // block_s, triton.next_power_of_2(N)))
            _combine((triton.cdiv(N, cm),),
                     (logits, labels, part, loss, zloss, lse, logits.stride(0), 1, N, V, n_splits, *common),
                     dict(**flags, ADD_LSE=add_lse, BLOCK_M=cm, BLOCK_S=block_s), 4)
    return loss, zloss, lse


def cross_entropy_bwd(dloss: Tensor, logits: Tensor, lse: Tensor, labels: Tensor, label_smoothing: float,
                      logit_scale: float, lse_square_scale: float, ignore_index: int, softcap: float,
                      vocab_start: int, total_classes: int, out: Tensor | None = None) -> Tensor:
    """Gradient ``(N, V)`` of the per-row losses w.r.t. ``logits``, for ``dloss (N,)`` (any stride, 0 too).

    Written into ``out`` when given (``out`` may be ``logits`` itself: in place), else a new tensor in
    the logits' dtype.
    """
    N, V = logits.shape
    dev = logits.device
    dlogits = out if out is not None else _alloc((N, V), logits.dtype, dev)
    block_m, block_v = _blocks(N, V, TUNING["bwd_block_v"], TUNING["bwd_elems"])
    with device_guard(dev):
        _bwd((triton.cdiv(N, block_m), triton.cdiv(V, block_v)),
             (dlogits, dloss, logits, lse, labels, logits.stride(0), dlogits.stride(0), dloss.stride(0),
              N, V, vocab_start, total_classes, ignore_index, label_smoothing, logit_scale, lse_square_scale,
              softcap),
             dict(HAS_SMOOTHING=label_smoothing > 0.0, HAS_SOFTCAP=softcap > 0.0, BLOCK_M=block_m, BLOCK_V=block_v),
             _warps(block_m * block_v))
    return dlogits
