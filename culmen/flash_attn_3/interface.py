"""FlashAttention-3's Python interface (``hopper/flash_attn_interface.py``) on culmen's attention ops.

Same names, argument order, defaults and return conventions as FA3:

* ``flash_attn_func`` / ``flash_attn_qkvpacked_func`` / ``flash_attn_varlen_func`` return ``out`` or,
  with ``return_attn_probs=True``, ``(out, softmax_lse)`` (FA2 returned a third ``S_dmask``; FA3 does not).
* ``flash_attn_with_kvcache`` returns ``out`` or, with ``return_softmax_lse=True``, FA3's four values
  ``(out, softmax_lse, out_accum, softmax_lse_accum)``; the last two are empty fp32 tensors (culmen merges its
  split-KV partials itself and does not hand them back).
* ``softmax_lse`` is ``(batch, nheads, seqlen_q)`` fp32, or ``(nheads, total_q)`` for packed (varlen)
  queries; rows that see no key output 0 and have ``lse = +inf``.

Honoured: ``softmax_scale``, ``causal``, ``window_size``, ``softcap``, ``deterministic``, GQA/MQA,
``seqused_q`` / ``seqused_k`` (each sequence uses the first ``seqused[b]`` rows of its slot; causal and
local masks align to those used lengths), ``cu_seqlens_q`` / ``cu_seqlens_k`` left ``None`` for a padded
``(batch, seqlen, ...)`` side, and in ``flash_attn_with_kvcache``: new ``k``/``v`` appended in place
(batched or packed by ``cu_seqlens_k_new``), packed queries (``cu_seqlens_q`` + ``max_seqlen_q``),
rotary (``rotary_cos/sin``, ``rotary_interleaved``, explicit offsets ``rotary_seqlens``),
``cache_batch_idx``, ``cache_leftpad`` and ``page_table`` with any page size (1, 3, 64 ...).
Split-KV decoding (flash-decoding) in ``flash_attn_with_kvcache``: ``num_splits > 1`` splits every row's keys
into that many runs (fixed schedule: CUDA-graph capturable, no host sync), each writing a partial output and
lse that a merge kernel combines (``flash_attn_combine``'s math); ``num_splits=0`` (the default) chooses on GPUs
from batch, KV heads, cache capacity and paging when ``seqlen_q <= 16`` and the programs would not fill the SMs
(``culmen.ops.attention.launch.choose_num_splits``), else 1. A paged cache (any page size) is read through
``page_table`` directly under split-KV and whenever the kernel decodes (``seqlen_q <= 16``). Accepted with no
effect on the numbers: ``num_splits`` of the other functions, ``pack_gqa``, ``sm_margin``, ``scheduler_metadata``
(``get_scheduler_metadata`` returns an int32 tensor for it).

FA3's features (issue 17), through ``culmen.ops.attention.op.attention_fa3`` and the KV-cache op:

* a V head dim different from the QK head dim (DeepSeek's 192/128): ``out`` has V's head dim; forward and
  backward, dense and varlen, and in ``flash_attn_with_kvcache`` (``v_cache`` / new ``v`` of their own dim);
* ``attention_chunk = C > 0`` (chunked-local attention): query ``i`` sees key ``j`` only when key position
  ``j`` and the query's position ``i + seqlen_k - seqlen_q`` lie in the same chunk of ``C`` positions
  (``j // C == (i + seqlen_k - seqlen_q) // C``), on top of ``causal`` / ``window_size``. Unlike FA3, which
  has no backward for it, culmen's is differentiable: the same kernels with one more mask term;
* FP8 forward: ``float8_e4m3fn`` q/k/v with ``q_descale``/``k_descale``/``v_descale`` (fp32 ``(batch,
  nheads_k)``, each optional) give a bf16 ``out``; the products run on fp8 tensor cores (P rounded to fp8,
  as FA3 does), the descales folded into the softmax scale and the output. No backward (as FA3).

* ``qv`` (FA3's MLA-style extra query, ``(.., nheads, headdim_v)``, shaped like ``out``): every score is
  ``softmax_scale * (q . k + qv . v)``, the default scale ``(headdim + headdim_v) ** -0.5`` as in FA3; dense,
  varlen (``seqused_*`` too) and ``flash_attn_with_kvcache``. Differentiable (dq, dk, dv and dqv; FA3's
  backward drops qv); not with float8 inputs.

Bad index values (``seqused_*`` outside ``[0, slot length]``, ``cu_seqlens``, page numbers) raise
``ValueError`` on CPU tensors and on GPUs under ``culmen.ops.backend.set_check_values(True)``; unchecked
they are clamped, so no value makes culmen read or write outside the given tensors (FA3 does not check).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from culmen.flash_attn.flash_attn_interface import _window_pair
from culmen.ops.attention import checks
from culmen.ops.attention.kvcache import _rotate, _safe_write, attention_kvcache
from culmen.ops.attention.op import attention, attention_fa3, attention_varlen, fa3_descales
from culmen.ops.backend import check_values_on

from .combine import flash_attn_combine
from .fp8 import quantize_fp8

__all__ = [
    "flash_attn_combine",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "get_scheduler_metadata",
]

_FP8 = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                 if hasattr(torch, n))


def _check_fp8(q: Tensor) -> None:
    if q.dtype in _FP8 and q.dtype != torch.float8_e4m3fn:
        raise TypeError(f"FP8 attention takes float8_e4m3fn q/k/v (as FA3), got {q.dtype}")


def _window(window_size) -> tuple[int, int]:
    if (type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is int
            and type(window_size[1]) is int):
        return window_size
    return _window_pair(window_size)


def _knobs(num_splits, pack_gqa, sm_margin) -> None:
    """FA3's scheduling knobs: accepted (they change speed, never the result); only their types are checked."""
    if type(num_splits) is not int or not -1 <= num_splits <= 256:
        raise ValueError(f"num_splits must be an int in [0, 256], got {num_splits!r}")
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise TypeError(f"pack_gqa must be None or a bool, got {pack_gqa!r}")
    if type(sm_margin) is not int or sm_margin < 0:
        raise ValueError(f"sm_margin must be a non-negative int, got {sm_margin!r}")


# ------------------------------------------------------------------------------------------- dense


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    qv: Tensor | None = None,
    q_descale: Tensor | None = None,
    k_descale: Tensor | None = None,
    v_descale: Tensor | None = None,
    window_size: tuple[int, int] | Sequence[int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
    *,
    quantize: str | None = None,
):
    """Attention with ``q (batch, seqlen_q, nheads, headdim)`` and ``k``/``v`` ``(batch, seqlen_k,
    nheads_k, headdim)``, ``nheads % nheads_k == 0``; fp16/bf16 (fp32/fp64 too), differentiable.

    ``causal`` and ``window_size = (left, right)`` (-1 unbounded) align bottom-right; ``softcap > 0`` caps
    scores with ``softcap * tanh(s / softcap)``; ``deterministic`` makes the backward bitwise reproducible.
    ``num_splits``, ``pack_gqa``, ``sm_margin`` are accepted (speed knobs in FA3). ``v`` may have its own
    head dim ``headdim_v`` (``out`` then has it); ``attention_chunk > 0`` adds chunked-local masks
    (differentiable here, unlike FA3); float8_e4m3fn q/k/v with the optional fp32 ``(batch, nheads_k)``
    descales run the FP8 forward (bf16 ``out``, no backward). ``qv (batch, seqlen_q, nheads, headdim_v)`` adds
    ``qv . v`` to every score (default scale ``(headdim + headdim_v) ** -0.5``), differentiable.

    ``quantize`` (culmen's keyword, not FA3's): ``"fp8"`` quantizes fp16/bf16/fp32 q/k/v to float8_e4m3fn with
    per-(batch, kv head) descales (``quantize_fp8``) and runs the FP8 forward; ``"fp8_hadamard"`` first rotates
    q and k by a block Hadamard matrix (q.k unchanged in exact arithmetic, outlier channels spread, smaller FP8
    error). No backward; not with descales or ``qv``.

    Returns ``out (batch, seqlen_q, nheads, headdim_v)`` in q's dtype (bf16 for float8), or with
    ``return_attn_probs`` ``(out, softmax_lse (batch, nheads, seqlen_q) fp32)``.
    """
    if quantize is not None:
        if quantize not in ("fp8", "fp8_hadamard"):
            raise ValueError(f"quantize must be None, 'fp8' or 'fp8_hadamard', got {quantize!r}")
        if q_descale is not None or k_descale is not None or v_descale is not None or qv is not None:
            raise ValueError("quantize computes the descales itself: give no q/k/v_descale and no qv with it")
        q, k, v, q_descale, k_descale, v_descale = quantize_fp8(q, k, v, hadamard=quantize == "fp8_hadamard")
    if num_splits != 1 or pack_gqa is not None or sm_margin:
        _knobs(num_splits, pack_gqa, sm_margin)
    window_size = _window(window_size)
    if (q_descale is not None or k_descale is not None or v_descale is not None or attention_chunk
            or q.dtype in _FP8 or v.shape[-1] != q.shape[-1] or qv is not None):
        _check_fp8(q)
        return attention_fa3(q, k, v, None, None, None, None, softmax_scale, causal, window_size, softcap,
                             deterministic, return_attn_probs, attention_chunk, q_descale, k_descale, v_descale, qv)
    if return_attn_probs:
        res = attention(q, k, v, 0.0, softmax_scale, causal, window_size, softcap, None, deterministic, True, False)
        return res[0], res[1]
    return attention(q, k, v, 0.0, softmax_scale, causal, window_size, softcap, None, deterministic, False, False)


def flash_attn_qkvpacked_func(
    qkv: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    q_descale: Tensor | None = None,
    k_descale: Tensor | None = None,
    v_descale: Tensor | None = None,
    window_size: tuple[int, int] | Sequence[int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    deterministic: bool = False,
    num_heads_q: int | None = None,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
):
    """Attention on packed ``qkv``: ``(batch, seqlen, 3, nheads, headdim)``, or ``(batch, seqlen,
    num_heads_q + 2 * nheads_k, headdim)`` with ``num_heads_q`` (GQA heads in one tensor: q heads first,
    then k, then v). Other arguments and the return as ``flash_attn_func``; the gradient lands in ``qkv``.
    """
    if not isinstance(qkv, Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"a 5-D qkv must be (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
        q, k, v = qkv.unbind(dim=2)
    elif qkv.dim() == 4:
        if num_heads_q is None:
            raise ValueError("a 4-D qkv (batch, seqlen, nheads_q + 2 * nheads_k, headdim) needs num_heads_q")
        hk2 = qkv.shape[2] - num_heads_q
        if num_heads_q <= 0 or hk2 <= 0 or hk2 % 2:
            raise ValueError(f"num_heads_q={num_heads_q} does not split qkv's {qkv.shape[2]} heads into "
                             "nheads_q + 2 * nheads_k")
        q, k, v = qkv.split([num_heads_q, hk2 // 2, hk2 // 2], dim=2)
    else:
        raise ValueError(f"qkv must be 5-D or 4-D, got shape {tuple(qkv.shape)}")
    return flash_attn_func(q, k, v, softmax_scale, causal, None, q_descale, k_descale, v_descale, window_size,
                           attention_chunk, softcap, 1, None, deterministic, sm_margin, return_attn_probs)


# ------------------------------------------------------------------------------------------ varlen


def _check_cu(name: str, cu, B: int | None) -> int:
    if not isinstance(cu, Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 1:
        raise TypeError(f"{name} must be a 1-D int32 tensor (batch + 1,), got "
                        f"{getattr(cu, 'dtype', type(cu).__name__)} {tuple(getattr(cu, 'shape', ()))}")
    if B is not None and cu.shape[0] != B + 1:
        raise ValueError(f"{name} must have batch + 1 = {B + 1} entries, got {cu.shape[0]}")
    return cu.shape[0] - 1


def _check_used(name: str, used, B: int, device) -> None:
    if used is None:
        return
    if not isinstance(used, Tensor) or used.dtype != torch.int32 or tuple(used.shape) != (B,):
        raise TypeError(f"{name} must be an int32 tensor of shape ({B},), got "
                        f"{getattr(used, 'dtype', type(used).__name__)} {tuple(getattr(used, 'shape', ()))}")
    if used.device != device:
        raise ValueError(f"{name} is on {used.device}, q on {device}")


def _used_bounds(name: str, cu: Tensor, used: Tensor | None, check: bool) -> Tensor | None:
    """``used`` clamped into ``[0, slot length]`` (int32); with ``check`` out-of-range values raise."""
    if used is None:
        return None
    slot = cu[1:] - cu[:-1]
    if check:
        bad = (used < 0) | (used > slot)
        if bool(bad.any()):
            raise ValueError(f"{name} must be in [0, the sequence's slot length], got {used.tolist()} for slot "
                             f"lengths {slot.tolist()}")
    return torch.minimum(used.clamp(min=0), slot).to(torch.int32)


def _split_cu(cu: Tensor, used: Tensor | None) -> Tensor:
    """``(2 * batch + 1,)`` boundaries: sequence ``2b`` is slot ``b``'s used prefix, ``2b + 1`` its unused
    tail (computed alongside, then discarded). No token moves and nothing syncs with the device."""
    start = cu[:-1]
    mid = cu[1:] if used is None else start + used
    return torch.cat([torch.stack([start, mid], 1).reshape(-1), cu[-1:]]).to(torch.int32)


def _row_used(cu: Tensor, used: Tensor, total: int) -> Tensor:
    """bool ``(total,)``: packed row ``t`` is inside its sequence's used prefix."""
    t = torch.arange(total, device=cu.device, dtype=torch.int32)
    b = torch.searchsorted(cu[1:].contiguous(), t, right=True).clamp(max=cu.shape[0] - 2)
    return (t >= cu[b]) & (t < cu[b] + used[b])


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    seqused_q: Tensor | None = None,
    seqused_k: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    qv: Tensor | None = None,
    q_descale: Tensor | None = None,
    k_descale: Tensor | None = None,
    v_descale: Tensor | None = None,
    window_size: tuple[int, int] | Sequence[int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
):
    """Variable-length attention, differentiable.

    ``q`` is packed ``(total_q, nheads, headdim)`` with int32 ``cu_seqlens_q (batch + 1,)`` and
    ``max_seqlen_q``, or padded ``(batch, seqlen_q, nheads, headdim)`` with ``cu_seqlens_q=None``; ``k``/``v``
    likewise with ``cu_seqlens_k``. ``seqused_q`` / ``seqused_k`` (int32 ``(batch,)``): sequence ``b`` uses only
    the first ``seqused[b]`` rows of its slot; its other query rows output 0 (``lse = +inf``, zero gradient)
    and its other keys are never seen. Masks align bottom-right to the used lengths.

    Returns ``out`` shaped like ``q`` (with V's head dim), or with ``return_attn_probs`` ``(out,
    softmax_lse)``: ``(nheads, total_q)`` for packed ``q``, ``(batch, nheads, seqlen_q)`` for padded ``q``,
    fp32. Other arguments (``attention_chunk``, descales, float8, ``qv`` shaped like ``out``) as
    ``flash_attn_func``; chunks
    count key positions from each sequence's start.
    """
    if num_splits != 1 or pack_gqa is not None or sm_margin:
        _knobs(num_splits, pack_gqa, sm_margin)
    window_size = _window(window_size)
    plain = seqused_q is None and seqused_k is None
    if (q_descale is not None or k_descale is not None or v_descale is not None or attention_chunk
            or q.dtype in _FP8 or v.shape[-1] != q.shape[-1] or qv is not None):
        _check_fp8(q)
        extra = (attention_chunk, q_descale, k_descale, v_descale, qv)
        if plain and cu_seqlens_q is not None and cu_seqlens_k is not None:
            return attention_fa3(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                 causal, window_size, softcap, deterministic, return_attn_probs, *extra)
        if plain and cu_seqlens_q is None and cu_seqlens_k is None:
            return attention_fa3(q, k, v, None, None, None, None, softmax_scale, causal, window_size, softcap,
                                 deterministic, return_attn_probs, *extra)
        return _varlen_general(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                               seqused_k, softmax_scale, causal, window_size, softcap, deterministic,
                               return_attn_probs, extra)
    if plain and cu_seqlens_q is not None and cu_seqlens_k is not None:  # flash_attn 2's case: straight through
        res = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, softmax_scale,
                               causal, window_size, softcap, None, deterministic, return_attn_probs, False)
        return (res[0], res[1]) if return_attn_probs else res
    if plain and cu_seqlens_q is None and cu_seqlens_k is None:
        return flash_attn_func(q, k, v, softmax_scale, causal, None, None, None, None, window_size, 0, softcap, 1,
                               None, deterministic, 0, return_attn_probs)
    return _varlen_general(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                           softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs)


def _packed(x: Tensor, name: str, cu: Tensor | None, max_len: int | None, B: int | None):
    """``(packed x, cu, max_len)``: a padded ``(batch, seqlen, h, d)`` side becomes packed rows with
    synthetic boundaries ``b * seqlen``."""
    if cu is not None:
        if x.dim() != 3:
            raise ValueError(f"{name} must be packed (total, nheads, headdim) with its cu_seqlens, got "
                             f"{tuple(x.shape)}")
        _check_cu(f"cu_seqlens of {name}", cu, B)
        if max_len is None:
            raise ValueError(f"max_seqlen of {name} must be given with its cu_seqlens")
        return x, cu, max_len
    if x.dim() != 4:
        raise ValueError(f"{name} must be (batch, seqlen, nheads, headdim) without cu_seqlens, got {tuple(x.shape)}")
    Bx, S = x.shape[0], x.shape[1]
    if B is not None and Bx != B:
        raise ValueError(f"{name} has batch {Bx}, expected {B}")
    cu = torch.arange(0, (Bx + 1) * S, S, dtype=torch.int32, device=x.device)
    return x.reshape(Bx * S, *x.shape[2:]), cu, S


def _split_sides(q, k, v, cu_q, cu_k, max_q, max_k, seqused_q, seqused_k):
    """Both sides packed (``_packed``), their boundaries and ``seqused_*`` checked (values too on CPU or with
    value checks on) and clamped: ``(batch, q, k, v packed, cu_q, cu_k, max_q, max_k, used_q, used_k)``."""
    B = q.shape[0] if cu_q is None else _check_cu("cu_seqlens_q", cu_q, None)
    qp, cu_q, max_q = _packed(q, "q", cu_q, max_q, B)
    kp, cu_k, max_k = _packed(k, "k", cu_k, max_k, B)
    vp, _, _ = _packed(v, "v", cu_k if k.dim() == 3 else None, max_k, B)
    _check_used("seqused_q", seqused_q, B, q.device)
    _check_used("seqused_k", seqused_k, B, q.device)
    check = q.device.type == "cpu" or check_values_on()
    if check:
        checks_cu = [("cu_seqlens_q", cu_q, qp.shape[0], max_q), ("cu_seqlens_k", cu_k, kp.shape[0], max_k)]
        for name, cu, total, mx in checks_cu:
            c = cu.tolist()
            lens = [b - a for a, b in zip(c[:-1], c[1:])]
            if c[0] < 0 or min(lens, default=0) < 0 or c[-1] > total:
                raise ValueError(f"{name} must rise from >= 0 to at most {total}, got {c}")
            if max(lens, default=0) > mx:
                raise ValueError(f"max_seqlen {mx} is smaller than the longest sequence of {name} ({max(lens)})")
    used_q = _used_bounds("seqused_q", cu_q, seqused_q, check)
    used_k = _used_bounds("seqused_k", cu_k, seqused_k, check)
    return B, qp, kp, vp, cu_q, cu_k, max_q, max_k, used_q, used_k


def _varlen_general(q, k, v, cu_q, cu_k, max_q, max_k, seqused_q, seqused_k, scale, causal, window, softcap,
                    deterministic, return_lse, extra=None):
    """Mixed padded/packed sides and ``seqused_*``: one culmen varlen call over ``2 * batch`` sequences
    (each slot's used prefix, then its unused tail, see ``_split_cu``), tails masked out afterwards.
    ``extra``: FA3's ``(attention_chunk, q_descale, k_descale, v_descale, qv)`` (descales repeated per half,
    ``qv`` packed like ``q``)."""
    q_padded = cu_q is None
    B, qp, kp, vp, cu_q, cu_k, max_q, max_k, used_q, used_k = _split_sides(q, k, v, cu_q, cu_k, max_q, max_k,
                                                                            seqused_q, seqused_k)
    cu2_q, cu2_k = _split_cu(cu_q, used_q), _split_cu(cu_k, used_k)
    if extra is None:
        res = attention_varlen(qp, kp, vp, cu2_q, cu2_k, max_q, max_k, 0.0, scale, causal, window, softcap, None,
                               deterministic, return_lse, False)
    else:
        chunk, qd, kd, vd, qv = extra
        if qd is not None or kd is not None or vd is not None:
            qd, kd, vd = (d.repeat_interleave(2, dim=0) for d in fa3_descales(qd, kd, vd, B, kp.shape[1], q.device))
        if qv is not None:
            if qv.shape[:-1] != q.shape[:-1]:
                raise ValueError(f"qv must be shaped like q but for its head dim, got {tuple(qv.shape)} for q "
                                 f"{tuple(q.shape)}")
            qv = qv.reshape(*qp.shape[:-1], qv.shape[-1])
        res = attention_fa3(qp, kp, vp, cu2_q, cu2_k, max_q, max_k, scale, causal, window, softcap, deterministic,
                            return_lse, chunk, qd, kd, vd, qv)
    out, lse = (res[0], res[1]) if return_lse else (res, None)
    if used_q is not None:
        ok = _row_used(cu_q, used_q, qp.shape[0])
        out = torch.where(ok[:, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
        if lse is not None:
            lse = torch.where(ok[None, :], lse, torch.full((), float("inf"), dtype=lse.dtype, device=lse.device))
    if q_padded:
        Bq, Sq = q.shape[0], q.shape[1]
        out = out.reshape(*q.shape[:-1], out.shape[-1])
        if lse is not None:
            lse = lse.reshape(lse.shape[0], Bq, Sq).permute(1, 0, 2).contiguous()
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------- kv cache


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    qv: Tensor | None = None,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    cache_seqlens: int | Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    page_table: Tensor | None = None,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k_new: Tensor | None = None,
    max_seqlen_q: int | None = None,
    rotary_seqlens: Tensor | None = None,
    q_descale: Tensor | None = None,
    k_descale: Tensor | None = None,
    v_descale: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | Sequence[int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    scheduler_metadata: Tensor | None = None,
    num_splits: int = 0,
    pack_gqa: bool | None = None,
    sm_margin: int = 0,
    return_softmax_lse: bool = False,
):
    """Decoding attention over a KV cache, FA3's signature (no backward).

    ``q (batch, seqlen_q, nheads, d)``, or packed ``(total_q, nheads, d)`` with ``cu_seqlens_q`` and
    ``max_seqlen_q``. ``k_cache``/``v_cache`` ``(batch_cache, seqlen_cache, nheads_k, d)``, or pages
    ``(num_pages, page_size, nheads_k, d)`` with int32 ``page_table (batch, max_pages)``; any page size.
    New ``k``/``v`` ``(batch, seqlen_new, nheads_k, d)`` (or packed ``(total_new, nheads_k, d)`` with
    ``cu_seqlens_k_new``) are written **in place** at ``cache_seqlens`` (int or int32 ``(batch,)``;
    default: the caches are full). Rotary rotates the new keys at ``offset + t`` and the queries at
    ``offset + i`` when causal/local (else at ``offset``), with ``offset = rotary_seqlens`` if given, else
    ``cache_seqlens``. ``cache_batch_idx`` picks cache rows, ``cache_leftpad`` where each row's keys start.
    Each row attends to keys ``[cache_leftpad, cache_seqlens + seqlen_new)``, masks aligned bottom-right.

    FA3's features: ``v_cache`` (and new ``v``) may have their own head dim ``dv`` (``out`` has it);
    ``attention_chunk > 0`` chunked-local masks over key positions counted from ``cache_leftpad``;
    float8_e4m3fn q and caches with optional fp32 ``(batch, nheads_k)`` descales (bf16 ``out``; rotary is
    refused for float8: rotate before quantizing). ``qv`` (shaped like ``q`` with ``v_cache``'s head dim, not
    rotated) adds ``qv . v`` to every score; default scale ``(d + dv) ** -0.5``.

    Returns ``out`` shaped like ``q`` (with V's head dim), or with ``return_softmax_lse`` ``(out,
    softmax_lse, out_accum, softmax_lse_accum)``: lse ``(batch, nheads, seqlen_q)`` (``(nheads, total_q)``
    for packed q) fp32, and two empty fp32 tensors (culmen does not split the keys; FA3 returns these
    empty when it does not).
    """
    if q.dtype in _FP8:
        _check_fp8(q)
    if num_splits or pack_gqa is not None or sm_margin:
        _knobs(num_splits, pack_gqa, sm_margin)
    if scheduler_metadata is not None and (not isinstance(scheduler_metadata, Tensor)
                                           or scheduler_metadata.dtype != torch.int32
                                           or scheduler_metadata.dim() != 1):
        raise TypeError("scheduler_metadata must be the 1-D int32 tensor get_scheduler_metadata returns, got "
                        f"{getattr(scheduler_metadata, 'dtype', type(scheduler_metadata).__name__)}")
    window_size = _window(window_size)
    if cu_seqlens_q is None and cu_seqlens_k_new is None and rotary_seqlens is None:
        res = attention_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                cache_leftpad, page_table, softmax_scale, causal, window_size, softcap,
                                rotary_interleaved, None, max(num_splits, 0), return_softmax_lse, attention_chunk,
                                q_descale, k_descale, v_descale, qv)
    else:
        res = _kvcache_general(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                               cache_leftpad, page_table, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q,
                               rotary_seqlens, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                               return_softmax_lse, (attention_chunk, q_descale, k_descale, v_descale), qv,
                               max(num_splits, 0))
    if not return_softmax_lse:
        return res
    empty = torch.empty(0, dtype=torch.float32, device=q.device)
    return res[0], res[1], empty, empty


def _token_batch(cu: Tensor, total: int) -> tuple[Tensor, Tensor, Tensor]:
    """For packed rows ``t < total``: ``(batch index clamped, index inside the sequence, valid)``; rows
    past ``cu[-1]`` (or in no sequence) are not valid."""
    t = torch.arange(total, device=cu.device, dtype=torch.int64)
    cu64 = cu.to(torch.int64)
    nb = cu.shape[0] - 1
    b = torch.searchsorted(cu64[1:].contiguous(), t, right=True)
    valid = (b < nb) & (t >= cu64[0])
    b = b.clamp(max=max(nb - 1, 0))
    return b, t - cu64[b], valid


def _kvcache_general(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                     cache_leftpad, page_table, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, rotary_seqlens,
                     softmax_scale, causal, window_size, softcap, rotary_interleaved, return_lse, extra, qv=None,
                     num_splits=0):
    """The FA3-only forms (packed queries, packed new keys, explicit rotary offsets): rotate and append
    here in PyTorch (every write bounds-safe), then attend through culmen's kvcache op with no new tokens
    and packed queries end-aligned in a ``(batch, max_seqlen_q)`` grid (so the bottom-right diagonal of
    each sequence falls where FA3 puts it)."""
    dev = q.device
    if cu_seqlens_q is not None:
        B = _check_cu("cu_seqlens_q", cu_seqlens_q, None)
        if q.dim() != 3:
            raise ValueError(f"q must be packed (total_q, nheads, headdim) with cu_seqlens_q, got {tuple(q.shape)}")
        if max_seqlen_q is None or type(max_seqlen_q) is not int or max_seqlen_q < 0:
            raise ValueError(f"max_seqlen_q must be an int >= 0 with cu_seqlens_q, got {max_seqlen_q!r}")
    else:
        if q.dim() != 4:
            raise ValueError(f"q must be (batch, seqlen_q, nheads, headdim), got {tuple(q.shape)}")
        B = q.shape[0]
    paged = page_table is not None
    if paged and (not isinstance(page_table, Tensor) or page_table.dtype != torch.int32 or page_table.dim() != 2
                  or page_table.shape[0] != B):
        raise TypeError(f"page_table must be int32 (batch={B}, max_pages), got "
                        f"{getattr(page_table, 'dtype', type(page_table).__name__)} "
                        f"{tuple(getattr(page_table, 'shape', ()))}")
    page = k_cache.shape[1] if paged else None
    capacity = page_table.shape[1] * page if paged else k_cache.shape[1]
    n_rows = k_cache.shape[0]
    check = dev.type == "cpu" or check_values_on()
    # cache_seqlens as an int32 (B,) tensor; None means full caches when nothing is appended
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens must be given with new k/v (where to append them)")
        cache_seqlens = capacity
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=dev)
    _check_used("cache_seqlens", cache_seqlens, B, dev)
    _check_used("rotary_seqlens", rotary_seqlens, B, dev)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    rot_off = (rotary_seqlens if rotary_seqlens is not None else cache_seqlens).to(torch.int64)
    if check:  # before any write: rows, pages, lengths and left pads inside the caches
        checks.check_kvcache_values(cache_seqlens, 0, capacity, page, cache_leftpad, cache_batch_idx, n_rows,
                                    page_table)
    # new tokens as packed rows with their sequence of origin
    n_new = torch.zeros(B, dtype=torch.int64, device=dev)
    if (k is None) != (v is None):
        raise ValueError("k and v (the new tokens) must be given together")
    if k is not None:
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise TypeError(f"k/v must have q's dtype {q.dtype}, got {k.dtype} / {v.dtype}")
        kn, cu_new, _ = _packed(k, "k", cu_seqlens_k_new, 0, B)
        vn, _, _ = _packed(v, "v", cu_seqlens_k_new, 0, B)
        if kn.shape[:-1] != vn.shape[:-1] or kn.shape[1:] != k_cache.shape[2:] or vn.shape[1:] != v_cache.shape[2:]:
            raise ValueError(f"new k/v rows must be (nheads_k, headdim) = {tuple(k_cache.shape[2:])} / "
                             f"{tuple(v_cache.shape[2:])}, got {tuple(kn.shape)} / {tuple(vn.shape)}")
        cu64 = cu_new.to(torch.int64)
        n_new = (cu64[1:] - cu64[:-1]).clamp(min=0)
        tb, ti, tvalid = _token_batch(cu_new, kn.shape[0])
        pos = torch.where(tvalid, cache_seqlens.to(torch.int64)[tb] + ti, torch.full_like(ti, -1))
        if check:
            total = (cache_seqlens.to(torch.int64) + n_new).tolist()
            if cu_new.tolist()[-1] > kn.shape[0] or min(n_new.tolist(), default=0) < 0:
                raise ValueError(f"cu_seqlens_k_new {cu_new.tolist()} does not fit the {kn.shape[0]} new rows")
            if max(total, default=0) > capacity:
                raise checks.CacheCapacityError(f"cache_seqlens + the new k/v exceed "
                                                f"{checks.capacity_where(capacity, page)}: got {total}")
        if rotary_cos is not None:
            kn = _rotate(kn[:, None], rotary_cos, rotary_sin, (rot_off[tb] + ti)[:, None], rotary_interleaved)[:, 0]
        if paged:
            bt = page_table[tb]
            _safe_write(k_cache, kn[:, None], None, pos[:, None], bt)
            _safe_write(v_cache, vn[:, None], None, pos[:, None], bt)
        else:
            rows = tb if cache_batch_idx is None else cache_batch_idx.to(torch.int64)[tb]
            _safe_write(k_cache, kn[:, None], rows, pos[:, None], None)
            _safe_write(v_cache, vn[:, None], rows, pos[:, None], None)
    seqlen_k = (cache_seqlens.to(torch.int64) + n_new).clamp(max=capacity).to(torch.int32)
    local = causal or window_size != (-1, -1)
    if cu_seqlens_q is not None:
        qb, qi, qvalid = _token_batch(cu_seqlens_q, q.shape[0])
        cq = cu_seqlens_q.to(torch.int64)
        L = (cq[1:] - cq[:-1])[qb]
        slot = max_seqlen_q - L + qi  # end-aligned position in the (B, max_seqlen_q) grid
        qvalid = qvalid & (slot >= 0) & (slot < max_seqlen_q)
        if check and not bool(qvalid.all()):
            raise ValueError(f"cu_seqlens_q {cu_seqlens_q.tolist()} does not fit the {q.shape[0]} query rows "
                             f"with max_seqlen_q={max_seqlen_q}")
    else:
        qb = torch.arange(B, device=dev).repeat_interleave(q.shape[1])
        qi = torch.arange(q.shape[1], device=dev).repeat(B)
        slot, qvalid = qi, None
    if rotary_cos is not None:
        qpos = rot_off[qb] + qi if local else rot_off[qb]
        qr = _rotate(q.reshape(-1, *q.shape[-2:])[:, None], rotary_cos, rotary_sin, qpos[:, None],
                     rotary_interleaved)[:, 0]
    else:
        qr = q.reshape(-1, *q.shape[-2:])
    if cu_seqlens_q is not None:
        grid_rows = B * max_seqlen_q
        dest = torch.where(qvalid, qb * max_seqlen_q + slot, torch.full_like(slot, grid_rows))  # bad rows: a spare
        q_grid = qr.new_zeros(grid_rows + 1, *q.shape[-2:])
        q_grid[dest] = qr
        q_grid = q_grid[:grid_rows].view(B, max_seqlen_q, *q.shape[-2:])
        if qv is not None:
            if qv.dim() != 3 or qv.shape[:-1] != q.shape[:-1]:
                raise ValueError(f"qv must be packed like q, (total_q, nheads, headdim_v), got {tuple(qv.shape)}")
            qv_grid = qv.new_zeros(grid_rows + 1, *qv.shape[-2:])
            qv_grid[dest] = qv
            qv = qv_grid[:grid_rows].view(B, max_seqlen_q, *qv.shape[-2:])
    else:
        q_grid = qr.view(q.shape)
    out, lse = attention_kvcache(q_grid, k_cache, v_cache, None, None, None, None, seqlen_k, cache_batch_idx,
                                 cache_leftpad, page_table, softmax_scale, causal, window_size, softcap, True, None,
                                 num_splits, True, *extra, qv)
    if cu_seqlens_q is not None:
        src_b, src_s = qb, slot.clamp(0, max(max_seqlen_q - 1, 0))
        out = out[src_b, src_s]
        lse = lse[src_b, :, src_s].transpose(0, 1).contiguous()
        if qvalid is not None:
            out = torch.where(qvalid[:, None, None], out, torch.zeros((), dtype=out.dtype, device=dev))
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------------------------------ scheduler


def get_scheduler_metadata(
    batch_size: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    num_heads_q: int,
    num_heads_kv: int,
    headdim: int,
    cache_seqlens: Tensor,
    qkv_dtype: torch.dtype = torch.bfloat16,
    headdim_v: int | None = None,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k_new: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    page_size: int | None = None,
    max_seqlen_k_new: int = 0,
    causal: bool = False,
    window_size: tuple[int, int] | Sequence[int] = (-1, -1),
    attention_chunk: int = 0,
    has_softcap: bool = False,
    num_splits: int = 0,
    pack_gqa: bool | None = None,
    sm_margin: int = 0,
) -> Tensor:
    """FA3's precomputed tile schedule for ``flash_attn_with_kvcache(..., scheduler_metadata=...)``.

    culmen fixes its split-KV schedule per call signature on the host (``num_splits``, or the automatic choice
    from batch, heads and cache capacity), so this returns an int32 ``(batch_size + 1,)`` tensor on
    ``cache_seqlens``' device: a zero (FA3's tile semaphore slot) and then 1 per sequence.
    ``flash_attn_with_kvcache`` checks its type and ignores its values; it stays valid when cache lengths
    change, so a CUDA-graph decode loop can reuse it.
    ``attention_chunk``, ``headdim_v`` and float8 ``qkv_dtype`` are accepted (nothing to schedule).
    """
    if not isinstance(cache_seqlens, Tensor):
        raise TypeError(f"cache_seqlens must be a tensor, got {type(cache_seqlens).__name__}")
    for name, val in (("batch_size", batch_size), ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k),
                      ("num_heads_q", num_heads_q), ("num_heads_kv", num_heads_kv), ("headdim", headdim)):
        if type(val) is not int or val < 0:
            raise ValueError(f"{name} must be a non-negative int, got {val!r}")
    if num_heads_kv == 0 or num_heads_q % num_heads_kv:
        raise ValueError(f"num_heads_kv={num_heads_kv} must divide num_heads_q={num_heads_q}")
    if page_size is not None and (type(page_size) is not int or page_size < 1):
        raise ValueError(f"page_size must be None or a positive int, got {page_size!r}")
    if type(attention_chunk) is not int or attention_chunk < 0:
        raise ValueError(f"attention_chunk must be an int >= 0, got {attention_chunk!r}")
    if headdim_v is not None and (type(headdim_v) is not int or headdim_v <= 0):
        raise ValueError(f"headdim_v must be None or a positive int, got {headdim_v!r}")
    _window(window_size)
    _knobs(num_splits, pack_gqa, sm_margin)
    meta = torch.ones(batch_size + 1, dtype=torch.int32, device=cache_seqlens.device)
    meta[0] = 0
    return meta
