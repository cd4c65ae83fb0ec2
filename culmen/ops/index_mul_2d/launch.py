"""Launchers of the ``index_mul_2d`` kernels: allocate, pick blocks, launch.

Tensors arrive as the op layer leaves them: 2-D with a contiguous feature dim (any row stride) and a
contiguous 1-D index. ``TUNING`` holds the block rules so a sweep can change them at run time.
"""

from __future__ import annotations

import torch
import triton.language as tl
from torch import Tensor

from culmen.ops.backend import device_guard
from culmen.ops.common.launch import FastLauncher, cdiv, next_pow2
from culmen.ops.index_mul_2d.kernels import (
    _index_mul_2d_bwd_bwd_kernel,
    _index_mul_2d_bwd_kernel,
    _index_mul_2d_bwd_segment_kernel,
    _index_mul_2d_fwd_kernel,
)

_fwd = FastLauncher(_index_mul_2d_fwd_kernel)
_bwd = FastLauncher(_index_mul_2d_bwd_kernel)
_bwd_bwd = FastLauncher(_index_mul_2d_bwd_bwd_kernel)
_segment = FastLauncher(_index_mul_2d_bwd_segment_kernel)

TUNING = {
    # Elements of one (rows x features) tile, and the widest feature block.
    "tile": 4096,
    "max_block_f": 256,
    "num_warps": 4,
    # Cache hints of the forward (in1 kept in L2, in2 / out streamed).
    "fwd_hints": True,
    # Scatter of grad_in1: "segment" (sorted segmented sums, deterministic) or "atomic" (fp32 atomics,
    # only outside deterministic mode).
    "scatter": "segment",
    # Segmented sum: elements per (in1 rows x features) tile (the rows walk their index runs in
    # lockstep), widest feature block, warps.
    "segment_tile": 4096,
    "segment_block_f": 256,
    "segment_warps": 4,
}


def _acc(t: Tensor):
    return tl.float64 if t.dtype == torch.float64 else tl.float32


def _acc_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _blocks(N: int, F: int) -> tuple[int, int, tuple[int, int]]:
    bf = min(TUNING["max_block_f"], next_pow2(max(F, 1)))
    bn = max(1, min(TUNING["tile"] // bf, next_pow2(max(N, 1))))
    return bn, bf, (cdiv(N, bn), cdiv(F, bf))


def index_mul_2d_fwd(in1: Tensor, in2: Tensor, idx: Tensor, out: Tensor | None = None) -> Tensor:
    """``in1[idx] * in2``: ``(N, F)`` in the dtype of ``in2`` (written into ``out`` when given)."""
    N, F = in2.shape
    out = torch.empty((N, F), device=in2.device, dtype=in2.dtype) if out is None else out
    if N * F == 0:
        return out
    bn, bf, grid = _blocks(N, F)
    with device_guard(in2.device):
        _fwd(grid, (out, in1, in2, idx, N, in1.shape[0], F, out.stride(0), in1.stride(0), in2.stride(0)),
             {"ACC": _acc(in2), "HINTS": TUNING["fwd_hints"], "BLOCK_N": bn, "BLOCK_F": bf},
             num_warps=TUNING["num_warps"])
    return out


def _sorted_segments(idx: Tensor, M: int) -> tuple[Tensor, Tensor]:
    """Stable sort permutation of ``idx`` and the ``(M + 1,)`` start of each value's run.

    The sort key is int32 (half the radix passes of int64); int64 indices are clamped to ``[-1, M]``
    first, so an out-of-range index stays out of range instead of wrapping around.
    """
    key = idx
    if M < 2**31 - 1:
        if idx.dtype != torch.int32:
            key = idx.clamp(-1, M).to(torch.int32)
    vals, perm = torch.sort(key, stable=True)
    starts = torch.searchsorted(vals, torch.arange(M + 1, device=idx.device, dtype=vals.dtype))
    return perm, starts


def _segment_bwd(gout: Tensor, in1: Tensor, in2: Tensor, idx: Tensor, M: int, gin1: Tensor | None,
                 gin2: Tensor | None) -> None:
    """The sorted segmented backward: ``gin1[m] = sum_{idx[n] == m} gout[n] * in2[n]`` (in order, fp32) and
    ``gin2 = gout * in1[idx]``, either of them ``None``; ``gin1`` is written in full (zeros where no index)."""
    N, F = gout.shape
    perm, starts = _sorted_segments(idx, M)
    bf = min(TUNING["segment_block_f"], next_pow2(max(F, 1)))
    bm = max(1, min(TUNING["segment_tile"] // bf, next_pow2(max(M, 1))))
    dummy = gout
    with device_guard(gout.device):
        _segment((cdiv(M, bm), cdiv(F, bf)),
                 (gin1 if gin1 is not None else dummy, gin2 if gin2 is not None else dummy, gout, in1, in2, perm,
                  starts, N, M, F, gin1.stride(0) if gin1 is not None else 0,
                  gin2.stride(0) if gin2 is not None else 0, gout.stride(0), in1.stride(0), in2.stride(0)),
                 {"ACC": _acc(in2), "NEED_GIN1": gin1 is not None, "NEED_GIN2": gin2 is not None,
                  "BLOCK_M": bm, "BLOCK_F": bf}, num_warps=TUNING["segment_warps"])


def segment_mul_add(a: Tensor, b: Tensor, idx: Tensor, M: int, out_dtype: torch.dtype) -> Tensor:
    """``zeros(M, F).index_add_(0, idx, a * b)`` in ``out_dtype`` (``a``/``b`` ``(N, F)``), bitwise reproducible.

    The sorted segmented sum: each row of the result adds its products in increasing ``n``, in fp32
    (fp64 for fp64 inputs).
    """
    N, F = a.shape
    out = torch.empty((M, F), device=a.device, dtype=out_dtype)
    if M * F == 0:
        return out
    if N == 0:
        return out.zero_()
    _segment_bwd(a, b, b, idx, M, out, None)
    return out


def _atomic_buffer(M: int, F: int, like: Tensor) -> Tensor:
    return torch.zeros((M, F), device=like.device, dtype=_acc_dtype(like))


def index_mul_2d_bwd(gout: Tensor, in1: Tensor, in2: Tensor, idx: Tensor, need_gin1: bool, need_gin2: bool,
                     deterministic: bool) -> tuple[Tensor | None, Tensor | None]:
    """``(gin1, gin2)`` of ``out = in1[idx] * in2`` for ``gout`` ``(N, F)``; ``None`` where not needed."""
    N, F = in2.shape
    M = in1.shape[0]
    dev = in2.device
    gin2 = torch.empty((N, F), device=dev, dtype=in2.dtype) if need_gin2 else None
    gin1 = None
    atomic = need_gin1 and not deterministic and TUNING["scatter"] == "atomic"
    if need_gin1 and not atomic:
        # One pass writes both gradients (each gout / in2 / in1 row read once, gin1 written once).
        gin1 = torch.empty((M, F), device=dev, dtype=in1.dtype)
        if M * F == 0:
            return gin1, gin2
        if N == 0:
            return gin1.zero_(), gin2
        _segment_bwd(gout, in1, in2, idx, M, gin1, gin2)
        return gin1, gin2
    if atomic:
        gin1 = _atomic_buffer(M, F, in1)
    if N * F and (need_gin2 or atomic):
        bn, bf, grid = _blocks(N, F)
        with device_guard(dev):
            _bwd(grid, (gin1 if atomic else gout, gin2 if need_gin2 else gout, gout, in1, in2, idx, N, M, F,
                        gin1.stride(0) if atomic else 0, gin2.stride(0) if need_gin2 else 0, gout.stride(0),
                        in1.stride(0), in2.stride(0)),
                 {"ACC": _acc(in2), "ATOMIC": atomic, "NEED_GIN1": need_gin1, "NEED_GIN2": need_gin2,
                  "BLOCK_N": bn, "BLOCK_F": bf}, num_warps=TUNING["num_warps"])
    if atomic and gin1.dtype != in1.dtype:
        gin1 = gin1.to(in1.dtype)
    return gin1, gin2


def index_mul_2d_bwd_bwd(gg1: Tensor | None, gg2: Tensor | None, gout: Tensor, in1: Tensor, in2: Tensor, idx: Tensor,
                         need_ggout: bool, need_gin1: bool, need_gin2: bool, deterministic: bool
                         ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(ggout, gin1, gin2)``: the double backward of ``out = in1[idx] * in2`` (see the kernel)."""
    N, F = in2.shape
    M = in1.shape[0]
    dev = in2.device
    ggout = torch.empty((N, F), device=dev, dtype=gout.dtype) if need_ggout else None
    gin2 = torch.empty((N, F), device=dev, dtype=in2.dtype) if need_gin2 else None
    gin1 = None
    scatter = need_gin1 and gg2 is not None
    atomic = scatter and not deterministic and TUNING["scatter"] == "atomic"
    if atomic:
        gin1 = _atomic_buffer(M, F, in1)
    if N * F and (need_ggout or need_gin2 or atomic):
        bn, bf, grid = _blocks(N, F)
        dummy = gout

        def s0(t):
            return t.stride(0) if t is not None else 0

        with device_guard(dev):
            _bwd_bwd(grid, (ggout if need_ggout else dummy, gin1 if atomic else dummy, gin2 if need_gin2 else dummy,
                            gout, gg1 if gg1 is not None else dummy, gg2 if gg2 is not None else dummy, in1, in2, idx,
                            N, M, F, s0(ggout), s0(gin1) if atomic else 0, s0(gin2), gout.stride(0), s0(gg1), s0(gg2),
                            in1.stride(0), in2.stride(0)),
                     {"ACC": _acc(in2), "ATOMIC": atomic, "HAS_GG1": gg1 is not None, "HAS_GG2": gg2 is not None,
                      "NEED_GGOUT": need_ggout, "NEED_GIN1": need_gin1, "NEED_GIN2": need_gin2,
                      "BLOCK_N": bn, "BLOCK_F": bf}, num_warps=TUNING["num_warps"])
    if need_gin1:
        if not scatter:
            gin1 = torch.zeros_like(in1, memory_format=torch.contiguous_format)
        elif not atomic:
            gin1 = segment_mul_add(gg2, gout, idx, M, in1.dtype)
        elif gin1.dtype != in1.dtype:
            gin1 = gin1.to(in1.dtype)
    return ggout, gin1, gin2
