"""``flash_attn_combine``: merge split-KV partial attention results by their log-sum-exp.

A split-KV (flash-decoding) forward computes, for every query row, one partial output ``o_s`` and one
log-sum-exp ``lse_s`` per split of the keys. The exact result is ``sum_s exp(lse_s - L) * o_s`` with
``L = log(sum_s exp(lse_s))``. A split that saw no key has ``lse_s = -inf``: its weight is 0 and its
partial output is never read (it may hold anything, NaN included). A row whose splits are all empty
gets output 0 and ``lse = -inf`` (FA3's combine does the same).

Two paths with the same math: a Triton kernel (GPUs, and the CPU interpreter under
``CULMEN_BACKEND=triton``) and a PyTorch reference (CPU). Statistics are fp32 (fp64 for fp64 partials).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from culmen.ops.backend import choose_backend

__all__ = ["flash_attn_combine", "combine_ref", "combine_blocks"]

_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_MAX_SPLITS = 256  # FA3's limit; the kernel holds every split's lse of a row block in registers


@triton.jit
def _merge_stats(lse, AXIS: tl.constexpr, EMPTY_LSE: tl.constexpr):
    """``(reference max, 1 / sum of the weights, merged lse)`` of the splits' ``lse`` (fp32, splits along
    ``AXIS``): the weights are ``exp(lse_s - max)``. A row no split saw (every ``lse_s`` ``-inf``) gets a 0
    reference (``exp()`` stays finite, every weight 0), ``1 / sum`` 0 and lse ``EMPTY_LSE``, with no ``1 / 0`` or
    ``log(0)`` evaluated."""
    m = tl.max(lse, AXIS)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(lse - tl.expand_dims(m_safe, AXIS)), AXIS)
    seen = total > 0.0
    safe_total = tl.where(seen, total, 1.0)
    return m_safe, tl.where(seen, 1.0 / safe_total, 0.0), tl.where(seen, tl.log(safe_total) + m, EMPTY_LSE)


@triton.jit
def _combine_kernel(O_part, LSE_part, Out, LSE_out, n_rows, S, H, D, num_splits,
                    so_split, so_b, so_s, so_h, so_d,
                    sl_split, sl_b, sl_s, sl_h,
                    out_b, out_s, out_h, out_d,
                    lo_b, lo_s, lo_h,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLIT: tl.constexpr,
                    EMPTY_LSE: tl.constexpr = float("-inf")):
    pid_m = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n_rows
    h = rows % H
    t = rows // H
    s = t % S
    b = t // S
    splits = tl.arange(0, BLOCK_SPLIT)
    smask = splits < num_splits
    lse_row = b * sl_b + s * sl_s + h * sl_h
    lse = tl.load(LSE_part + lse_row[:, None] + splits[None, :].to(tl.int64) * sl_split,
                  mask=rmask[:, None] & smask[None, :], other=float("-inf")).to(tl.float32)
    m_safe, inv, lse_final = _merge_stats(lse, 1, EMPTY_LSE)
    if pid_d == 0:
        tl.store(LSE_out + b * lo_b + s * lo_s + h * lo_h, lse_final, mask=rmask)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    o_row = b * so_b + s * so_s + h * so_h
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for sp in range(0, num_splits):
        ls = tl.load(LSE_part + lse_row + sp * sl_split, mask=rmask, other=float("-inf")).to(tl.float32)
        w = tl.exp(ls - m_safe) * inv
        # Empty splits are not read at all: their partial output may be garbage.
        live = rmask & (w > 0.0)
        o = tl.load(O_part + o_row[:, None] + sp * so_split + cols[None, :].to(tl.int64) * so_d,
                    mask=live[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        acc += w[:, None] * o
    tl.store(Out + (b * out_b + s * out_s + h * out_h)[:, None] + cols[None, :].to(tl.int64) * out_d,
             acc.to(Out.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _combine_rows_kernel(O_part, LSE_part, Out, LSE_out, S, H, D, num_splits,
                         so_split, so_b, so_s, so_h, so_d,
                         sl_split, sl_b, sl_s, sl_h,
                         out_b, out_s, out_h, out_d,
                         lo_b, lo_s, lo_h,
                         BLOCK_SPLIT: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
                         EMPTY_LSE: tl.constexpr = float("-inf")):
    """The merge of ``_combine_kernel`` with one program per row: the ``(CHUNK, BLOCK_D)`` partial outputs of
    ``CHUNK`` splits are loaded at once instead of one split after another. Split-KV decoding merges few rows
    (batch 1 over 8 KV heads: 32 rows, 2 programs of ``_combine_kernel``) of many splits, where a loop of
    dependent-latency loads per split is what the merge costs."""
    row = tl.program_id(0).to(tl.int64)
    h = row % H
    t = row // H
    s = t % S
    b = t // S
    splits = tl.arange(0, BLOCK_SPLIT)
    lse_row = b * sl_b + s * sl_s + h * sl_h
    lse = tl.load(LSE_part + lse_row + splits.to(tl.int64) * sl_split, mask=splits < num_splits,
                  other=float("-inf")).to(tl.float32)
    m_safe, inv, lse_final = _merge_stats(lse, 0, EMPTY_LSE)
    if tl.program_id(1) == 0:
        tl.store(LSE_out + b * lo_b + s * lo_s + h * lo_h, lse_final)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    o_row = O_part + b * so_b + s * so_s + h * so_h + cols.to(tl.int64)[None, :] * so_d
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    part = tl.arange(0, CHUNK)
    for c0 in range(0, num_splits, CHUNK):
        sp = c0 + part
        ls = tl.load(LSE_part + lse_row + sp.to(tl.int64) * sl_split, mask=sp < num_splits, other=float("-inf"))
        w = tl.exp(ls.to(tl.float32) - m_safe) * inv
        # empty splits are not read: their partial output may be garbage
        o = tl.load(o_row + sp.to(tl.int64)[:, None] * so_split, mask=(w > 0.0)[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w[:, None] * o, 0)
    tl.store(Out + b * out_b + s * out_s + h * out_h + cols.to(tl.int64) * out_d, acc.to(Out.dtype.element_ty),
             mask=cmask)


def combine_rows_blocks(n_splits: int, D: int) -> tuple[int, int, int, int]:
    """``(BLOCK_SPLIT, CHUNK, BLOCK_D, num_warps)`` of ``_combine_rows_kernel``: a chunk of at most 4096
    partial values in flight per program (32 registers a thread at 4 warps)."""
    block_split = triton.next_power_of_2(n_splits)
    block_d = min(128, triton.next_power_of_2(D))
    return block_split, max(1, min(block_split, 4096 // block_d)), block_d, 4


def combine_blocks(n_splits: int, D: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_D, BLOCK_SPLIT)`` of the combine kernel for ``n_splits`` splits of head dim ``D``."""
    block_split = triton.next_power_of_2(n_splits)
    # the lse tile (BLOCK_M x BLOCK_SPLIT) stays in registers
    return (16 if block_split <= 64 else 4), min(128, triton.next_power_of_2(D)), block_split


def combine_ref(out_partial: Tensor, lse_partial: Tensor) -> tuple[Tensor, Tensor]:
    """The merge in PyTorch: ``out_partial (splits, ..., d)``, ``lse_partial (splits, ...)`` ->
    ``(out (..., d), lse (...))`` in fp32 (fp64 for fp64 inputs), same math as the kernel."""
    dt = torch.float64 if out_partial.dtype == torch.float64 else torch.float32
    lse = lse_partial.to(dt)
    m = lse.amax(0)
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    w = torch.exp(lse - m_safe)
    total = w.sum(0)
    lse_out = torch.log(total) + m
    w = w * torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    w = w.unsqueeze(-1)
    o = torch.where(w > 0, out_partial.to(dt), torch.zeros((), dtype=dt, device=out_partial.device))
    return (w * o).sum(0), lse_out


def flash_attn_combine(out_partial: Tensor, lse_partial: Tensor, out: Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Merge split-KV partials (FA3's ``flash_attn_combine``).

    Args:
        out_partial: ``(num_splits, batch, seqlen, nheads, headdim)`` fp32 (fp64 also accepted), any strides.
        lse_partial: ``(num_splits, batch, seqlen, nheads)`` fp32, any strides (FA3 wants seqlen contiguous,
            e.g. a transposed ``(num_splits, batch, nheads, seqlen)`` buffer; culmen takes any layout).
            ``-inf`` marks a split that saw no key.
        out: optional ``(batch, seqlen, nheads, headdim)`` tensor of ``out_dtype`` written in place.
        out_dtype: fp32 (default: ``out_partial``'s dtype), fp16 or bf16.

    Returns:
        ``(out (batch, seqlen, nheads, headdim), softmax_lse (batch, seqlen, nheads) fp32)``; as in FA3 the
        lse is a transposed view of a ``(batch, nheads, seqlen)`` buffer. ``num_splits`` may be 1 (FA3's
        kernel leaves the output unwritten then; culmen copies the single split).
    """
    if not isinstance(out_partial, Tensor) or not isinstance(lse_partial, Tensor):
        raise TypeError("out_partial and lse_partial must be torch.Tensors, got "
                        f"{type(out_partial).__name__} / {type(lse_partial).__name__}")
    if out_partial.dim() != 5:
        raise ValueError(f"out_partial must be (num_splits, batch, seqlen, nheads, headdim), got shape "
                         f"{tuple(out_partial.shape)}")
    n_splits, B, S, H, D = out_partial.shape
    if tuple(lse_partial.shape) != (n_splits, B, S, H):
        raise ValueError(f"lse_partial must be (num_splits, batch, seqlen, nheads) = {(n_splits, B, S, H)}, got "
                         f"{tuple(lse_partial.shape)}")
    if out_partial.dtype not in (torch.float32, torch.float64) or lse_partial.dtype not in (torch.float32,
                                                                                           torch.float64):
        raise TypeError(f"out_partial / lse_partial must be fp32, got {out_partial.dtype} / {lse_partial.dtype}")
    if n_splits < 1 or n_splits > _MAX_SPLITS:
        raise ValueError(f"num_splits (out_partial.shape[0]) must be in [1, {_MAX_SPLITS}], got {n_splits}")
    if lse_partial.device != out_partial.device:
        raise ValueError(f"lse_partial is on {lse_partial.device}, out_partial on {out_partial.device}")
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else out_partial.dtype
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be fp32, fp16 or bf16, got {out_dtype}")
    if out is not None:
        if not isinstance(out, Tensor) or tuple(out.shape) != (B, S, H, D) or out.dtype != out_dtype:
            raise ValueError(f"out must be a {out_dtype} tensor of shape {(B, S, H, D)}, got "
                             f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")
        if out.device != out_partial.device:
            raise ValueError(f"out is on {out.device}, out_partial on {out_partial.device}")
    else:
        out = torch.empty((B, S, H, D), dtype=out_dtype, device=out_partial.device)
    lse_dt = torch.float64 if out_partial.dtype == torch.float64 else torch.float32
    lse_buf = torch.empty((B, H, S), dtype=lse_dt, device=out_partial.device)
    lse_out = lse_buf.transpose(1, 2)
    n_rows = B * S * H
    if n_rows == 0 or D == 0:  # nothing to launch; the lse still follows the rule
        if n_rows:
            out_lse = combine_ref(out_partial, lse_partial)[1]
            lse_out.copy_(out_lse)
        return out, lse_out
    if choose_backend(out_partial.device) == "triton":
        block_m, block_d, block_split = combine_blocks(n_splits, D)
        grid = (triton.cdiv(n_rows, block_m), triton.cdiv(D, block_d))
        _combine_kernel[grid](out_partial, lse_partial, out, lse_buf, n_rows, S, H, D, n_splits,
                              *out_partial.stride(), *lse_partial.stride(), *out.stride(),
                              lse_out.stride(0), lse_out.stride(1), lse_out.stride(2),
                              BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_SPLIT=block_split)
    else:
        o, lse = combine_ref(out_partial, lse_partial)
        out.copy_(o)
        lse_out.copy_(lse)
    return out, lse_out
