"""Attention over a KV cache for decoding (``flash_attn_with_kvcache``): optional rotary on the new
tokens, the new K/V appended **in place** at each row's ``cache_seqlens``, then attention of ``q`` over
each row's filled keys ``[cache_leftpad, cache_seqlens + seqlen_new)`` with the causal diagonal aligned
to the row's last key. Inference only (no backward).

A ``KVCachePlan`` holds what one call signature derives (the checks passed, the dense view of the cache
and the ``AttnPlan`` of the attention, whose forward kernel reads each row's key range itself:
``K_RANGE``, the end computed in-kernel as ``cache_seqlens[b] + seqlen_new``). The values of
``cache_seqlens`` / ``cache_leftpad`` / ``cache_batch_idx`` / ``block_table`` are checked per call on
CPU and, on GPUs, only under ``set_check_values(True)`` (the kernel clamps the key range either way). A
paged cache (``block_table``) or ``cache_batch_idx`` is gathered into a dense ``(B, seqlen_k, hk, d)``
tensor first. The reference path (CPU, fp64) masks each row's range with tensor ops (no host sync).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.attention import checks
from culmen.ops.attention.launch import AttnPlan, TensorSpec
from culmen.ops.backend import check_values_on
from culmen.ops.common.plans import PlanCache
from culmen.ops.rotary.reference import rotary_emb_ref

PLANS = PlanCache("attention_kvcache")


def _positions(cache_seqlens: Tensor, n: int) -> Tensor:
    return cache_seqlens[:, None].to(torch.int64) + torch.arange(n, device=cache_seqlens.device)[None, :]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, interleaved: bool) -> Tensor:
    """Rotary of ``x (B, s, h, d)`` at positions ``pos (B, s)`` (fp32 math, x's dtype out)."""
    return rotary_emb_ref(x.float(), cos[pos].float(), sin[pos].float(), interleaved).to(x.dtype)


def _write(cache: Tensor, new: Tensor, rows: Tensor | None, pos: Tensor, block_table: Tensor | None) -> None:
    """``cache[row(b), pos[b, t]] = new[b, t]`` in place (through the page table when paged)."""
    if block_table is None:
        if rows is None:
            rows = torch.arange(new.shape[0], device=cache.device)
        cache[rows[:, None], pos] = new
        return
    page = cache.shape[1]
    blocks = torch.gather(block_table.to(torch.int64), 1, pos // page)
    cache[blocks, pos % page] = new


class KVCachePlan:
    """Everything ``flash_attn_with_kvcache`` derives from one call signature (see the module docstring)."""

    def __init__(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                 cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                 alibi_slopes, num_splits, return_lse) -> None:
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(t, Tensor) or t.dim() != 4:
                raise ValueError(f"{name} must be a 4-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
            if t.dtype != q.dtype:
                raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        B, sq, h, d = q.shape
        hk = k_cache.shape[2]
        if k_cache.shape != v_cache.shape or k_cache.shape[-1] != d or h % hk:
            raise ValueError(f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} must match, with head "
                             f"dim {d} and a number of heads dividing q's {h}")
        if (k is None) != (v is None):
            raise ValueError("k and v (the new tokens) must be given together")
        if k is not None and (k.dim() != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[2:] != (hk, d)):
            raise ValueError(f"k/v must be (batch={B}, seqlen_new, {hk}, {d}), got {tuple(k.shape)} / "
                             f"{tuple(v.shape)}")
        if block_table is not None:
            if cache_batch_idx is not None:
                raise ValueError("cache_batch_idx cannot be combined with block_table (paged KV)")
            if (not isinstance(block_table, Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2
                    or block_table.shape[0] != B):
                raise TypeError(f"block_table must be int32 (batch={B}, max_blocks), got "
                                f"{getattr(block_table, 'dtype', type(block_table).__name__)} "
                                f"{tuple(getattr(block_table, 'shape', ()))}")
            capacity = block_table.shape[1] * k_cache.shape[1]
        else:
            capacity = k_cache.shape[1]
        s_new = 0 if k is None else k.shape[1]
        if cache_seqlens is not None and not isinstance(cache_seqlens, int) and (
                not isinstance(cache_seqlens, Tensor) or cache_seqlens.dtype != torch.int32
                or tuple(cache_seqlens.shape) != (B,)):
            raise TypeError(f"cache_seqlens must be an int or an int32 tensor of shape ({B},), got "
                            f"{getattr(cache_seqlens, 'dtype', type(cache_seqlens).__name__)} "
                            f"{tuple(getattr(cache_seqlens, 'shape', ()))}")
        for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
            if t is not None and (t.dtype not in (torch.int32, torch.int64) or tuple(t.shape) != (B,)):
                raise TypeError(f"{name} must be an integer tensor of shape ({B},), got {t.dtype} {tuple(t.shape)}")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v), ("rotary_cos", rotary_cos),
                        ("rotary_sin", rotary_sin), ("cache_seqlens", cache_seqlens),
                        ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad),
                        ("block_table", block_table)):
            if isinstance(t, Tensor) and t.device != q.device:  # the kernel reads them through raw pointers
                raise ValueError(f"{name} is on {t.device}, q on {q.device}: all inputs must share a device")
        if (rotary_cos is None) != (rotary_sin is None):
            raise ValueError("rotary_cos and rotary_sin must be given together")
        if rotary_cos is not None and (rotary_cos.dim() != 2 or 2 * rotary_cos.shape[1] > d
                                       or rotary_sin.shape != rotary_cos.shape):
            raise ValueError(f"rotary_cos/rotary_sin must be (seqlen_ro, rotary_dim / 2) with rotary_dim <= {d}, got "
                             f"{tuple(rotary_cos.shape)} / {tuple(rotary_sin.shape)}")
        if not isinstance(num_splits, int) or num_splits < 0:
            raise ValueError(f"num_splits must be a non-negative int, got {num_splits!r}")
        checks.check_common(q, k_cache, v_cache, 0.0, window_size, softcap, alibi_slopes, B, 4,
                            "(batch, seqlen, nheads, headdim)")
        self.B, self.s_new, self.capacity = B, s_new, capacity
        self.device = q.device
        self.rotary = rotary_cos is not None
        self.interleaved = bool(rotary_interleaved)
        # Causal / local queries sit at the new tokens' positions; otherwise all at cache_seqlens.
        self.q_at_tokens = bool(causal) or window_size[0] >= 0 or window_size[1] >= 0
        self.paged = block_table is not None
        self.gather_rows = cache_batch_idx is not None
        self.n_cache_rows = k_cache.shape[0]
        self.return_lse = bool(return_lse)
        self.check_values = q.device.type == "cpu" or check_values_on()
        # What the attention reads: the cache itself, or a dense (B, seqlen_k, hk, d) gather of it.
        if self.paged or self.gather_rows:
            S = capacity if self.paged else k_cache.shape[1]
            shape = (B, S, hk, d)
            strides = (S * hk * d, hk * d, d, 1)
            kd = TensorSpec(shape, strides, k_cache.dtype, k_cache.device)
            vd = TensorSpec(shape, strides, v_cache.dtype, v_cache.device)
        else:
            kd, vd = k_cache, v_cache
        self.attn = AttnPlan("kvcache", q, kd, vd, alibi_slopes, softmax_scale=softmax_scale, causal=causal,
                             window_size=tuple(window_size), softcap=softcap, return_lse=return_lse,
                             k_range=2 if cache_leftpad is not None else 1, k_add=s_new)

    def __call__(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                 cache_leftpad, block_table, alibi_slopes):
        """Append, then attend: ``(out (B, sq, h, d), lse (B, h, sq) fp32 or None)``."""
        B = self.B
        if cache_seqlens is None:  # the caches are full (after the new tokens)
            cache_seqlens = self.capacity - self.s_new
        if type(cache_seqlens) is int:
            cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=self.device)
        if self.check_values:
            checks.check_kvcache_values(cache_seqlens, self.s_new, self.capacity, cache_leftpad, cache_batch_idx,
                                        self.n_cache_rows, block_table, k_cache.shape[0])
        if self.rotary:
            if k is not None:
                k = _rotate(k, rotary_cos, rotary_sin, _positions(cache_seqlens, self.s_new), self.interleaved)
            qpos = (_positions(cache_seqlens, q.shape[1]) if self.q_at_tokens
                    else _positions(cache_seqlens, 1).expand(B, q.shape[1]))
            q = _rotate(q, rotary_cos, rotary_sin, qpos, self.interleaved)
        rows = cache_batch_idx.to(torch.int64) if self.gather_rows else None
        if k is not None:
            pos = _positions(cache_seqlens, self.s_new)
            _write(k_cache, k, rows, pos, block_table)
            _write(v_cache, v, rows, pos, block_table)
        if self.paged:
            blocks = block_table.to(torch.int64)
            kd = k_cache[blocks].reshape(self.attn.k_shape)
            vd = v_cache[blocks].reshape(self.attn.v_shape)
        elif self.gather_rows:
            kd, vd = k_cache[rows], v_cache[rows]
        else:
            kd, vd = k_cache, v_cache
        out, lse, _ = self.attn.forward(q, kd, vd, alibi_slopes, None, store_lse=self.return_lse,
                                        k_start=cache_leftpad, k_end=cache_seqlens)
        return out, lse


def _sig(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def attention_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = None, v: Tensor | None = None,
                      rotary_cos: Tensor | None = None, rotary_sin: Tensor | None = None,
                      cache_seqlens: int | Tensor | None = None, cache_batch_idx: Tensor | None = None,
                      cache_leftpad: Tensor | None = None, block_table: Tensor | None = None,
                      softmax_scale: float | None = None, causal: bool = False,
                      window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, rotary_interleaved: bool = True,
                      alibi_slopes: Tensor | None = None, num_splits: int = 0,
                      return_softmax_lse: bool = False):
    """``flash_attn_with_kvcache`` (arguments, shapes and return as there): ``out (B, sq, h, d)`` or
    ``(out, softmax_lse (B, h, sq) fp32)``; ``k_cache``/``v_cache`` are updated in place."""
    try:
        key = (_sig(q), _sig(k_cache), _sig(v_cache), _sig(k), _sig(v), _sig(rotary_cos), _sig(rotary_sin),
               type(cache_seqlens) is int or _sig(cache_seqlens), _sig(cache_batch_idx), _sig(cache_leftpad),
               _sig(block_table), _sig(alibi_slopes), softmax_scale, causal, window_size, softcap,
               rotary_interleaved, num_splits, return_softmax_lse)
        plan = PLANS.get(key)
    except (AttributeError, TypeError):
        key, plan = None, None
    if plan is None:
        plan = KVCachePlan(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                           cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                           rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse)
        if key is not None:
            PLANS.put(key, plan)
    with torch.no_grad():
        out, lse = plan(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                        cache_leftpad, block_table, alibi_slopes)
    return (out, lse) if return_softmax_lse else out
