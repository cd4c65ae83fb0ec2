"""flash_attn's compiled extension ``flash_attn_2_cuda`` on culmen's attention plans.

``fwd``, ``bwd``, ``varlen_fwd``, ``varlen_bwd`` and ``fwd_kvcache`` take the extension's argument lists
(flash_attn 2.8, ``csrc/flash_attn/flash_api.cpp``) and return its lists:

* ``fwd`` / ``varlen_fwd`` -> ``[out, softmax_lse, S_dmask, rng_state]``;
* ``bwd`` / ``varlen_bwd`` -> ``[dq, dk, dv, softmax_d]`` (written into ``dq_``/``dk_``/``dv_`` when given);
* ``fwd_kvcache`` -> ``[out, softmax_lse]``.

``flash_attn.flash_attn_interface.flash_attn_gpu`` is this module; ring / context-parallel attention
libraries reach it through ``_flash_attn_forward`` / ``_flash_attn_backward`` and their varlen forms.
The backward uses the ``out`` and ``softmax_lse`` it is given (not a recomputed forward), so a chunk of
keys can be differentiated against the combined output and log-sum-exp of all chunks.

Conventions (flash_attn's): ``softmax_lse`` fp32 ``(B, h, sq)`` dense / ``(h, total_q)`` varlen, ``+inf``
on rows that see no key; ``rng_state`` int64 ``(2,)`` (zeros without dropout) is what the backward needs
to replay the dropout mask; ``softmax_d`` fp32 ``(B, h, round128(sq))`` dense / ``(h, total_q + 128 *
B)`` varlen (sequence ``b``'s rows from column ``cu_seqlens_q[b] + 128 * b``) holds ``(1 - p_dropout) *
rowsum(dout * out)``, zero in the padding. ``S_dmask`` is an empty tensor unless ``return_softmax``.
Differences: ``softmax_scale=None`` means ``headdim ** -0.5``; a backward with ``p_dropout > 0`` needs
the forward's ``rng_state`` (flash_attn would draw an unrelated mask); fp32/fp64 inputs and head dims up
to 512 are accepted, as in ``culmen.flash_attn``. ``varlen_fwd``'s ``block_table`` / ``leftpad_k`` /
``seqused_k`` gather the used keys into packed form first (one host sync; inference).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.attention.kvcache import attention_kvcache
from culmen.ops.attention.launch import AttnPlan
from culmen.ops.attention.reference import round_multiple
from culmen.ops.backend import check_values_on
from culmen.ops.common.plans import PlanCache

__all__ = ["bwd", "fwd", "fwd_kvcache", "gather_keys", "varlen_bwd", "varlen_fwd"]

PLANS = PlanCache("flash_attn_2_cuda")
_F32, _I64 = torch.float32, torch.int64


def _sig(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _plan(kind: str, q, k, v, alibi, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, left, right,
          softcap, deterministic, return_probs) -> AttnPlan:
    """The cached ``AttnPlan`` of one call signature (validation runs when it is built)."""
    try:
        key = (kind, _sig(q), _sig(k), _sig(v), _sig(alibi), _sig(cu_q), _sig(cu_k), max_q, max_k, dropout_p,
               softmax_scale, causal, left, right, softcap, deterministic, return_probs)
        plan = PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors / unhashable: the plan's checks report it
        key, plan = None, None
    if plan is None:
        plan = AttnPlan(kind, q, k, v, alibi, cu_q, cu_k, max_q, max_k, dropout_p=dropout_p,
                        softmax_scale=softmax_scale, causal=causal, window_size=(left, right), softcap=softcap,
                        deterministic=deterministic, return_lse=True, return_probs=return_probs)
        if key is not None:
            PLANS.put(key, plan)
    return plan


def _draw_rng(plan: AttnPlan, gen) -> Tensor:
    """``(seed, offset)`` of the dropout mask (from ``gen`` when given, else torch's generator of the
    device); zeros without dropout."""
    if not plan.has_dropout:
        return torch.zeros(2, dtype=_I64, device=plan.device)
    return torch.randint(0, 2**62, (2,), device=plan.device, dtype=_I64, generator=gen)


def _bwd_rng(plan: AttnPlan, rng_state) -> Tensor | None:
    if not plan.has_dropout:
        return None
    if not isinstance(rng_state, Tensor) or rng_state.numel() != 2:
        raise ValueError(f"p_dropout > 0 needs the forward's rng_state (an int64 tensor of 2 values) to replay "
                         f"its dropout mask, got {rng_state!r}")
    return rng_state.to(device=plan.device, dtype=_I64).reshape(2)


def _into(buf: Tensor | None, val: Tensor, name: str) -> Tensor:
    """``val`` written into the caller's ``buf`` (returned), or ``val`` itself when there is none."""
    if buf is None:
        return val
    if not isinstance(buf, Tensor) or buf.shape != val.shape or buf.dtype != val.dtype:
        raise ValueError(f"{name} must be a {val.dtype} tensor of shape {tuple(val.shape)}, got "
                         f"{getattr(buf, 'dtype', type(buf).__name__)} {tuple(getattr(buf, 'shape', ()))}")
    buf.copy_(val)
    return buf


def _probs(probs: Tensor | None, q: Tensor) -> Tensor:
    return probs if probs is not None else torch.empty(0, dtype=q.dtype, device=q.device)


def _bwd_inputs(plan: AttnPlan, dout, q, out, lse):
    """``out``/``softmax_lse`` as the plans read them (contiguous; lse fp32, fp64 for fp64 inputs), after
    shape checks."""
    for name, t in (("dout", dout), ("out", out)):
        if not isinstance(t, Tensor) or t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(getattr(t, 'shape', ()))}")
    if not isinstance(lse, Tensor) or tuple(lse.shape) != tuple(plan.lse_shape):
        raise ValueError(f"softmax_lse must have shape {tuple(plan.lse_shape)}, got "
                         f"{tuple(getattr(lse, 'shape', ()))}")
    if not out.is_contiguous():
        out = out.contiguous()
    want = torch.float64 if q.dtype == torch.float64 else _F32  # the plans' lse dtype
    if lse.dtype != want or not lse.is_contiguous():
        lse = lse.to(want).contiguous()
    return out, lse


def _delta(dout: Tensor, out: Tensor, dropout_p: float) -> Tensor:
    """``(1 - p) * rowsum(dout * out)`` in fp32, shaped like the rows of ``out`` without the head dim."""
    return (dout.to(_F32) * out.to(_F32)).sum(-1) * (1.0 - dropout_p)


# ------------------------------------------------------------------------------------------- dense


def fwd(q: Tensor, k: Tensor, v: Tensor, out_: Tensor | None, alibi_slopes_: Tensor | None, p_dropout: float,
        softmax_scale: float | None, is_causal: bool, window_size_left: int, window_size_right: int,
        softcap: float, return_softmax: bool, gen_: torch.Generator | None = None) -> list[Tensor]:
    """Dense forward: ``q (B, sq, h, d)``, ``k``/``v`` ``(B, sk, hk, d)`` -> ``[out (B, sq, h, d),
    softmax_lse (B, h, sq) fp32, S_dmask (B, h, round128(sq), round128(sk)) or empty, rng_state int64
    (2,)]``. ``out_`` receives the output when given."""
    plan = _plan("dense", q, k, v, alibi_slopes_, None, None, None, None, p_dropout, softmax_scale, is_causal,
                 window_size_left, window_size_right, softcap, False, bool(return_softmax))
    rng = _draw_rng(plan, gen_)
    with torch.no_grad():
        out, lse, probs = plan.forward(q, k, v, alibi_slopes_, rng if plan.has_dropout else None, None, None, True)
    return [_into(out_, out, "out"), lse, _probs(probs, q), rng]


def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor, dq_: Tensor | None,
        dk_: Tensor | None, dv_: Tensor | None, alibi_slopes_: Tensor | None, p_dropout: float,
        softmax_scale: float | None, is_causal: bool, window_size_left: int, window_size_right: int,
        softcap: float, deterministic: bool, gen_: torch.Generator | None = None,
        rng_state: Tensor | None = None) -> list[Tensor]:
    """Dense backward from ``out`` and ``softmax_lse`` as given -> ``[dq, dk, dv, softmax_d]``; ``dk``/``dv``
    per KV head (``(B, sk, hk, d)``), written into ``dq_``/``dk_``/``dv_`` when given."""
    plan = _plan("dense", q, k, v, alibi_slopes_, None, None, None, None, p_dropout, softmax_scale, is_causal,
                 window_size_left, window_size_right, softcap, bool(deterministic), False)
    rng = _bwd_rng(plan, rng_state)
    out, lse = _bwd_inputs(plan, dout, q, out, softmax_lse)
    with torch.no_grad():
        dq, dk, dv = plan.backward(dout, q, k, v, out, lse, alibi_slopes_, rng)
        B, sq, h = q.shape[0], q.shape[1], q.shape[2]
        softmax_d = torch.zeros(B, h, round_multiple(sq, 128), dtype=_F32, device=q.device)
        softmax_d[:, :, :sq] = _delta(dout, out, plan.dropout_p).transpose(1, 2)
        return [_into(dq_, dq, "dq"), _into(dk_, dk, "dk"), _into(dv_, dv, "dv"), softmax_d]


# ------------------------------------------------------------------------------------------ varlen


def _outside_rows(cu: Tensor, total: int) -> Tensor:
    """Bool ``(total,)``: the packed rows that belong to no sequence (before ``cu[0]`` or from ``cu[-1]``)."""
    r = torch.arange(total, device=cu.device)
    return (r < cu[0]) | (r >= cu[-1])


def _check_index(name: str, t, B: int) -> None:
    if t is not None and (not isinstance(t, Tensor) or t.dtype not in (torch.int32, _I64)
                          or tuple(t.shape) != (B,)):
        raise TypeError(f"{name} must be an int32 tensor of shape ({B},), got "
                        f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")


def gather_keys(k: Tensor, v: Tensor, cu_seqlens_k: Tensor, block_table: Tensor | None = None,
                leftpad_k: Tensor | None = None, seqused_k: Tensor | None = None,
                return_rows: bool = False) -> tuple[Tensor, ...]:
    """The keys/values each sequence uses, packed: ``(k (total, hk, d), v, cu_seqlens_k int32 (B + 1,))``.

    Sequence ``b`` uses positions ``[leftpad_k[b], seqused_k[b])`` of its keys (defaults ``0`` and
    ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]``): rows ``cu_seqlens_k[b] + t`` of packed ``k (total_k, hk, d)``,
    or with ``block_table (B, max_blocks)`` int32 token ``t`` of its pages of paged ``k (num_blocks,
    page_block_size, hk, d)`` (page ``block_table[b, t // page_block_size]``). Values are checked on CPU
    tensors and under ``culmen.ops.backend.set_check_values(True)``; otherwise indices are clamped into
    ``k`` (wrong numbers, never an access outside it). One host sync (the number of keys). With
    ``return_rows`` also the int64 rows ``(total,)`` of ``k`` (flattened over the pages) that were taken.
    """
    B = cu_seqlens_k.shape[0] - 1
    paged = block_table is not None
    if paged:
        if not isinstance(block_table, Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2:
            raise TypeError(f"block_table must be a 2-D int32 tensor (batch, max_blocks), got {block_table!r}")
        if k.dim() != 4 or v.shape != k.shape:
            raise ValueError(f"with block_table, k/v must be paged (num_blocks, page_block_size, nheads_k, headdim),"
                             f" got {tuple(k.shape)} and {tuple(v.shape)}")
        if block_table.shape[0] != B:
            raise ValueError(f"block_table has {block_table.shape[0]} rows but cu_seqlens_k describes {B} sequences")
    elif k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k/v must be packed (total_k, nheads_k, headdim), got {tuple(k.shape)} and {tuple(v.shape)}")
    _check_index("leftpad_k", leftpad_k, B)
    _check_index("seqused_k", seqused_k, B)
    dev = k.device
    cu = cu_seqlens_k.to(device=dev, dtype=_I64)
    end = seqused_k.to(device=dev, dtype=_I64) if seqused_k is not None else cu[1:] - cu[:-1]
    start = leftpad_k.to(device=dev, dtype=_I64) if leftpad_k is not None else torch.zeros_like(end)
    if paged:
        page, nb, n_pages = k.shape[1], block_table.shape[1], k.shape[0]
        n_rows = n_pages * page
    else:
        n_rows = k.shape[0]
    if (dev.type == "cpu" or check_values_on()) and not torch.compiler.is_compiling() and B > 0:
        lo, hi, first = start.tolist(), end.tolist(), cu[:-1].tolist()
        if min(lo) < 0 or any(a > b for a, b in zip(lo, hi)):
            raise ValueError(f"leftpad_k must be in [0, the sequence's key count], got leftpad_k={lo} for key "
                             f"counts {hi}")
        if paged:
            if block_table.numel() and (int(block_table.min()) < 0 or int(block_table.max()) >= n_pages):
                raise ValueError(f"block_table entries must index the {n_pages} pages of k/v")
            if max(hi) > nb * page:
                raise ValueError(f"a sequence of cu_seqlens_k ({max(hi)} keys) is longer than its {nb} pages hold")
        elif any(f + b > n_rows or f < 0 for f, b in zip(first, hi)):
            raise ValueError(f"cu_seqlens_k / seqused_k address keys past the {n_rows} rows of k")
    lens = (end - start).clamp(min=0)
    new_cu = torch.zeros(B + 1, dtype=_I64, device=dev)
    torch.cumsum(lens, 0, out=new_cu[1:])
    total = int(new_cu[-1])
    if total and not n_rows:
        raise ValueError(f"cu_seqlens_k asks for {total} keys but k has none")
    b = torch.repeat_interleave(torch.arange(B, device=dev), lens, output_size=total)
    t = torch.arange(total, device=dev) - new_cu[:-1][b] + start[b]
    if paged:
        blk = block_table.to(_I64)[b, (t // page).clamp(0, nb - 1)].clamp(0, n_pages - 1)
        rows = blk * page + t % page
        kf, vf = k.reshape(n_rows, *k.shape[2:]), v.reshape(n_rows, *v.shape[2:])
    else:
        rows = (cu[:-1][b] + t).clamp(0, max(n_rows - 1, 0))
        kf, vf = k, v
    picked = (kf[rows], vf[rows], new_cu.to(torch.int32))
    return (*picked, rows) if return_rows else picked


def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, out_: Tensor | None, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               seqused_k: Tensor | None, leftpad_k: Tensor | None, block_table_: Tensor | None,
               alibi_slopes_: Tensor | None, max_seqlen_q: int, max_seqlen_k: int, p_dropout: float,
               softmax_scale: float | None, zero_tensors: bool, is_causal: bool, window_size_left: int,
               window_size_right: int, softcap: float, return_softmax: bool,
               gen_: torch.Generator | None = None) -> list[Tensor]:
    """Varlen forward on packed ``q (total_q, h, d)``, ``k``/``v`` ``(total_k, hk, d)`` (or pages with
    ``block_table_``) and int32 ``cu_seqlens`` ``(B + 1,)`` -> ``[out (total_q, h, d), softmax_lse (h,
    total_q) fp32, S_dmask (B, h, round128(max_seqlen_q), round128(max_seqlen_k)) or empty, rng_state]``.
    ``zero_tensors``: rows outside every sequence get ``out = 0`` and ``softmax_lse = -inf``."""
    if block_table_ is not None or leftpad_k is not None or seqused_k is not None:
        k, v, cu_seqlens_k = gather_keys(k, v, cu_seqlens_k, block_table_, leftpad_k, seqused_k)
    plan = _plan("varlen", q, k, v, alibi_slopes_, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, p_dropout,
                 softmax_scale, is_causal, window_size_left, window_size_right, softcap, False, bool(return_softmax))
    rng = _draw_rng(plan, gen_)
    with torch.no_grad():
        out, lse, probs = plan.forward(q, k, v, alibi_slopes_, rng if plan.has_dropout else None, cu_seqlens_q,
                                       cu_seqlens_k, True)
        if zero_tensors:
            outside = _outside_rows(cu_seqlens_q.to(q.device), q.shape[0])
            out.masked_fill_(outside[:, None, None], 0.0)
            lse.masked_fill_(outside[None, :], float("-inf"))
    return [_into(out_, out, "out"), lse, _probs(probs, q), rng]


def varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
               dq_: Tensor | None, dk_: Tensor | None, dv_: Tensor | None, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               alibi_slopes_: Tensor | None, max_seqlen_q: int, max_seqlen_k: int, p_dropout: float,
               softmax_scale: float | None, zero_tensors: bool, is_causal: bool, window_size_left: int,
               window_size_right: int, softcap: float, deterministic: bool, gen_: torch.Generator | None = None,
               rng_state: Tensor | None = None) -> list[Tensor]:
    """Varlen backward from ``out`` / ``softmax_lse (h, total_q)`` as given -> ``[dq, dk, dv, softmax_d]``.
    ``zero_tensors``: rows outside every sequence get zero gradients (else they are unspecified)."""
    plan = _plan("varlen", q, k, v, alibi_slopes_, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, p_dropout,
                 softmax_scale, is_causal, window_size_left, window_size_right, softcap, bool(deterministic), False)
    rng = _bwd_rng(plan, rng_state)
    out, lse = _bwd_inputs(plan, dout, q, out, softmax_lse)
    with torch.no_grad():
        dq, dk, dv = plan.backward(dout, q, k, v, out, lse, alibi_slopes_, rng, cu_seqlens_q, cu_seqlens_k)
        cu_q = cu_seqlens_q.to(device=q.device, dtype=_I64)
        outside_q = _outside_rows(cu_q, q.shape[0])
        if zero_tensors:
            dq.masked_fill_(outside_q[:, None, None], 0.0)
            outside_k = _outside_rows(cu_seqlens_k.to(k.device), k.shape[0])[:, None, None]
            dk.masked_fill_(outside_k, 0.0)
            dv.masked_fill_(outside_k, 0.0)
        B, (total_q, h) = cu_q.shape[0] - 1, q.shape[:2]
        softmax_d = torch.zeros(h, total_q + 128 * B, dtype=_F32, device=q.device)
        rows = torch.arange(total_q, device=q.device)
        seq = torch.searchsorted(cu_q[1:].contiguous(), rows, right=True).clamp(max=max(B - 1, 0))
        # Rows of no sequence hold 0 (their out may be unwritten memory).
        softmax_d[:, rows + 128 * seq] = _delta(dout, out, plan.dropout_p).masked_fill(outside_q[:, None], 0.0).T
        return [_into(dq_, dq, "dq"), _into(dk_, dk, "dk"), _into(dv_, dv, "dv"), softmax_d]


# ---------------------------------------------------------------------------------------- KV cache


def fwd_kvcache(q: Tensor, kcache: Tensor, vcache: Tensor, k_: Tensor | None, v_: Tensor | None,
                seqlens_k_: Tensor | None, rotary_cos_: Tensor | None, rotary_sin_: Tensor | None,
                cache_batch_idx_: Tensor | None, leftpad_k_: Tensor | None, block_table_: Tensor | None,
                alibi_slopes_: Tensor | None, out_: Tensor | None, softmax_scale: float | None, is_causal: bool,
                window_size_left: int, window_size_right: int, softcap: float, is_rotary_interleaved: bool,
                num_splits: int) -> list[Tensor]:
    """Decoding attention over a KV cache (``flash_attn_with_kvcache``'s kernel entry) -> ``[out (B, sq, h,
    d), softmax_lse (B, h, sq) fp32]``; the new ``k_``/``v_`` are appended to the caches in place."""
    out, lse = attention_kvcache(q, kcache, vcache, k_, v_, rotary_cos_, rotary_sin_, seqlens_k_, cache_batch_idx_,
                                 leftpad_k_, block_table_, softmax_scale, is_causal,
                                 (window_size_left, window_size_right), softcap, is_rotary_interleaved,
                                 alibi_slopes_, num_splits, True)
    return [_into(out_, out, "out"), lse]
