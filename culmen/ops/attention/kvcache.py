"""Attention over a KV cache for decoding (``flash_attn_with_kvcache``): optional rotary on the new
tokens, the new K/V appended **in place** at each row's ``cache_seqlens``, then attention of ``q`` over
each row's filled keys ``[cache_leftpad, cache_seqlens + seqlen_new)`` with the causal diagonal aligned
to the row's last key. Inference only (no backward).

The attention is the forward kernel with a per-row key range (``K_RANGE``); the reference path (CPU,
fp64, ``CULMEN_FLASH_TRITON=0``) runs ``attention_ref`` on each row's slice. A paged cache
(``block_table``) or ``cache_batch_idx`` is gathered into a dense ``(B, seqlen_k, hk, d)`` view first.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.attention.reference import attention_ref
from culmen.ops.rotary.reference import rotary_emb_ref


def _positions(cache_seqlens: Tensor, n: int) -> Tensor:
    return cache_seqlens[:, None].to(torch.int64) + torch.arange(n, device=cache_seqlens.device)[None, :]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, interleaved: bool) -> Tensor:
    """Rotary of ``x (B, s, h, d)`` at positions ``pos (B, s)`` (fp32 math, x's dtype out)."""
    return rotary_emb_ref(x.float(), cos[pos].float(), sin[pos].float(), interleaved).to(x.dtype)


def _write(cache: Tensor, new: Tensor, rows: Tensor, pos: Tensor, block_table: Tensor | None) -> None:
    """``cache[row(b), pos[b, t]] = new[b, t]`` in place (through the page table when paged)."""
    if block_table is None:
        cache[rows[:, None], pos] = new
        return
    page = cache.shape[1]
    blocks = torch.gather(block_table.to(torch.int64), 1, pos // page)
    cache[blocks, pos % page] = new


def _dense_view(cache: Tensor, rows: Tensor, block_table: Tensor | None, identity_rows: bool) -> Tensor:
    if block_table is not None:
        B, nb = block_table.shape
        return cache[block_table.to(torch.int64)].reshape(B, nb * cache.shape[1], *cache.shape[2:])
    return cache if identity_rows else cache[rows]


def attention_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None, v: Tensor | None,
                      rotary_cos: Tensor | None, rotary_sin: Tensor | None, cache_seqlens: Tensor,
                      cache_batch_idx: Tensor | None, cache_leftpad: Tensor | None, block_table: Tensor | None, *,
                      softmax_scale: float, causal: bool, window_size: tuple[int, int], softcap: float,
                      rotary_interleaved: bool, alibi_slopes: Tensor | None,
                      use_kernels: bool) -> tuple[Tensor, Tensor]:
    """``q (B, sq, h, d)``, caches ``(B_cache, seqlen_cache, hk, d)`` (or pages ``(num_blocks, page, hk,
    d)`` with ``block_table (B, max_blocks)`` int32), new ``k``/``v`` ``(B, s_new, hk, d)`` or None,
    ``cache_seqlens (B,)`` int32. Returns ``(out (B, sq, h, d), lse (B, h, sq) fp32)``; the caches are
    updated in place. Arguments are validated by ``culmen.flash_attn.flash_attn_with_kvcache``.
    """
    B, sq = q.shape[0], q.shape[1]
    rows = (cache_batch_idx.to(torch.int64) if cache_batch_idx is not None
            else torch.arange(B, device=q.device))
    s_new = 0 if k is None else k.shape[1]
    if rotary_cos is not None:
        local = window_size[0] >= 0 or window_size[1] >= 0
        if k is not None:
            k = _rotate(k, rotary_cos, rotary_sin, _positions(cache_seqlens, s_new), rotary_interleaved)
        # Causal / local queries sit at the new tokens' positions; otherwise all at cache_seqlens.
        qpos = _positions(cache_seqlens, sq) if (causal or local) else _positions(cache_seqlens, 1).expand(B, sq)
        q = _rotate(q, rotary_cos, rotary_sin, qpos, rotary_interleaved)
    if k is not None:
        pos = _positions(cache_seqlens, s_new)
        _write(k_cache, k, rows, pos, block_table)
        _write(v_cache, v, rows, pos, block_table)
    k_end = cache_seqlens.to(torch.int32) + s_new
    kd = _dense_view(k_cache, rows, block_table, cache_batch_idx is None)
    vd = _dense_view(v_cache, rows, block_table, cache_batch_idx is None)
    left, right = window_size[0], (0 if causal else window_size[1])
    if use_kernels:
        from culmen.ops.attention.launch import attention_fwd

        return attention_fwd(q, kd, vd, softmax_scale=softmax_scale, window_left=left, window_right=right,
                             softcap=softcap, alibi_slopes=alibi_slopes, k_start=cache_leftpad, k_end=k_end)
    starts = [0] * B if cache_leftpad is None else [int(x) for x in cache_leftpad.tolist()]
    outs, lses = [], []
    for b, (k0, k1) in enumerate(zip(starts, k_end.tolist())):
        al = alibi_slopes[b:b + 1] if (alibi_slopes is not None and alibi_slopes.dim() == 2) else alibi_slopes
        o, lse = attention_ref(q[b:b + 1], kd[b:b + 1, k0:k1], vd[b:b + 1, k0:k1], causal=causal,
                               window_size=window_size, softcap=softcap, alibi_slopes=al,
                               softmax_scale=softmax_scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs).to(q.dtype), torch.cat(lses).float()
