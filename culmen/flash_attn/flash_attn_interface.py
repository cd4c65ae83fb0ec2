"""flash_attn 2.8's training interface on culmen's attention ops (``culmen.ops.attention``).

Same names, argument order, defaults and returns as ``flash_attn.flash_attn_interface``: each
function returns ``out`` or, with ``return_attn_probs=True``, ``(out, softmax_lse, S_dmask)``.
Differences from flash_attn (all supersets): fp32 (and fp64) inputs are accepted; head dims up to
512 with no padding requirement; ``softcap`` can be combined with dropout; ``S_dmask`` holds the
normalized probabilities (dropped entries negated) whenever ``return_attn_probs`` is set, also
without dropout (flash_attn returns an empty tensor then).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.attention.kvcache import attention_kvcache
from culmen.ops.attention.op import attention, attention_varlen

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


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
    return attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                     return_attn_probs, return_attn_probs)


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
    return attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                     return_attn_probs, return_attn_probs)


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

    A call with the signature (shapes, strides, dtypes, options) of an earlier one reuses its cached
    plan: the checks and launch geometry are not redone.
    """
    return attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                     return_attn_probs, return_attn_probs)


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
    return attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                            window_size, softcap, alibi_slopes, deterministic, return_attn_probs, return_attn_probs)


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
    return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                            causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                            return_attn_probs)


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
    max_seqlen_k_rounded))``. ``block_table`` ``(batch, max_blocks)`` int32 makes ``k``/``v`` a paged
    cache ``(num_blocks, page_block_size, nheads_k, headdim)``: sequence ``b``'s keys are its pages in
    order (gathered into packed form first; meant for inference, as in flash_attn).
    """
    if block_table is not None:
        k, v = _unpage(k, v, cu_seqlens_k, block_table)
    return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                            causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                            return_attn_probs)


def _unpage(k: Tensor, v: Tensor, cu_seqlens_k: Tensor, block_table: Tensor) -> tuple[Tensor, Tensor]:
    """Packed ``(total_k, hk, d)`` keys/values of the sequences whose pages ``block_table`` lists (page
    numbers are checked on CPU tensors, and on GPUs under ``set_check_values(True)``; a bad one is an
    indexing error either way)."""
    from culmen.ops.backend import check_values_on

    if not isinstance(block_table, Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise TypeError(f"block_table must be a 2-D int32 tensor (batch, max_blocks), got {block_table!r}")
    if k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"with block_table, k/v must be paged (num_blocks, page_block_size, nheads_k, headdim), "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    B, nb = block_table.shape
    if cu_seqlens_k.shape[0] != B + 1:
        raise ValueError(f"block_table has {B} rows but cu_seqlens_k describes {cu_seqlens_k.shape[0] - 1} sequences")
    if (block_table.device.type == "cpu" or check_values_on()) and not torch.compiler.is_compiling():
        lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
        if block_table.numel() and (int(block_table.min()) < 0 or int(block_table.max()) >= k.shape[0]):
            raise ValueError(f"block_table entries must index the {k.shape[0]} pages of k/v")
        if max(lens, default=0) > nb * k.shape[1]:
            raise ValueError(f"a sequence of cu_seqlens_k ({max(lens)} keys) is longer than its {nb} pages hold")
    blocks = block_table.to(torch.int64)
    lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int64)
    keep = torch.arange(nb * k.shape[1], device=k.device)[None, :] < lens[:, None]
    return tuple(t[blocks].reshape(B, nb * t.shape[1], *t.shape[2:])[keep] for t in (k, v))


def _get_block_size_n(device, head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """The key-block granularity of ``S_dmask``'s padding. flash_attn's tests use it to undo its CUDA
    kernels' tile layout; culmen's ``S_dmask`` is in plain row-major order, padded to 128, so this is 128."""
    return 128


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    cache_seqlens: int | Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    block_table: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
):
    """Decoding attention over a KV cache (no backward), flash_attn's signature.

    ``q (B, sq, h, d)``; ``k_cache``/``v_cache`` ``(B_cache, seqlen_cache, hk, d)`` or, with
    ``block_table (B, max_blocks)`` int32, pages ``(num_blocks, page_block_size, hk, d)``. New tokens
    ``k``/``v`` ``(B, s_new, hk, d)`` are written into the caches **in place** at ``cache_seqlens`` (int
    or int32 ``(B,)``; default: the caches are full). ``rotary_cos``/``rotary_sin`` ``(seqlen_ro,
    rotary_dim / 2)`` rotate the new K at ``cache_seqlens + t`` and Q at the same positions when causal
    or local, else at ``cache_seqlens``. ``cache_batch_idx (B,)`` picks cache rows; ``cache_leftpad (B,)``
    is where each row's keys start. ``num_splits`` is accepted (the kernel needs no split-KV pass).
    Returns ``out`` or ``(out, softmax_lse (B, h, sq) fp32)``.
    """
    return attention_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                             cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                             rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse)
