"""Launchers of the fused add + LayerNorm / RMSNorm kernels: allocate, pick blocks, launch.

The block-size rules below were set by sweeps on an H100 (``bench/notes/layer_norm.md``);
``TUNING`` holds them so a sweep can change them at run time without editing code.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from culmen.ops.backend import device_guard, num_programs_hint
from culmen.ops.common.launch import FastLauncher, warps_for
from culmen.ops.layer_norm.kernels import (
    _layer_norm_bwd_chunked_kernel,
    _layer_norm_bwd_dw_kernel,
    _layer_norm_bwd_kernel,
    _layer_norm_fwd_chunked_kernel,
    _layer_norm_fwd_kernel,
)

_fwd = FastLauncher(_layer_norm_fwd_kernel)
_fwd_chunked = FastLauncher(_layer_norm_fwd_chunked_kernel)
_bwd = FastLauncher(_layer_norm_bwd_kernel)
_bwd_chunked = FastLauncher(_layer_norm_bwd_chunked_kernel)
_bwd_dw = FastLauncher(_layer_norm_bwd_dw_kernel)

TUNING = {
    # Largest row (elements) a forward program keeps in registers; longer rows are chunked.
    "fwd_max_resident": 16384,
    # Same for the backward, whose dW/dB accumulators also live in registers.
    "bwd_max_resident": 8192,
    # Elements per program the row-resident kernels aim for (several short rows per program).
    "fwd_elems": 4096,
    "bwd_elems": 4096,
    # Chunk width of the chunked kernels.
    "chunk": 4096,
    # Elements per thread before another warp is added.
    "elems_per_thread": 16,
    "max_warps": 16,
    # Persistent backward programs per multiprocessor.
    "bwd_programs_per_sm": 2,
}


def _warps(elems: int) -> int:
    return warps_for(elems, TUNING["elems_per_thread"], TUNING["max_warps"])


def _row_blocks(N: int, M: int, target: int) -> tuple[int, int]:
    block_n = triton.next_power_of_2(max(N, 1))
    block_m = max(1, min(target // block_n, 64, triton.next_power_of_2(max(M, 1))))
    return block_m, block_n


def _stride0(t: Tensor | None) -> int:
    return t.stride(0) if t is not None else 0


def layer_norm_fwd(x, weight, bias, residual, x1, weight1, bias1, rowscale, seed, eps, dropout_p, is_rms_norm,
                   zero_centered_weight, residual_dtype, out_dtype, store_residual_out, store_mask):
    """Forward of ``culmen::layer_norm_fwd`` on 2-D ``(M, N)`` inputs whose last dim is contiguous.

    Returns ``(y, y1, mean, rstd, residual_out, mask, mask1)``: ``y``/``y1`` ``(M, N)`` in ``out_dtype``;
    ``mean``/``rstd`` ``(M,)`` fp32 (no ``mean`` for RMSNorm); ``residual_out`` ``(M, N)`` in
    ``residual_dtype`` when ``store_residual_out``; bool keep-masks when ``store_mask``. Absent outputs
    are ``None``.
    """
    M, N = x.shape
    dev = x.device
    y = torch.empty((M, N), device=dev, dtype=out_dtype)
    y1 = torch.empty((M, N), device=dev, dtype=out_dtype) if weight1 is not None else None
    mean = torch.empty((M,), device=dev, dtype=torch.float32) if not is_rms_norm else None
    rstd = torch.empty((M,), device=dev, dtype=torch.float32)
    res_out = torch.empty((M, N), device=dev, dtype=residual_dtype) if store_residual_out else None
    has_dropout = dropout_p > 0.0
    mask = torch.empty((M, N), device=dev, dtype=torch.bool) if store_mask else None
    mask1 = torch.empty((M, N), device=dev, dtype=torch.bool) if (store_mask and x1 is not None) else None
    chunked = N > TUNING["fwd_max_resident"]
    if chunked:
        block_m, block_n = 1, min(TUNING["chunk"], triton.next_power_of_2(N))
        launcher = _fwd_chunked
    else:
        block_m, block_n = _row_blocks(N, M, TUNING["fwd_elems"])
        launcher = _fwd
    args = (x, weight, bias, residual, x1, weight1, bias1, rowscale, seed,
            y, y1, res_out, mask, mask1, mean, rstd,
            x.stride(0), _stride0(residual), _stride0(x1), y.stride(0), _stride0(y1), _stride0(res_out),
            M, N, eps, dropout_p)
    meta = dict(IS_RMS=is_rms_norm, HAS_W=weight is not None, HAS_B=bias is not None, HAS_RES=residual is not None,
                HAS_X1=x1 is not None, HAS_W1=weight1 is not None, HAS_B1=bias1 is not None,
                HAS_ROWSCALE=rowscale is not None, HAS_DROPOUT=has_dropout, STORE_MASK=store_mask,
                STORE_RES_OUT=store_residual_out, ZERO_CENTERED=zero_centered_weight,
                BLOCK_M=block_m, BLOCK_N=block_n)
    with device_guard(dev):
        launcher((triton.cdiv(M, block_m),), args, meta, _warps(block_m * block_n))
    return y, y1, mean, rstd, res_out, mask, mask1


def layer_norm_bwd(dy, dy1, dres_out, xs, weight, bias, weight1, bias1, rowscale, seed, mean, rstd, eps, dropout_p,
                   is_rms_norm, zero_centered_weight, recompute_from_y, has_residual, has_x1, x_dtype, x1_dtype,
                   residual_dtype, store_dres):
    """Backward of ``culmen::layer_norm_fwd`` on 2-D inputs.

    ``xs`` is the saved pre-norm sum ``(M, N)`` (or ``y`` when ``recompute_from_y``); ``dy1`` is
    given when ``weight1`` is; ``dres_out`` is the gradient of the returned pre-norm sum, if any.
    Returns ``(dx, dw, db, dw1, db1, dresidual, dx1)``; absent outputs are ``None``.
    """
    M, N = dy.shape
    dev = dy.device
    dx = torch.empty((M, N), device=dev, dtype=x_dtype)
    dx1 = torch.empty((M, N), device=dev, dtype=x1_dtype) if has_x1 else None
    dres = torch.empty((M, N), device=dev, dtype=residual_dtype) if store_dres else None
    flags = dict(IS_RMS=is_rms_norm, HAS_W=weight is not None, HAS_B=bias is not None, HAS_W1=weight1 is not None,
                 ZERO_CENTERED=zero_centered_weight, RECOMPUTE_FROM_Y=recompute_from_y)
    dx_flags = dict(HAS_DRES_OUT=dres_out is not None, STORE_DRES=store_dres, HAS_X1=has_x1,
                    HAS_ROWSCALE=rowscale is not None, HAS_DROPOUT=dropout_p > 0.0)
    strides = (xs.stride(0), dy.stride(0), _stride0(dy1), _stride0(dres_out), dx.stride(0), _stride0(dx1),
               _stride0(dres))
    params = [weight, bias, weight1, bias1]
    with device_guard(dev):
        if N <= TUNING["bwd_max_resident"]:
            block_m, block_n = _row_blocks(N, M, TUNING["bwd_elems"])
            num_warps = _warps(block_m * block_n)
            n_prog = num_programs_hint(dev) * TUNING["bwd_programs_per_sm"]
            n_prog = max(1, min(n_prog, triton.cdiv(M, block_m)))
            rows_per_program = triton.cdiv(M, n_prog)
            n_prog = triton.cdiv(M, rows_per_program)
            partial, partials = _partials(params, n_prog, N, dev)
            _bwd((n_prog,), (xs, weight, bias, weight1, dy, dy1, dres_out, rowscale, seed, mean, rstd,
                             dx, dx1, dres, *partials, *strides, _stride0(partial), M, N, dropout_p,
                         rows_per_program),
                 dict(**flags, HAS_B1=bias1 is not None, **dx_flags, BLOCK_M=block_m, BLOCK_N=block_n), num_warps)
        else:
            block_n = min(TUNING["chunk"], triton.next_power_of_2(N))
            _bwd_chunked((M,), (xs, weight, bias, weight1, dy, dy1, dres_out, rowscale, seed, mean, rstd,
                                dx, dx1, dres, *strides, M, N, dropout_p),
                         dict(**flags, **dx_flags, BLOCK_M=1, BLOCK_N=block_n), _warps(block_n))
            partial = None
            if any(p is not None for p in params):
                col_block = 256
                splits = max(1, min(triton.cdiv(M, 32), 4 * num_programs_hint(dev) // triton.cdiv(N, col_block)))
                rows_per_split = triton.cdiv(M, splits)
                splits = triton.cdiv(M, rows_per_split)
                partial, partials = _partials(params, splits, N, dev)
                _bwd_dw((triton.cdiv(N, col_block), splits),
                        (xs, weight, bias, dy, dy1, mean, rstd, *partials,
                         xs.stride(0), dy.stride(0), _stride0(dy1), _stride0(partial), M, N, rows_per_split),
                        dict(**flags, HAS_B1=bias1 is not None, BLOCK_M=32, BLOCK_N=col_block), 4)
    dw, db, dw1, db1 = _reduce_partials(partial, params)
    return dx, dw, db, dw1, db1, dres, dx1


def _partials(params, rows: int, N: int, dev):
    """One fp32 buffer ``(rows, P, N)`` for the partial sums of the P parameter grads, and a view per
    parameter (``None`` where absent): one allocation and one final reduction for all of them."""
    present = [p is not None for p in params]
    partial = torch.empty((rows, sum(present), N), device=dev, dtype=torch.float32)
    views, k = [], 0
    for ok in present:
        views.append(partial[:, k] if ok else None)
        k += ok
    return partial, views


def _reduce_partials(partial, params):
    if partial is None:
        return [None] * len(params)
    total = partial.sum(0)
    dtypes = {p.dtype for p in params if p is not None}
    if len(dtypes) == 1:  # the usual case: one cast for all rows
        total = total.to(dtypes.pop())
    out, k = [], 0
    for p in params:
        out.append(None if p is None else total[k] if total.dtype == p.dtype else total[k].to(p.dtype))
        k += p is not None
    return out
