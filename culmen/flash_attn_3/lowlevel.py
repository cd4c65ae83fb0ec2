"""FA3's low-level entry points, as ``flash_attn_interface`` exposes them: ``_flash_attn_forward``,
``_flash_attn_backward`` and ``round_up_headdim``.

Context-parallel and ring-attention code calls these directly: a forward that returns ``(out, softmax_lse,
out_accum, softmax_lse_accum)``, and a backward that writes dQ, dK, dV into given buffers from an ``out`` and
``softmax_lse`` the caller may have combined over several steps (so the backward must use them, not recompute
its own). The forward routes to culmen's FA3 functions (dense, varlen with ``seqused_*``, or the KV-cache
path when any cache argument is given); the backward runs the attention plan's backward on the given
``out``/``lse``, with ``seqused_*`` handled as the forward does (each slot split into its used prefix and
unused tail; the tail's gradients are zero).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.attention.op import fa3_plan

from .interface import (
    _packed,
    _row_used,
    _split_cu,
    _split_sides,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)

_HEADDIMS = (64, 96, 128, 192, 256)


def round_up_headdim(head_size: int) -> int:
    """The head dim FA3's kernels are built for that holds ``head_size`` (64, 96, 128, 192 or 256; 256 past
    that), as FA3 reports it with every head dim compiled in."""
    if type(head_size) is not int:
        raise TypeError(f"head_size must be an int, got {type(head_size).__name__}")
    return next((h for h in _HEADDIMS if head_size <= h), 256)


def _flash_attn_forward(
    q: Tensor, k: Tensor, v: Tensor, k_new: Tensor | None = None, v_new: Tensor | None = None,
    qv: Tensor | None = None, out_: Tensor | None = None, cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None, cu_seqlens_k_new: Tensor | None = None, seqused_q: Tensor | None = None,
    seqused_k: Tensor | None = None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
    page_table: Tensor | None = None, kv_batch_idx: Tensor | None = None, leftpad_k: Tensor | None = None,
    rotary_cos: Tensor | None = None, rotary_sin: Tensor | None = None, seqlens_rotary: Tensor | None = None,
    q_descale: Tensor | None = None, k_descale: Tensor | None = None, v_descale: Tensor | None = None,
    softmax_scale: float | None = None, causal: bool = False, window_size_left: int = -1,
    window_size_right: int = -1, attention_chunk: int = 0, softcap: float = 0.0, rotary_interleaved: bool = True,
    scheduler_metadata: Tensor | None = None, num_splits: int = 1, pack_gqa: bool | None = None,
    sm_margin: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FA3's forward op: ``(out, softmax_lse, out_accum, softmax_lse_accum)``.

    Shapes as FA3's: ``q (B, sq, h, d)`` or packed ``(total_q, h, d)`` with ``cu_seqlens_q``; ``k``/``v``
    dense ``(B, sk, hk, d / dv)``, packed with ``cu_seqlens_k``, or a KV cache (``(B_cache, seqlen, hk, d)``, or
    pages with ``page_table``). Any of ``k_new``, ``v_new``, ``page_table``, ``kv_batch_idx``, ``leftpad_k``,
    ``rotary_cos``/``rotary_sin``, ``seqlens_rotary`` or ``cu_seqlens_k_new`` makes ``k``/``v`` a cache
    (``flash_attn_with_kvcache``: ``seqused_k`` is ``cache_seqlens``, the new keys are written in place; no
    backward); otherwise the call is differentiable attention (``flash_attn_varlen_func`` with
    ``seqused_q``/``seqused_k``, or ``flash_attn_func``). ``out_`` receives the output when given (and is
    returned). ``softmax_lse`` is fp32 ``(B, h, sq)`` or ``(h, total_q)``; the two accumulators are empty
    fp32 tensors (culmen merges its key splits itself). ``scheduler_metadata``, ``num_splits``, ``pack_gqa``
    and ``sm_margin`` are speed knobs (validated, as the public functions do)."""
    window = (window_size_left, window_size_right)
    cache = any(t is not None for t in (k_new, v_new, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin,
                                        seqlens_rotary, cu_seqlens_k_new))
    if cache:
        if cu_seqlens_k is not None or seqused_q is not None:
            raise ValueError("cu_seqlens_k and seqused_q do not combine with a KV cache (k_new, v_new, page_table, "
                             "kv_batch_idx, leftpad_k, rotary or cu_seqlens_k_new given): the cache's used "
                             "lengths are seqused_k")
        res = flash_attn_with_kvcache(q, k, v, k_new, v_new, qv, rotary_cos, rotary_sin, seqused_k, kv_batch_idx,
                                      leftpad_k, page_table, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q,
                                      seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, causal, window,
                                      attention_chunk, softcap, rotary_interleaved, scheduler_metadata, num_splits,
                                      pack_gqa, sm_margin, return_softmax_lse=True)
        out, lse = res[0], res[1]
    elif cu_seqlens_q is not None or cu_seqlens_k is not None or seqused_q is not None or seqused_k is not None:
        out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                          seqused_k, softmax_scale, causal, qv, q_descale, k_descale, v_descale,
                                          window, attention_chunk, softcap, num_splits, pack_gqa, False, sm_margin,
                                          return_attn_probs=True)
    else:
        out, lse = flash_attn_func(q, k, v, softmax_scale, causal, qv, q_descale, k_descale, v_descale, window,
                                   attention_chunk, softcap, num_splits, pack_gqa, False, sm_margin,
                                   return_attn_probs=True)
    if out_ is not None:
        out = _check_like("out_", out_, out).copy_(out)
    empty = torch.empty(0, dtype=torch.float32, device=q.device)
    return out, lse, empty, empty


def _check_like(name: str, buf, like: Tensor) -> Tensor:
    """``buf``, a caller's output buffer, checked to be a tensor of ``like``'s shape and dtype."""
    if not isinstance(buf, Tensor) or buf.shape != like.shape or buf.dtype != like.dtype:
        raise ValueError(f"{name} must be a {like.dtype} tensor of shape {tuple(like.shape)}, got "
                         f"{getattr(buf, 'dtype', type(buf).__name__)} {tuple(getattr(buf, 'shape', ()))}")
    return buf


def _grad_buffer(name: str, buf: Tensor | None, like: Tensor) -> Tensor:
    """A gradient buffer: the caller's (checked) or a new one like ``like``."""
    return torch.empty_like(like) if buf is None else _check_like(name, buf, like)


def _plan_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap,
                   deterministic) -> tuple[Tensor, Tensor, Tensor]:
    """The attention plan's backward on the given ``out``/``lse`` (dense when ``cu_q`` is None)."""
    plan = fa3_plan(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap, deterministic, True)
    return plan.backward(dout, q, k, v, out, lse, None, None, cu_q, cu_k)


def _flash_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
    cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None, sequed_q: Tensor | None = None,
    sequed_k: Tensor | None = None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
    dq: Tensor | None = None, dk: Tensor | None = None, dv: Tensor | None = None,
    softmax_scale: float | None = None, is_causal: bool = False, window_size_left: int = -1,
    window_size_right: int = -1, softcap: float = 0.0, deterministic: bool = False, sm_margin: int = 0,
) -> Tensor:
    """FA3's backward op: writes the gradients into ``dq``, ``dk``, ``dv`` (shaped like ``q``, ``k``, ``v``;
    allocated when None) from ``out`` and ``softmax_lse`` as given, and returns ``softmax_d`` (fp32
    ``rowsum(dout * out)``, ``(B, h, sq)`` or ``(h, total_q)``; FA3 pads its last dim to the kernel's block).

    ``q``/``k``/``v`` dense or packed with their ``cu_seqlens`` as in ``_flash_attn_forward`` (``v`` may have its
    own head dim); ``sequed_q``/``sequed_k`` (FA3's spelling) are ``seqused_q``/``seqused_k``: rows past them
    get zero gradients. ``softmax_scale=None`` means ``headdim ** -0.5``; ``sm_margin`` is a speed knob."""
    if type(sm_margin) is not int or sm_margin < 0:
        raise ValueError(f"sm_margin must be an int >= 0, got {sm_margin!r}")
    for name, t in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("softmax_lse", softmax_lse)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dq, dk, dv = _grad_buffer("dq", dq, q), _grad_buffer("dk", dk, k), _grad_buffer("dv", dv, v)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    window = (int(window_size_left), int(window_size_right))
    args = (scale, bool(is_causal), window, float(softcap), bool(deterministic))
    q_padded = cu_seqlens_q is None
    if q_padded and cu_seqlens_k is None and sequed_q is None and sequed_k is None:
        g = _plan_backward(dout, q, k, v, out, softmax_lse, None, None, None, None, *args)
    elif cu_seqlens_q is not None and cu_seqlens_k is not None and sequed_q is None and sequed_k is None:
        g = _plan_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           *args)
    else:
        g = _used_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
                           max_seqlen_q, max_seqlen_k, args)
    for dst, src in zip((dq, dk, dv), g):
        dst.copy_(src)
    d = (dout.float() * out.float()).sum(-1)  # (B, sq, h) or (total_q, h)
    return d.permute(0, 2, 1).contiguous() if d.dim() == 3 else d.t().contiguous()


def _used_backward(dout, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, max_q, max_k, args):
    """Mixed padded/packed sides and ``seqused_*``: both sides packed, each slot split into its used prefix and
    unused tail (``_split_cu``, as the forward), the plan's backward over the ``2 * batch`` sequences, the
    tails' gradients zeroed, then back to the callers' shapes."""
    B, qp, kp, vp, cq, ck, mq, mk, uq, uk = _split_sides(q, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k)
    dop, _, _ = _packed(dout, "dout", cu_q, max_q, B)
    op, _, _ = _packed(out, "out", cu_q, max_q, B)
    # the plan reads packed lse (h, total_q): a padded q's (B, h, sq) is laid out that way first
    lp = lse if cu_q is not None else lse.permute(1, 0, 2).reshape(lse.shape[1], -1)
    gq, gk, gv = _plan_backward(dop, qp, kp, vp, op, lp.contiguous(), _split_cu(cq, uq), _split_cu(ck, uk), mq,
                                mk, *args)
    zero = torch.zeros((), dtype=gq.dtype, device=gq.device)
    if uq is not None:
        gq = torch.where(_row_used(cq, uq, qp.shape[0])[:, None, None], gq, zero)
    if uk is not None:
        keep = _row_used(ck, uk, kp.shape[0])[:, None, None]
        gk, gv = torch.where(keep, gk, zero), torch.where(keep, gv, zero)
    return gq.reshape(q.shape), gk.reshape(k.shape), gv.reshape(v.shape)
