"""Launcher of the rotary kernel: pick the tile, launch on the flat grid, with little host work.

A rotary call moves little data per launch (tens of MB at most), so on a slow host the Python around
the launch can cost more than the kernel. Everything that depends only on shapes, strides, dtypes and
flags is computed once into a ``Launch`` (grid, tile, integer arguments); a ``Launch`` keeps the
compiled kernel of each specialization (pointer alignment, the ``offset`` value's class) and calls it
directly, the way ``culmen.ops.common.launch.FastLauncher`` does, without re-deriving the
specialization of ~30 arguments per call. The first launch of a specialization, the interpreter,
another current device and ``CULMEN_FAST_LAUNCH=0`` take the ``FastLauncher`` path.

``TUNING`` holds the tile rules so a sweep can change them at run time without editing code (a sweep
must call ``clear_cache()`` after changing it).
"""

from __future__ import annotations

import os

import torch
import triton
from torch import Tensor

from culmen.ops.backend import device_guard
from culmen.ops.common.launch import FastLauncher, compile_entry, raw_stream, run_compiled
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

_I32 = 2**31
_MAX_CACHED = 1024


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


def _aligned(t: Tensor | None):
    return None if t is None else (t.data_ptr() & 15) == 0


class Launch:
    """One launch geometry of the rotary kernel: built from example tensors, called with real ones.

    ``x``/``out`` are ``(B, S, H, D)``, ``(T, H, D)`` with ``cu_seqlens``, or ``(S, B, H, D)`` with
    ``seq_first``; the rest as in ``rotary_fwd``. Valid for tensors with the shapes, strides, dtypes,
    device and ``None``-ness of the example and the same flags; the caller keys its cache on those.
    ``offset`` is a per-call argument.
    """

    __slots__ = ("grid", "ints", "meta", "warps", "device", "index", "compiled", "empty")

    def __init__(self, x: Tensor, out: Tensor, cos: Tensor, cos2: Tensor | None, cu_seqlens: Tensor | None,
                 max_seqlen: int, interleaved: bool, conjugate: bool, full_table: bool, img_w: int,
                 copy_rest: bool, has_offsets: bool, seq_first: bool = False) -> None:
        varlen = cu_seqlens is not None
        if varlen:
            _, H, D = x.shape
            B, S = cu_seqlens.shape[0] - 1, max_seqlen
            sx = (0, x.stride(0), x.stride(1), x.stride(2))
            so = (0, out.stride(0), out.stride(1), out.stride(2))
        elif seq_first:  # (S, B, H, D): the kernel sees the (B, S, H, D) view
            S, B, H, D = x.shape
            sx = (x.stride(1), x.stride(0), x.stride(2), x.stride(3))
            so = (out.stride(1), out.stride(0), out.stride(2), out.stride(3))
        else:
            B, S, H, D = x.shape
            sx, so = tuple(x.stride()), tuple(out.stride())
        W = cos.shape[1]
        half = W // 2 if full_table else W
        two_d = img_w > 0
        rest = 0 if (two_d or not copy_rest) else D - 2 * half
        bs, bh, bk, bp, warps = rotary_blocks(S, H, half, rest)
        n_s, n_h = triton.cdiv(S, bs), triton.cdiv(H, bh)
        t2 = cos if cos2 is None else cos2
        self.grid = (B * n_s * n_h,)
        self.empty = self.grid[0] == 0 or x.numel() == 0
        self.ints = (S, H, D, half, cos.shape[0], t2.shape[0], int(img_w), n_s, n_h, *sx, *so, cos.stride(0),
                     t2.stride(0))
        self.meta = dict(INTERLEAVED=bool(interleaved), FULL_TABLE=bool(full_table), CONJUGATE=bool(conjugate),
                         IS_VARLEN=varlen, HAS_OFFSETS=bool(has_offsets), TWO_D=two_d, COPY_REST=rest > 0,
                         BLOCK_S=bs, BLOCK_H=bh, BLOCK_K=bk, BLOCK_P=bp)
        self.warps = warps
        self.device = x.device
        self.index = x.device.index if x.device.type == "cuda" else None
        self.compiled: dict = {}

    def __call__(self, x: Tensor, out: Tensor, cos: Tensor, sin: Tensor, cos2: Tensor | None, sin2: Tensor | None,
                 offsets: Tensor | None, cu_seqlens: Tensor | None, offset: int) -> None:
        if self.empty:
            return
        if cos2 is None:
            cos2, sin2 = cos, sin
        args = (x, out, cos, sin, cos2, sin2, offsets, cu_seqlens, *self.ints, offset)
        index = self.index
        # (Under the interpreter the first-call path below returns no compiled kernel: nothing is cached.)
        if index is None or index != torch.cuda.current_device() or os.environ.get("CULMEN_FAST_LAUNCH") == "0":
            with device_guard(self.device):
                _launch(self.grid, args, self.meta, self.warps)
            return
        # Triton specializes on each pointer's 16-byte alignment: one check when all are aligned.
        ptrs = x.data_ptr() | out.data_ptr() | cos.data_ptr() | sin.data_ptr() | cos2.data_ptr() | sin2.data_ptr()
        if offsets is not None:
            ptrs |= offsets.data_ptr()
        if cu_seqlens is not None:
            ptrs |= cu_seqlens.data_ptr()
        aligned = True if ptrs & 15 == 0 else tuple(map(_aligned, args[:8]))
        key = (aligned, offset) if offset == 0 else (aligned, offset == 1, offset % 16 == 0, -_I32 <= offset < _I32)
        entry = self.compiled.get(key)
        if entry is None:
            entry = compile_entry(_rotary_kernel, self.grid, args, self.meta, self.warps)
            if entry is not None:
                self.compiled[key] = entry
            return
        run_compiled(entry, self.grid, raw_stream(self.device), args)


_LAUNCHES: dict = {}


def clear_cache() -> None:
    """Forget the cached launch geometries (after changing ``TUNING``)."""
    _LAUNCHES.clear()


def _meta(t: Tensor | None):
    return None if t is None else (t.shape, t.stride(), t.dtype)


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
    key = (x.shape, x.stride(), out.stride(), x.dtype, out.dtype, x.device, _meta(cos), sin.dtype, _meta(cos2),
           None if sin2 is None else sin2.dtype, None if seqlen_offsets is None else seqlen_offsets.dtype,
           None if cu_seqlens is None else (cu_seqlens.shape, cu_seqlens.dtype), int(max_seqlen), bool(interleaved),
           bool(conjugate), bool(full_table), int(img_w), bool(copy_rest))
    la = _LAUNCHES.get(key)
    if la is None:
        if len(_LAUNCHES) >= _MAX_CACHED:
            _LAUNCHES.clear()
        la = _LAUNCHES[key] = Launch(x, out, cos, cos2, cu_seqlens, int(max_seqlen), interleaved, conjugate,
                                     full_table, int(img_w), copy_rest, seqlen_offsets is not None)
    la(x, out, cos, sin, cos2, sin2, seqlen_offsets, cu_seqlens, int(offset))
