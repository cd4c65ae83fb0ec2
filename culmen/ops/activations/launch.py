"""Launchers of the activation kernels: pick the 2-D view, allocate, choose blocks, launch.

``TUNING`` holds the block rules so a sweep on the GPU can change them at run time.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from culmen.ops.activations.kernels import (
    _act_bwd_dbias_kernel,
    _act_bwd_kernel,
    _act_fwd_kernel,
    _glu_bwd_kernel,
    _glu_fwd_kernel,
)
from culmen.ops.backend import device_guard, num_programs_hint
from culmen.ops.common.launch import FastLauncher

ACT_CODES: dict[str, int] = {
    "none": 0, "relu": 1, "sigmoid": 2, "gelu": 3, "gelu_tanh": 4, "sqrelu": 5, "silu": 6, "relu_ge0": 7,
}

_fwd = FastLauncher(_act_fwd_kernel)
_bwd = FastLauncher(_act_bwd_kernel)
_bwd_dbias = FastLauncher(_act_bwd_dbias_kernel)
_glu_fwd = FastLauncher(_glu_fwd_kernel)
_glu_bwd = FastLauncher(_glu_bwd_kernel)

TUNING = {
    # Elements per program of the elementwise kernels, and their warps.
    "block_elems": 4096,
    "warps": 4,
    # Widest column block of a 2-D (per-row) launch; a flat launch uses block_elems.
    "max_block_n": 1024,
    # The bias-grad kernel: tile of one loop step, and programs per multiprocessor.
    "dbias_block_m": 32,
    "dbias_block_n": 128,
    "dbias_warps": 4,
    "dbias_programs_per_sm": 8,
}


def _empty(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> Tensor:
    """Every output buffer comes from here (tests swap in a NaN-poisoning version)."""
    return torch.empty(shape, device=device, dtype=dtype)


def _rows(t: Tensor, N: int) -> Tensor:
    """``t`` as ``(M, N)`` with a contiguous last dim: a view when the strides allow, else a copy."""
    t2 = t.reshape(-1, N)
    return t2 if (t2.stride(-1) == 1 or N <= 1) else t2.contiguous()


def _views(tensors: list[Tensor], per_column: bool) -> tuple[int, int, list[Tensor]]:
    """The ``(M, N)`` views the kernels run on: one flat row when every operand is contiguous and
    nothing is indexed by column; rows of the last dim otherwise."""
    if not per_column and all(t.is_contiguous() for t in tensors):
        n = tensors[0].numel()
        return 1, n, [t.view(1, n) for t in tensors]
    N = tensors[0].shape[-1]
    views = [_rows(t, N) for t in tensors]
    return views[0].shape[0], N, views


def _stride(t: Tensor, M: int) -> int:
    # A flat launch has one row: stride 0 lets Triton's divisibility specialization prove alignment.
    return t.stride(0) if M > 1 else 0


def _blocks(M: int, N: int) -> tuple[int, int, int]:
    elems = TUNING["block_elems"]
    block_n = min(triton.next_power_of_2(max(N, 1)), elems if M == 1 else TUNING["max_block_n"])
    block_m = max(1, min(elems // block_n, triton.next_power_of_2(max(M, 1))))
    n_col_blocks = triton.cdiv(N, block_n)
    return block_m, block_n, n_col_blocks


def _grid(M: int, block_m: int, n_col_blocks: int) -> tuple[int]:
    return (triton.cdiv(M, block_m) * n_col_blocks,)


def _warps(block_m: int, block_n: int) -> int:
    return max(1, min(TUNING["warps"], (block_m * block_n) // 256))


def act_fwd(x: Tensor, bias: Tensor | None, act: str, out: Tensor | None = None) -> Tensor:
    """``act(x + bias)`` of ``x`` ``(..., N)``; ``bias`` ``(N,)`` or ``None``. Returns a contiguous tensor of
    ``x``'s shape and dtype (``out`` when given: contiguous, may be ``x`` itself for in-place)."""
    shape = x.shape
    tensors = [x] if out is None else [x, out]
    M, N, views = _views(tensors, bias is not None)
    x2 = views[0]
    y2 = _empty((M, N), x.device, x.dtype) if out is None else views[1]
    block_m, block_n, ncb = _blocks(M, N)
    with device_guard(x.device):
        _fwd(_grid(M, block_m, ncb), (x2, bias, y2, M, N, _stride(x2, M), _stride(y2, M), ncb),
             dict(ACT=ACT_CODES[act], HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n),
             _warps(block_m, block_n))
    return y2.view(shape) if out is None else out


def act_bwd(g: Tensor, x: Tensor, bias: Tensor | None, act: str, from_output: bool, want_dbias: bool,
            dbias_dtype: torch.dtype, store_out: bool = False, out: Tensor | None = None
            ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Backward of ``act(x + bias)``: ``(dx, dbias, y)``.

    ``g`` and ``x`` ``(..., N)``; ``dx`` has ``x``'s shape and dtype (written into ``out`` when given: a
    contiguous tensor such as ``g`` itself). ``from_output``: ``x`` holds ``act``'s output (none / relu /
    sigmoid). ``want_dbias``: also the column sums of ``dx`` (fp32 accumulation) in ``dbias_dtype``.
    ``store_out``: also return ``y = act(x + bias)`` (recomputed for checkpointing). Absent results are
    ``None``.
    """
    shape = x.shape
    dev = x.device
    tensors = [g, x] if out is None else [g, x, out]
    M, N, views = _views(tensors, bias is not None or want_dbias)
    g2, x2 = views[0], views[1]
    dx2 = _empty((M, N), dev, x.dtype) if out is None else views[2]
    y2 = _empty((M, N), dev, x.dtype) if store_out else None
    meta = dict(ACT=ACT_CODES[act], HAS_BIAS=bias is not None, FROM_OUTPUT=from_output, STORE_OUT=store_out)
    dbias = None
    with device_guard(dev):
        if want_dbias:
            block_m, block_n = TUNING["dbias_block_m"], min(TUNING["dbias_block_n"], triton.next_power_of_2(N))
            ncb = triton.cdiv(N, block_n)
            splits = max(1, min(triton.cdiv(M, block_m),
                                TUNING["dbias_programs_per_sm"] * num_programs_hint(dev) // ncb))
            rows_per_split = triton.cdiv(M, splits)
            splits = triton.cdiv(M, rows_per_split) if M > 0 else 1
            # Every split has rows when M > 0 (splits recomputed above), so no partial row stays unwritten.
            part = _empty((splits, N), dev, torch.float32) if M > 0 else torch.zeros((splits, N), device=dev)
            if M > 0:
                _bwd_dbias((ncb, splits),
                           (g2, x2, bias, dx2, y2, part, M, N, g2.stride(0), x2.stride(0), dx2.stride(0),
                            y2.stride(0) if y2 is not None else 0, rows_per_split),
                           dict(**meta, BLOCK_M=block_m, BLOCK_N=block_n), TUNING["dbias_warps"])
            dbias = part.sum(0).to(dbias_dtype)
        else:
            block_m, block_n, ncb = _blocks(M, N)
            _bwd(_grid(M, block_m, ncb),
                 (g2, x2, bias, dx2, y2, M, N, _stride(g2, M), _stride(x2, M), _stride(dx2, M),
                  _stride(y2, M) if y2 is not None else 0, ncb),
                 dict(**meta, BLOCK_M=block_m, BLOCK_N=block_n), _warps(block_m, block_n))
    dx = out if out is not None else dx2.view(shape)
    return dx, dbias, (y2.view(shape) if y2 is not None else None)


def glu_fwd(x: Tensor, u: Tensor, act: str) -> Tensor:
    """``act(x) * u`` of two ``(..., N)`` tensors of one shape; a contiguous result in ``x``'s dtype."""
    shape = x.shape
    M, N, (x2, u2) = _views([x, u], False)
    y2 = _empty((M, N), x.device, x.dtype)
    block_m, block_n, ncb = _blocks(M, N)
    with device_guard(x.device):
        _glu_fwd(_grid(M, block_m, ncb), (x2, u2, y2, M, N, _stride(x2, M), _stride(u2, M), _stride(y2, M), ncb),
                 dict(ACT=ACT_CODES[act], BLOCK_M=block_m, BLOCK_N=block_n), _warps(block_m, block_n))
    return y2.view(shape)


def glu_bwd(g: Tensor, x: Tensor, u: Tensor, act: str) -> tuple[Tensor, Tensor]:
    """Backward of ``act(x) * u``: ``(dx, du)``, contiguous, in the dtypes of ``x`` and ``u``."""
    shape = x.shape
    dev = x.device
    M, N, (g2, x2, u2) = _views([g, x, u], False)
    dx2 = _empty((M, N), dev, x.dtype)
    du2 = _empty((M, N), dev, u.dtype)
    block_m, block_n, ncb = _blocks(M, N)
    with device_guard(dev):
        _glu_bwd(_grid(M, block_m, ncb),
                 (g2, x2, u2, dx2, du2, M, N, _stride(g2, M), _stride(x2, M), _stride(u2, M), _stride(dx2, M),
                  _stride(du2, M), ncb),
                 dict(ACT=ACT_CODES[act], BLOCK_M=block_m, BLOCK_N=block_n), _warps(block_m, block_n))
    return dx2.view(shape), du2.view(shape)
