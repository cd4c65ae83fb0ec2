"""Argument checks of the attention ops, run once per call signature when a plan is built, and the
value checks of index tensors (``cu_seqlens``, ``cache_seqlens``, page tables), run per call on CPU
tensors always and on GPUs only under ``culmen.ops.backend.set_check_values(True)`` (they read the
values back to the host). The kernels clamp every index they read, so unchecked bad values give
wrong numbers, never an access outside a tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn",) if hasattr(torch, n))
MAX_HEADDIM = 512


def check_tensor(name: str, t) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_common(q, k, v, dropout_p, window_size, softcap, alibi_slopes, batch, rank: int, layout: str,
                 v_dim_ok: bool = False, fp8_ok: bool = False) -> None:
    """Dtypes, ranks, devices, head counts and dims of ``q``/``k``/``v`` and the scalar options shared by
    the dense, varlen and KV-cache forms. Raises ``TypeError`` / ``ValueError`` naming the argument.
    FA3's forms pass ``v_dim_ok`` (v's head dim may differ from q/k's) and ``fp8_ok`` (float8_e4m3fn)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
    if q.dtype not in FLOATS and not (fp8_ok and q.dtype in FP8):
        allowed = "float16/bfloat16/float32/float64" + ("/float8_e4m3fn" if fp8_ok else "")
        raise TypeError(f"q must be {allowed}, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {t.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: all inputs must share a device")
    d = q.shape[-1]
    if not 0 < d <= MAX_HEADDIM:
        raise ValueError(f"q head dim must be in [1, {MAX_HEADDIM}], got {d}")
    for name, t in (("k", k), ("v", v)):
        if t.shape[-1] != d and not (name == "v" and v_dim_ok):
            raise ValueError(f"{name} head dim {t.shape[-1]} must equal q's head dim {d}")
    if not 0 < v.shape[-1] <= MAX_HEADDIM:
        raise ValueError(f"v head dim must be in [1, {MAX_HEADDIM}], got {v.shape[-1]}")
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v shape {tuple(v.shape)} must match k shape {tuple(k.shape)}")
    h, hk = q.shape[-2], k.shape[-2]
    if hk == 0 or h % hk != 0:
        raise ValueError(f"nheads of q ({h}) must be a multiple of nheads of k/v ({hk})")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise ValueError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    if window_size[0] < -1 or window_size[1] < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {tuple(window_size)}")
    if float(softcap) < 0.0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap}")
    if alibi_slopes is not None:
        check_tensor("alibi_slopes", alibi_slopes)
        if not alibi_slopes.is_floating_point():
            raise TypeError(f"alibi_slopes must be a float tensor (fp32), got {alibi_slopes.dtype}")
        if tuple(alibi_slopes.shape) not in ((h,), (batch, h)):
            raise ValueError(f"alibi_slopes must have shape ({h},) or ({batch}, {h}), got "
                             f"{tuple(alibi_slopes.shape)}")


def check_dense(q, k, v) -> None:
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} batch size {t.shape[0]} must equal q's batch size {q.shape[0]}")


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    """Dtype, rank and length of the ``cu_seqlens`` and the type of the ``max_seqlen`` (not values)."""
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, t)
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
        if t.dim() != 1 or t.shape[0] < 2:
            raise ValueError(f"{name} must be 1-D of length batch + 1 >= 2, got shape {tuple(t.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} "
                         "must have the same length (batch + 1)")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, (int, torch.SymInt)) or m < 0:
            raise ValueError(f"{name} must be a non-negative Python int, got {m!r}")


def check_cu_values(name: str, cu: Tensor, total: int, max_len: int, max_name: str) -> None:
    """``cu`` starts at a row ``>= 0``, never decreases, ends at most at ``total``, and no sequence is
    longer than ``max_len``. Reads ``cu`` back to the host."""
    vals = cu.tolist()
    if vals[0] < 0:
        raise ValueError(f"{name} must start at a row >= 0, got {vals[0]}")
    lens = [b - a for a, b in zip(vals, vals[1:])]
    if min(lens) < 0:
        raise ValueError(f"{name} must be non-decreasing, got {vals}")
    if vals[-1] > total:
        raise ValueError(f"{name} ends at {vals[-1]} but the packed tensor has only {total} rows")
    if max(lens) > max_len:
        raise ValueError(f"{max_name}={max_len} is smaller than the longest sequence in {name} ({max(lens)})")


class CacheCapacityError(ValueError, RuntimeError):
    """``cache_seqlens`` plus the new tokens beyond what a KV cache (or its ``block_table``'s pages) holds.
    A ``ValueError`` like culmen's other bad-value errors, and a ``RuntimeError`` like flash_attn's own
    check of the paged cache (a ``TORCH_CHECK``), so code written for either catches it."""


def capacity_where(capacity: int, page: int | None) -> str:
    """What holds ``capacity`` positions, for ``CacheCapacityError`` messages."""
    if page is None:
        return f"the {capacity} positions of a k_cache/v_cache row"
    return (f"the {capacity // page} pages of {page} rows that a block_table row lists ({capacity} positions; "
            f"give block_table more columns)")


def check_kvcache_values(seqlens: Tensor | int, s_new: int, capacity: int, page: int | None,
                         leftpad: Tensor | None, batch_idx: Tensor | None, n_cache_rows: int,
                         block_table: Tensor | None) -> None:
    """``0 <= cache_seqlens``, ``cache_seqlens + seqlen_new <= capacity`` (``CacheCapacityError`` naming
    ``block_table`` when paged: ``page`` is its page size), ``0 <= cache_leftpad <= cache_seqlens``,
    ``cache_batch_idx`` rows and ``block_table`` pages inside the caches (``n_cache_rows`` rows or pages).
    Reads tensor values back to the host (a Python int ``seqlens`` costs nothing)."""
    lens = [seqlens] if isinstance(seqlens, int) else seqlens.tolist()
    if min(lens) < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got {lens}")
    if max(lens) + s_new > capacity:
        raise CacheCapacityError(f"cache_seqlens + seqlen_new (the new k/v) exceed {capacity_where(capacity, page)}: "
                                 f"got cache_seqlens={lens} with seqlen_new={s_new}")
    if leftpad is not None:
        pads = leftpad.tolist()
        if any(p < 0 or p > n for p, n in zip(pads, lens * len(pads) if len(lens) == 1 else lens)):
            raise ValueError(f"cache_leftpad must be in [0, cache_seqlens], got {pads} for cache_seqlens={lens}")
    if batch_idx is not None:
        rows = batch_idx.tolist()
        if min(rows) < 0 or max(rows) >= n_cache_rows:
            raise ValueError(f"cache_batch_idx must index the {n_cache_rows} cache rows, got {rows}")
    if block_table is not None and block_table.numel():
        lo, hi = int(block_table.min()), int(block_table.max())
        if lo < 0 or hi >= n_cache_rows:
            raise ValueError(f"block_table entries must index the {n_cache_rows} cache pages, got values in "
                             f"[{lo}, {hi}]")
