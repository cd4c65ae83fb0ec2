"""Launcher of the rotary kernel: pick the tile, launch on the flat grid.

``TUNING`` holds the tile rules so a sweep can change them at run time without editing code.
"""

from __future__ import annotations

import triton
from torch import Tensor

from culmen.ops.backend import device_guard
from culmen.ops.common.launch import FastLauncher
from culmen.ops.rotary.kernels import _rotary_kernel

_launch = FastLauncher(_rotary_kernel)

TUNING = {
    # Elements (of x) a program aims to rotate: several heads and positions per program amortize the
    # cos/sin loads and the index math.
    "elems": 4096,
    # Elements per thread before another warp is added, and the warp cap.
    "elems_per_thread": 8,
    "max_warps": 8,
}


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def rotary_blocks(seqlen: int, nheads: int, half: int, rest: int) -> tuple[int, int, int, int, int]:
    """``(BLOCK_S, BLOCK_H, BLOCK_K, BLOCK_P, num_warps)`` for ``half`` pairs and ``rest`` copied columns."""
    block_k = _pow2(half)
    block_p = _pow2(rest)
    row = 2 * block_k + (block_p if rest > 0 else 0)
    target = TUNING["elems"]
    block_h = min(_pow2(nheads), max(1, target // row))
    block_s = min(_pow2(seqlen), max(1, target // (row * block_h)))
    warps = _pow2(block_s * block_h * row // (32 * TUNING["elems_per_thread"]))
    return block_s, block_h, block_k, block_p, max(1, min(TUNING["max_warps"], warps))


def rotary_fwd(x: Tensor, out: Tensor, cos: Tensor, sin: Tensor, cos2: Tensor | None, sin2: Tensor | None,
               seqlen_offsets: Tensor | None, cu_seqlens: Tensor | None, offset: int, max_seqlen: int,
               interleaved: bool, conjugate: bool, full_table: bool, img_w: int, copy_rest: bool) -> None:
    """Rotate ``x`` into ``out`` (which may be ``x`` itself) with the Triton kernel.

    Shapes: ``x``/``out`` ``(B, S, H, D)`` (any strides), or ``(T, H, D)`` packed with ``cu_seqlens``
    ``(B + 1,)`` int32/int64 and ``max_seqlen``; ``cos``/``sin`` ``(rows, W)`` with unit column
    stride, ``W = half`` (``full_table=False``) or ``2 * half``; ``cos2``/``sin2`` the column tables
    of the 2-D form (``img_w > 0``); ``seqlen_offsets`` ``(B,)`` int or ``None`` (then ``offset``).
    ``copy_rest`` copies columns ``[2 * half, D)`` from ``x`` to ``out``. Returns nothing.
    """
    varlen = cu_seqlens is not None
    if varlen:
        T, H, D = x.shape
        B, S = cu_seqlens.shape[0] - 1, max_seqlen
        sx = (0, x.stride(0), x.stride(1), x.stride(2))
        so = (0, out.stride(0), out.stride(1), out.stride(2))
    else:
        B, S, H, D = x.shape
        sx, so = x.stride(), out.stride()
    W = cos.shape[1]
    half = W // 2 if full_table else W
    two_d = img_w > 0
    rest = 0 if (two_d or not copy_rest) else D - 2 * half
    bs, bh, bk, bp, warps = rotary_blocks(S, H, half, rest)
    n_s, n_h = triton.cdiv(S, bs), triton.cdiv(H, bh)
    grid = (B * n_s * n_h,)
    if grid[0] == 0:
        return
    cos2 = cos if cos2 is None else cos2
    sin2 = sin if sin2 is None else sin2
    args = (x, out, cos, sin, cos2, sin2, seqlen_offsets, cu_seqlens,
            S, H, D, half, cos.shape[0], cos2.shape[0], int(offset), int(img_w), n_s, n_h,
            *sx, *so, cos.stride(0), cos2.stride(0))
    meta = dict(INTERLEAVED=bool(interleaved), FULL_TABLE=bool(full_table), CONJUGATE=bool(conjugate),
                IS_VARLEN=varlen, HAS_OFFSETS=seqlen_offsets is not None, TWO_D=two_d, COPY_REST=rest > 0,
                BLOCK_S=bs, BLOCK_H=bh, BLOCK_K=bk, BLOCK_P=bp)
    with device_guard(x.device):
        _launch(grid, args, meta, warps)
