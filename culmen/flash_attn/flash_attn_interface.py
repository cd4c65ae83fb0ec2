"""flash_attn 2.8's training interface on culmen's attention ops (``culmen.ops.attention``).

Same names, argument order, defaults and returns as ``flash_attn.flash_attn_interface``: each
function returns ``out`` or, with ``return_attn_probs=True``, ``(out, softmax_lse, S_dmask)``.
Differences from flash_attn (all supersets): fp32 (and fp64) inputs are accepted; head dims up to
512 with no padding requirement; ``softcap`` can be combined with dropout; ``S_dmask`` holds the
normalized probabilities (dropped entries negated) whenever ``return_attn_probs`` is set, also
without dropout (flash_attn returns an empty tensor then).
"""

from __future__ import annotations

from torch import Tensor

from culmen.ops.attention import flash_attn, flash_attn_varlen

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
]


def _ret(res, return_attn_probs: bool):
    out, lse, s_dmask = res
    return (out, lse, s_dmask) if return_attn_probs else out


def _check_packed(name: str, t, rank: int, n: int, dim: int) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank or t.shape[dim] != n:
        raise ValueError(f"{name} must be {rank}-D with size {n} at dim {dim}, got shape {tuple(t.shape)}")


def flash_attn_qkvpacked_func(
    qkv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """Attention on packed ``qkv`` ``(batch, seqlen, 3, nheads, headdim)``.

    Args:
        dropout_p: drop probability in ``[0, 1)`` (0 for evaluation).
        softmax_scale: default ``headdim ** -0.5``.
        causal: bottom-right aligned causal mask.
        window_size: ``(left, right)``, -1 = unbounded (bottom-right aligned).
        softcap: ``> 0`` caps scores with ``softcap * tanh(s / softcap)``.
        alibi_slopes: fp32 ``(nheads,)`` or ``(batch, nheads)``; adds ``-slope * |i + sk - sq - j|``.
        deterministic: bitwise reproducible backward.
        return_attn_probs: also return ``softmax_lse`` ``(batch, nheads, seqlen)`` fp32 and ``S_dmask``.

    Returns:
        ``out`` ``(batch, seqlen, nheads, headdim)`` in qkv's dtype (or the tuple).
    """
    _check_packed("qkv", qkv, 5, 3, 2)
    q, k, v = qkv.unbind(dim=2)
    return _ret(flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs), return_attn_probs)


def flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """Attention with ``q`` ``(batch, seqlen_q, nheads, headdim)`` and packed ``kv``
    ``(batch, seqlen_k, 2, nheads_k, headdim)``; MQA/GQA when ``nheads_k < nheads``. Other
    arguments and the return as ``flash_attn_qkvpacked_func``."""
    _check_packed("kv", kv, 5, 2, 2)
    k, v = kv.unbind(dim=2)
    return _ret(flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs), return_attn_probs)


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """Attention with ``q`` ``(batch, seqlen_q, nheads, headdim)`` and ``k``/``v``
    ``(batch, seqlen_k, nheads_k, headdim)``, ``nheads % nheads_k == 0``; fp16/bf16/fp32.

    Returns ``out`` ``(batch, seqlen_q, nheads, headdim)``, or with ``return_attn_probs``
    ``(out, softmax_lse (batch, nheads, seqlen_q) fp32, S_dmask (batch, nheads, seqlen_q_rounded,
    seqlen_k_rounded))``. Rows that see no key output 0 and have ``softmax_lse = +inf``. Other
    arguments as ``flash_attn_qkvpacked_func``.
    """
    return _ret(flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs), return_attn_probs)


def flash_attn_varlen_qkvpacked_func(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """Varlen attention on packed ``qkv`` ``(total, 3, nheads, headdim)`` with int32 ``cu_seqlens``
    ``(batch + 1,)`` and ``max_seqlen``. Returns ``out`` ``(total, nheads, headdim)`` or
    ``(out, softmax_lse (nheads, total) fp32, S_dmask)``."""
    _check_packed("qkv", qkv, 4, 3, 1)
    q, k, v = qkv.unbind(dim=1)
    return _ret(flash_attn_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs),
                return_attn_probs)


def flash_attn_varlen_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """Varlen attention with ``q`` ``(total_q, nheads, headdim)`` and packed ``kv``
    ``(total_k, 2, nheads_k, headdim)``; see ``flash_attn_varlen_func``."""
    _check_packed("kv", kv, 4, 2, 1)
    k, v = kv.unbind(dim=1)
    return _ret(flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs), return_attn_probs)


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Tensor | None = None,
):
    """Varlen attention on packed ``q`` ``(total_q, nheads, headdim)`` and ``k``/``v``
    ``(total_k, nheads_k, headdim)``; sequence ``b`` spans ``cu_seqlens[b]:cu_seqlens[b + 1]``
    (int32 ``(batch + 1,)``). Returns ``out`` ``(total_q, nheads, headdim)`` or ``(out,
    softmax_lse (nheads, total_q) fp32, S_dmask (batch, nheads, max_seqlen_q_rounded,
    max_seqlen_k_rounded))``. ``block_table`` (paged KV) is not supported yet and must be ``None``.
    """
    if block_table is not None:
        raise NotImplementedError("block_table (paged KV cache) is not supported by culmen yet")
    return _ret(flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs), return_attn_probs)


