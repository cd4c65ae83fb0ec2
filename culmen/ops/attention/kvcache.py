"""Attention over a KV cache for decoding (``flash_attn_with_kvcache``): optional rotary on the new
tokens, the new K/V appended **in place** at each row's ``cache_seqlens``, then attention of ``q`` over
each row's filled keys ``[cache_leftpad, cache_seqlens + seqlen_new)`` with the causal diagonal aligned
to the row's last key. Inference only (no backward).

A ``KVCachePlan`` holds what one call signature derives (the checks passed, the dense view of the cache
and the ``AttnPlan`` of the attention, whose forward kernel reads each row's key range itself:
``K_RANGE``, the end computed in-kernel as ``cache_seqlens[b] + seqlen_new``). A paged cache
(``block_table``) or ``cache_batch_idx`` is gathered into a dense ``(B, seqlen_k, hk, d)`` tensor first, except
when the Triton kernel decodes (at most ``SPLIT_MAX_SEQLEN_Q`` query rows) or splits the keys (``num_splits > 1``,
or chosen by ``launch.kvcache_splits``): it then reads the pages through the (clamped) page table, one table load
per key block where the page size is a multiple of the block (``TUNING["paged_block"]``). Under split-KV the splits'
partial results are merged by their lse, in the split kernel itself by the last split program of each row block
to finish (``TUNING["fused_merge"]``; counters cached per plan and stream, see ``AttnPlan._forward_split``) or by
a second kernel.

Bad values (memory safety first, DESIGN.md): what shapes alone decide is checked when the plan is built
(``seqlen_new`` larger than the cache, a cache with fewer rows than the batch, rotary tables shorter than
the cache); the values of ``cache_seqlens`` / ``cache_leftpad`` / ``cache_batch_idx`` / ``block_table``
are checked per call on CPU tensors and, on GPUs, under ``set_check_values(True)`` (a host sync; an int
``cache_seqlens`` is always checked). Too long a sequence raises ``CacheCapacityError`` (a
``ValueError`` and, as flash_attn's check, a ``RuntimeError`` naming ``block_table`` when paged). Unchecked,
no value can make culmen touch memory outside the given tensors: the append kernel skips every write
outside the caches, the PyTorch append sends such writes nowhere (``_safe_write``), page numbers, cache
rows and rotary positions are clamped before any gather, and the attention kernel clamps each key range.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.attention import checks
from culmen.ops.attention.kernels import _kv_append_kernel
from culmen.ops.attention.launch import SPLIT_MAX_SEQLEN_Q, AttnPlan, TensorSpec, kvcache_splits, use_kernels
from culmen.ops.backend import check_values_on
from culmen.ops.common.launch import Launch, cdiv, next_pow2, stream_getter
from culmen.ops.common.launch import aligned_16 as _aligned
from culmen.ops.common.plans import PlanCache
from culmen.ops.rotary import rotary
from culmen.ops.rotary.reference import rotary_emb_ref

PLANS = PlanCache("attention_kvcache")


def _positions(cache_seqlens: Tensor, n: int) -> Tensor:
    return cache_seqlens[:, None].to(torch.int64) + torch.arange(n, device=cache_seqlens.device)[None, :]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, interleaved: bool) -> Tensor:
    """Rotary of ``x (B, s, h, d)`` at positions ``pos (B, s)`` (fp32 math, x's dtype out); positions are
    clamped into the tables (only unchecked bad ``cache_seqlens`` can reach past them)."""
    pos = pos.clamp(0, cos.shape[0] - 1)
    return rotary_emb_ref(x.float(), cos[pos].float(), sin[pos].float(), interleaved).to(x.dtype).contiguous()


def _safe_write(cache: Tensor, new: Tensor, rows: Tensor | None, pos: Tensor, block_table: Tensor | None) -> None:
    """``cache[row(b), pos[b, t]] = new[b, t]`` in place (through the page table when paged), in PyTorch,
    for any values of ``rows`` / ``pos`` / ``block_table`` and without a host sync.

    Every index is clamped into the cache first; a write whose unclamped target is outside the cache is
    then sent to the target of the first valid write with that write's value (a duplicate, so the order
    of the scatter cannot matter), or, when no write is valid, writes the old value of its clamped target
    back. Valid writes all land; invalid ones change nothing."""
    n_rows, S = cache.shape[0], cache.shape[1]
    if block_table is None:
        if rows is None:
            rows = torch.arange(new.shape[0], device=cache.device)
        ok = (rows[:, None] >= 0) & (rows[:, None] < n_rows) & (pos >= 0) & (pos < S)
        r = rows.clamp(0, n_rows - 1)[:, None].expand_as(pos)
        c = pos.clamp(0, S - 1)
    else:
        cap = block_table.shape[1] * S
        ok = (pos >= 0) & (pos < cap)
        p = pos.clamp(0, cap - 1)
        blocks = torch.gather(block_table.to(torch.int64), 1, p // S)
        ok = ok & (blocks >= 0) & (blocks < n_rows)
        r, c = blocks.clamp(0, n_rows - 1), p % S
    ok, r, c = ok.reshape(-1), r.reshape(-1), c.reshape(-1)
    vals = new.reshape(-1, *new.shape[2:])
    first = torch.argmax(ok.to(torch.int8))  # the first valid write (0 when there is none)
    r0, c0 = r[first], c[first]
    v0 = torch.where(ok[first], vals[first], cache[r0, c0])
    sel = ok.view(-1, *([1] * (vals.dim() - 1)))
    cache[torch.where(ok, r, r0), torch.where(ok, c, c0)] = torch.where(sel, vals, v0.to(vals.dtype))


def _gather_index(idx: Tensor, n: int) -> Tensor:
    """int64 ``idx`` clamped into ``[0, n)`` for a gather (bad unchecked values read a wrong row, never
    outside the tensor)."""
    return idx.to(torch.int64).clamp(0, n - 1)


class KVCachePlan:
    """Everything ``flash_attn_with_kvcache`` derives from one call signature (see the module docstring)."""

    def __init__(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                 cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                 alibi_slopes, num_splits, return_lse, attention_chunk: int = 0, descale: bool = False,
                 qv: Tensor | None = None) -> None:
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(t, Tensor) or t.dim() != 4:
                raise ValueError(f"{name} must be a 4-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
            if t.dtype != q.dtype:
                raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        B, sq, h, d = q.shape
        hk = k_cache.shape[2]
        dv = v_cache.shape[-1]  # FA3: V may have its own head dim
        if (k_cache.shape[:-1] != v_cache.shape[:-1] or k_cache.shape[-1] != d or hk == 0 or h % hk
                or not 0 < dv <= checks.MAX_HEADDIM):
            raise ValueError(f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} must match (but in "
                             f"v's head dim), with k's head dim {d} and a number of heads dividing q's {h}")
        if k_cache.shape[0] == 0 or k_cache.shape[1] == 0:
            raise ValueError(f"k_cache/v_cache must hold at least one row of one position, got {tuple(k_cache.shape)}")
        if (k is None) != (v is None):
            raise ValueError("k and v (the new tokens) must be given together")
        if k is not None and (k.dim() != 4 or k.shape[:-1] != v.shape[:-1] or k.shape[0] != B
                              or k.shape[2:] != (hk, d) or v.shape[-1] != dv):
            raise ValueError(f"k/v must be (batch={B}, seqlen_new, {hk}, {d} / {dv}), got {tuple(k.shape)} / "
                             f"{tuple(v.shape)}")
        if k is not None and (k.dtype != q.dtype or v.dtype != q.dtype):
            raise TypeError(f"k/v must have q's dtype {q.dtype}, got {k.dtype} / {v.dtype}")
        page = None
        if block_table is not None:
            if cache_batch_idx is not None:
                raise ValueError("cache_batch_idx cannot be combined with block_table (paged KV)")
            if (not isinstance(block_table, Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2
                    or block_table.shape[0] != B or block_table.shape[1] == 0):
                raise TypeError(f"block_table must be int32 (batch={B}, max_blocks >= 1), got "
                                f"{getattr(block_table, 'dtype', type(block_table).__name__)} "
                                f"{tuple(getattr(block_table, 'shape', ()))}")
            page = k_cache.shape[1]
            capacity = block_table.shape[1] * page
        else:
            capacity = k_cache.shape[1]
            if cache_batch_idx is None and k_cache.shape[0] < B:
                raise ValueError(f"k_cache/v_cache have {k_cache.shape[0]} rows for a batch of {B}: give one row per "
                                 "batch row, or cache_batch_idx")
        s_new = 0 if k is None else k.shape[1]
        if s_new > capacity:  # no value of cache_seqlens can fit: an error without looking at any value
            raise checks.CacheCapacityError(f"seqlen_new={s_new} new k/v exceed "
                                            f"{checks.capacity_where(capacity, page)}")
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
        if rotary_cos is not None and rotary_cos.shape[0] < capacity:  # flash_attn's check: a row per position
            raise ValueError(f"rotary_cos/rotary_sin must have a row for each of the cache's {capacity} positions, "
                             f"got seqlen_ro={rotary_cos.shape[0]}")
        if not isinstance(num_splits, int) or num_splits < 0:
            raise ValueError(f"num_splits must be a non-negative int, got {num_splits!r}")
        checks.check_common(q, k_cache, v_cache, 0.0, window_size, softcap, alibi_slopes, B, 4,
                            "(batch, seqlen, nheads, headdim)", True, True)
        if qv is not None:
            from culmen.ops.attention.op import check_qv

            check_qv(qv, q, v_cache)
        if q.dtype in checks.FP8 and rotary_cos is not None:
            raise ValueError("rotary_cos/rotary_sin cannot rotate float8 q/k: rotate before quantizing")
        self.B, self.s_new, self.capacity, self.page = B, s_new, capacity, page
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
        # Pack-GQA (FA3's pack_gqa) for one-token decoding: P of the G = h / hk query heads that share a KV head
        # become P query rows of one program (P the largest divisor of G up to the 16-row decode tile), so each
        # KV row is read G / P times instead of G. Exact when the rows need no per-row position: one query
        # (causal is then no mask: it sees every key), no window, chunk, ALiBi (slopes per query head) or qv.
        # ``q (B, 1, h, d)`` is read as ``(B, P, h / P, d)`` through its own strides (no copy): query head
        # ``j * P + p`` is row ``p`` of packed head ``j``, whose KV head is ``j // (G / P)``.
        self.pack_rows = pack_gqa_rows(h, hk)
        self.pack = (sq == 1 and self.pack_rows > 1 and alibi_slopes is None and tuple(window_size) == (-1, -1)
                     and attention_chunk == 0 and qv is None and use_kernels(q.device, q.dtype, max(d, dv)))
        rows, heads = (self.pack_rows, h // self.pack_rows) if self.pack else (sq, h)
        # Split-KV (flash-decoding): num_splits > 1 as given, 0 automatic (GPU decoding that would not fill the
        # SMs), fixed per plan; the work units are the programs' (batch, query head) pairs.
        self.n_splits = kvcache_splits(num_splits, q.device, q.dtype, B, heads, rows, capacity, d, dv,
                                       paged=self.paged, page=page or 0, k_range=2 if cache_leftpad is not None else 1)
        # A paged cache is read by the kernel through its page table (no gather) under split-KV and, unsplit, when
        # decoding: gathering the pages into a dense copy first costs a read and a write of the whole cache per
        # call (H100, B8 L8192 page 256: 0.30 ms unsplit through the gather against 0.10 ms for a dense cache).
        self.paged_direct = self.paged and (self.n_splits > 1 or (
            sq <= SPLIT_MAX_SEQLEN_Q and use_kernels(q.device, q.dtype, max(d, dv))))
        self.table_contiguous = self.paged and block_table.is_contiguous()
        paged_strides = None
        # What the attention reads: the cache itself, or a dense (B, seqlen_k, hk, d) gather of it.
        if self.paged_direct:
            kd = TensorSpec((B, capacity, hk, d), (capacity * hk * d, hk * d, d, 1), k_cache.dtype, k_cache.device)
            vd = TensorSpec((B, capacity, hk, dv), (capacity * hk * dv, hk * dv, dv, 1), v_cache.dtype,
                            v_cache.device)
            paged_strides = (tuple(k_cache.stride()[:3]), tuple(v_cache.stride()[:3]))
        elif self.paged or self.gather_rows:
            S = capacity if self.paged else k_cache.shape[1]
            kd = TensorSpec((B, S, hk, d), (S * hk * d, hk * d, d, 1), k_cache.dtype, k_cache.device)
            vd = TensorSpec((B, S, hk, dv), (S * hk * dv, hk * dv, dv, 1), v_cache.dtype, v_cache.device)
        else:
            kd, vd = k_cache, v_cache
        # With rotary the attention reads the rotated copy of q (contiguous), not the caller's layout.
        qa = q
        if self.rotary:
            bq, sq, hq, dq = q.shape
            qa = TensorSpec(tuple(q.shape), (sq * hq * dq, hq * dq, dq, 1), q.dtype, q.device)
        if self.pack:
            s0, _, s2, s3 = qa.stride()
            P = self.pack_rows
            self.pack_shape, self.pack_strides = (B, P, h // P, d), (s0, s2, P * s2, s3)
            qa = TensorSpec(self.pack_shape, self.pack_strides, q.dtype, q.device)
            causal = False  # one query row per sequence: the causal mask hides nothing
        self.out_shape = (B, sq, h, dv)
        self.attn = AttnPlan("kvcache", qa, kd, vd, alibi_slopes, softmax_scale=softmax_scale, causal=causal,
                             window_size=tuple(window_size), softcap=softcap, return_lse=return_lse,
                             k_range=2 if cache_leftpad is not None else 1, k_add=s_new,
                             attention_chunk=attention_chunk, descale=descale, fa3=True, qv=qv is not None,
                             n_splits=self.n_splits, page=page if self.paged_direct else 0,
                             paged_strides=paged_strides, n_pages=self.n_cache_rows if self.paged_direct else 0,
                             out_strides=(h * dv, dv, self.pack_rows * dv, 1) if self.pack else None,
                             out_alloc=self.out_shape if self.pack else None)
        # The kernels read q through its pointer and the plan's strides: the packed view is only needed where the
        # plan copies q (a head dim that is not unit-stride), as then q's shape decides the copy's layout.
        self.pack_view = self.pack and (not self.attn.use_kernel or self.attn.copy[0])
        self.append = None
        # The append kernel writes k and v rows of one head dim; a V head dim of its own appends in PyTorch.
        if s_new and self.attn.use_kernel and dv == d:
            self._plan_append(k_cache, v_cache, block_table)
            self.new_strides = (*k.stride(), *v.stride())  # the call's own k/v (part of the plan's key)

    def _plan_append(self, k_cache, v_cache, block_table) -> None:
        """The append kernel's launch: one program per block of new tokens per (batch row, KV head)."""
        hk, d = k_cache.shape[2], k_cache.shape[3]
        block_t = 16 if self.s_new <= 16 else 64
        meta = dict(BLOCK_T=block_t, BLOCK_D=max(16, next_pow2(d)), PAGED=self.paged, ROWS=self.gather_rows)
        self.append = Launch(_kv_append_kernel, (cdiv(self.s_new, block_t), self.B * hk), meta, 4, 1,
                             device=self.device)
        # The new k/v's strides are read per call (rotary hands over a fresh tensor), the caches' fixed here.
        self.append_ints = (*k_cache.stride(), *v_cache.stride(),
                            block_table.stride(0) if self.paged else 0, self.s_new, hk, d,
                            self.capacity, self.n_cache_rows, self.page or 1)
        self.stream = stream_getter(self.device)

    def __call__(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                 cache_leftpad, block_table, alibi_slopes, descales=None, qv=None):
        """Append, then attend: ``(out (B, sq, h, dv), lse (B, h, sq) fp32 or None)``. ``descales``: FP8
        ``(q, k, v)`` descales (contiguous fp32 ``(B, hk)``) when the plan has them; ``qv`` FA3's extra query
        ``(B, sq, h, dv)`` (not rotated) when the plan has it."""
        B = self.B
        if cache_seqlens is None:  # the caches are full (after the new tokens)
            cache_seqlens = self.capacity - self.s_new
        if type(cache_seqlens) is int:
            if cache_seqlens < 0 or cache_seqlens + self.s_new > self.capacity:  # a host value: checked always
                checks.check_kvcache_values(cache_seqlens, self.s_new, self.capacity, self.page, None, None,
                                            self.n_cache_rows, None)
            cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=self.device)
        if self.check_values:
            checks.check_kvcache_values(cache_seqlens, self.s_new, self.capacity, self.page, cache_leftpad,
                                        cache_batch_idx, self.n_cache_rows, block_table)
        if self.rotary and self.attn.use_kernel:
            # culmen's rotary kernel, one launch each (decoding replays this per layer per token; the
            # PyTorch formula is a dozen small kernels). Positions past the tables pass through unrotated.
            if k is not None:
                k = rotary(k, rotary_cos, rotary_sin, seqlen_offsets=cache_seqlens, interleaved=self.interleaved,
                           out_layout="contiguous")
            if self.q_at_tokens:
                q = rotary(q, rotary_cos, rotary_sin, seqlen_offsets=cache_seqlens, interleaved=self.interleaved,
                           out_layout="contiguous")
            else:
                q = _rotate(q, rotary_cos, rotary_sin, _positions(cache_seqlens, 1).expand(B, q.shape[1]),
                            self.interleaved)
        elif self.rotary:
            if k is not None:
                k = _rotate(k, rotary_cos, rotary_sin, _positions(cache_seqlens, self.s_new), self.interleaved)
            qpos = (_positions(cache_seqlens, q.shape[1]) if self.q_at_tokens
                    else _positions(cache_seqlens, 1).expand(B, q.shape[1]))
            q = _rotate(q, rotary_cos, rotary_sin, qpos, self.interleaved)
        aligned = None
        if self.append is not None:
            # One alignment finding for both kernels, over every tensor either reads uncopied (a gathered
            # cache and the attention plan's own copies are fresh allocations, hence aligned).
            aligned = _aligned(q, k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table,
                               cache_leftpad, alibi_slopes)
            new_strides = (*k.stride(), *v.stride()) if self.rotary else self.new_strides
            self.append(self.stream(), aligned, k, v, k_cache, v_cache, cache_seqlens,
                        cache_seqlens if cache_batch_idx is None else cache_batch_idx,
                        cache_seqlens if block_table is None else block_table, *new_strides, *self.append_ints)
        elif k is not None:
            pos = _positions(cache_seqlens, self.s_new)
            rows = cache_batch_idx.to(torch.int64) if self.gather_rows else None
            _safe_write(k_cache, k, rows, pos, block_table)
            _safe_write(v_cache, v, rows, pos, block_table)
        table = None
        if self.paged_direct:
            kd, vd = k_cache, v_cache
            # int32 (checked); the kernel clamps the page numbers it reads (no launch here). The table's strides are
            # part of the plan's key: a contiguous one is passed as is.
            table = block_table if self.table_contiguous else block_table.contiguous()
        elif self.paged:
            blocks = _gather_index(block_table, self.n_cache_rows)
            kd = k_cache[blocks].reshape(self.attn.k_shape)
            vd = v_cache[blocks].reshape(self.attn.v_shape)
        elif self.gather_rows:
            rows = _gather_index(cache_batch_idx, self.n_cache_rows)
            kd, vd = k_cache[rows], v_cache[rows]
        else:
            kd, vd = k_cache, v_cache
        if self.pack_view:  # (B, 1, h, d) read as (B, P, h / P, d): query head j * P + p is row p of packed head j
            q = q.as_strided(self.pack_shape, self.pack_strides)
        out, lse, _ = self.attn.forward(q, kd, vd, alibi_slopes, None, store_lse=self.return_lse,
                                        k_start=cache_leftpad, k_end=cache_seqlens, aligned=aligned,
                                        descales=descales, qv=qv, table=table)
        # (pack-GQA: out (B, P, h/P, dv) was written into the (B, 1, h, dv) tensor the plan allocated)
        if self.pack and lse is not None:  # lse (B, h/P, P) is (B, h, 1)
            lse = lse.view(B, -1, 1)
        return out, lse


def pack_gqa_rows(nheads: int, nheads_k: int) -> int:
    """How many query heads of a KV head one-token decoding packs into one program (pack-GQA): the largest
    divisor of ``nheads // nheads_k`` that fits the decode tile (``SPLIT_MAX_SEQLEN_Q`` rows); 1 means none."""
    group = nheads // nheads_k
    return max(p for p in range(1, min(group, SPLIT_MAX_SEQLEN_Q) + 1) if group % p == 0)


def paged_gather(cache: Tensor, block_table: Tensor) -> Tensor:
    """The pages of ``cache (num_blocks, page, ...)`` that each row of ``block_table (B, nb)`` lists, in
    order: ``(B, nb * page, ...)``. Page numbers outside ``[0, num_blocks)`` are clamped (no value reads
    outside ``cache``; check them with ``checks.check_kvcache_values`` where an error is wanted)."""
    B, nb = block_table.shape
    return cache[_gather_index(block_table, cache.shape[0])].reshape(B, nb * cache.shape[1], *cache.shape[2:])


def _sig(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def attention_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = None, v: Tensor | None = None,
                      rotary_cos: Tensor | None = None, rotary_sin: Tensor | None = None,
                      cache_seqlens: int | Tensor | None = None, cache_batch_idx: Tensor | None = None,
                      cache_leftpad: Tensor | None = None, block_table: Tensor | None = None,
                      softmax_scale: float | None = None, causal: bool = False,
                      window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, rotary_interleaved: bool = True,
                      alibi_slopes: Tensor | None = None, num_splits: int = 0,
                      return_softmax_lse: bool = False, attention_chunk: int = 0, q_descale: Tensor | None = None,
                      k_descale: Tensor | None = None, v_descale: Tensor | None = None, qv: Tensor | None = None):
    """``flash_attn_with_kvcache`` (arguments, shapes and return as there): ``out (B, sq, h, dv)`` or
    ``(out, softmax_lse (B, h, sq) fp32)``; ``k_cache``/``v_cache`` are updated in place. FA3's additions:
    ``v_cache``'s head dim ``dv`` may differ from ``d``; ``attention_chunk`` (chunked-local, key positions
    counted from ``cache_leftpad``); float8_e4m3fn inputs with descales broadcastable to ``(B, hk)`` (bf16
    out), as ``culmen.ops.attention.op.attention_fa3``; ``qv (B, sq, h, dv)`` adds ``qv . v`` to every score
    (FA3's MLA decode; default scale ``(d + dv) ** -0.5``)."""
    has_desc = q_descale is not None or k_descale is not None or v_descale is not None
    try:
        key = (_sig(q), _sig(k_cache), _sig(v_cache), _sig(k), _sig(v), _sig(rotary_cos), _sig(rotary_sin),
               type(cache_seqlens) is int or _sig(cache_seqlens), _sig(cache_batch_idx), _sig(cache_leftpad),
               _sig(block_table), _sig(alibi_slopes), softmax_scale, causal, window_size, softcap,
               rotary_interleaved, num_splits, return_softmax_lse, attention_chunk, has_desc, _sig(qv))
        plan = PLANS.get(key)
    except (AttributeError, TypeError):
        key, plan = None, None
    if plan is None:
        plan = KVCachePlan(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                           cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                           rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, attention_chunk,
                           has_desc, qv)
        if key is not None:
            PLANS.put(key, plan)
    desc = None
    if has_desc:
        if not plan.attn.fp8:
            raise ValueError(f"q_descale/k_descale/v_descale apply to float8_e4m3fn inputs only, q is {q.dtype}")
        from culmen.ops.attention.op import fa3_descales

        desc = fa3_descales(q_descale, k_descale, v_descale, plan.B, plan.attn.HK, plan.device)
    with torch.no_grad():
        out, lse = plan(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                        cache_leftpad, block_table, alibi_slopes, desc, qv)
    return (out, lse) if return_softmax_lse else out
