"""flash_attn's test utilities (``flash_attn.utils.testing``): random padding masks, packing q/k/v for the
varlen functions, the local / chunk masks and the plain-PyTorch ``attention_ref``, with flash_attn's
arguments and return conventions, so test code written against flash_attn runs on culmen unchanged.

Masks: ``True`` marks a *valid* token in the padding masks (``(batch, seqlen)`` bool) and a *hidden*
score in ``construct_local_mask`` / ``construct_chunk_mask`` (broadcastable to ``(batch, heads, seqlen_q,
seqlen_k)``). Windows and chunks are aligned to the bottom-right corner of the score matrix, as the kernels'.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from culmen.flash_attn.bert_padding import pad_input, unpad_input

__all__ = ["attention_ref", "construct_chunk_mask", "construct_local_mask", "generate_qkv",
           "generate_random_padding_mask"]

_FAR = 2 ** 32  # column index given to left-padding keys: past every window


def generate_random_padding_mask(max_seqlen: int, batch_size: int, device, mode: str = "random",
                                 zero_lengths: bool = False) -> Tensor:
    """``(batch_size, max_seqlen)`` bool, ``True`` on each row's first ``length`` tokens. ``mode``: ``"full"``
    (every length ``max_seqlen``), ``"random"`` (lengths in ``[max_seqlen - 20, max_seqlen]``, at least 1
    unless ``zero_lengths``) or ``"third"`` (in ``[max_seqlen // 3, max_seqlen]``). ``zero_lengths``: rows 0,
    5, 10, ... and the last are empty."""
    if mode not in ("full", "random", "third"):
        raise ValueError(f"mode must be 'full', 'random' or 'third', got {mode!r}")
    if mode == "full":
        lengths = torch.full((batch_size, 1), max_seqlen, device=device, dtype=torch.int32)
    else:
        low = max_seqlen // 3 if mode == "third" else max(0 if zero_lengths else 1, max_seqlen - 20)
        lengths = torch.randint(low, max_seqlen + 1, (batch_size, 1), device=device)
    if zero_lengths:
        lengths[::5] = 0
        lengths[-1] = 0
    return torch.arange(max_seqlen, device=device)[None, :] < lengths


def _flat(x: Tensor) -> Tensor:
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _unflat(batch: int) -> Callable[[Tensor], Tensor]:
    return lambda t: t.reshape(batch, t.shape[0] // batch, *t.shape[1:])


def _pad_fn(indices: Tensor | None, batch: int, seqlen: int) -> Callable[[Tensor], Tensor]:
    if indices is None:
        return _unflat(batch)
    return lambda t: pad_input(t, indices, batch, seqlen)


def _fresh(t: Tensor | None, grad: bool = True) -> Tensor | None:
    if t is None:
        return None
    return t.detach().requires_grad_() if grad else t.detach()


def generate_qkv(q: Tensor, k: Tensor, v: Tensor, query_padding_mask: Tensor | None = None,
                 key_padding_mask: Tensor | None = None, qv: Tensor | None = None, kvpacked: bool = False,
                 qkvpacked: bool = False, query_unused_mask: Tensor | None = None,
                 key_unused_mask: Tensor | None = None) -> tuple:
    """Pack ``q (b, sq, h, d)``, ``k (b, sk, hk, d)``, ``v (b, sk, hk, dv)`` for the varlen functions.

    Returns, with fresh leaves (``detach().requires_grad_()``) for the tensors to differentiate:

    * ``qkvpacked``: ``(qkv_unpad (total, 3, h, d), cu_seqlens_q, max_seqlen_q, qkv (b, s, 3, h, d),
      output_pad_fn, dqkv_pad_fn)`` (the two masks must be equal, ``h == hk``);
    * ``kvpacked``: ``(q_unpad, kv_unpad (total_k, 2, hk, d), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
      max_seqlen_k, q, kv, output_pad_fn, dq_pad_fn, dkv_pad_fn)``;
    * otherwise: ``(q_unpad, k_unpad, v_unpad, qv_unpad, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
      max_seqlen_q, max_seqlen_k, q, k, v, qv, output_pad_fn, dq_pad_fn, dk_pad_fn)`` (``qv`` entries not
      leaves; ``seqused_*`` each sequence's used length with a padding mask, else ``None``).

    The ``*_pad_fn`` put packed rows back in ``(b, s, ...)`` (zeros at padding). Without a padding mask
    every token is kept and ``cu_seqlens`` steps by the sequence length.
    """
    if kvpacked and qkvpacked:
        raise ValueError("kvpacked and qkvpacked cannot both be set")
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if k.shape != (b, sk, hk, d) or v.shape[:3] != (b, sk, hk):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if (query_unused_mask is not None or key_unused_mask is not None) and (kvpacked or qkvpacked):
        raise ValueError("the unused masks are for the unpacked layout only")
    dev = q.device
    if query_padding_mask is not None:
        q_unpad, idx_q, cu_q, max_q, used_q = unpad_input(q, query_padding_mask, query_unused_mask)
        qv_unpad = _flat(qv)[idx_q] if qv is not None else None
    else:
        q_unpad, idx_q, max_q, used_q = _flat(q), None, sq, None
        cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=dev)
        qv_unpad = _flat(qv) if qv is not None else None
    if key_padding_mask is not None:
        k_unpad, idx_k, cu_k, max_k, used_k = unpad_input(k, key_padding_mask, key_unused_mask)
        v_unpad = unpad_input(v, key_padding_mask, key_unused_mask)[0]
    else:
        k_unpad, v_unpad, idx_k, max_k, used_k = _flat(k), _flat(v), None, sk, None
        cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=dev)
    out_pad = _pad_fn(idx_q, b, sq)
    if qkvpacked:
        if h != hk:
            raise ValueError(f"qkvpacked needs as many k/v heads as q heads, got {hk} and {h}")
        same = (query_padding_mask is None and key_padding_mask is None) or (
            query_padding_mask is not None and key_padding_mask is not None
            and bool(torch.equal(query_padding_mask, key_padding_mask)))
        if not same:
            raise ValueError("qkvpacked needs query_padding_mask == key_padding_mask")
        return (_fresh(torch.stack([q_unpad, k_unpad, v_unpad], 1)), cu_q, max_q,
                _fresh(torch.stack([q, k, v], 2)), out_pad, out_pad)
    if kvpacked:
        return (_fresh(q_unpad), _fresh(torch.stack([k_unpad, v_unpad], 1)), cu_q, cu_k, max_q, max_k,
                _fresh(q), _fresh(torch.stack([k, v], 2)), out_pad, out_pad, _pad_fn(idx_k, b, sk))
    return (_fresh(q_unpad), _fresh(k_unpad), _fresh(v_unpad), _fresh(qv_unpad, False), cu_q, cu_k, used_q,
            used_k, max_q, max_k, _fresh(q), _fresh(k), _fresh(v), _fresh(qv, False), out_pad, out_pad,
            _pad_fn(idx_k, b, sk))


def _grid(seqlen_q: int, seqlen_k: int, query_padding_mask, key_padding_mask, key_leftpad, device):
    """Row and column indices (columns shifted left by ``key_leftpad``, its padding sent to ``_FAR``) and the
    query / key lengths, each as a tensor broadcastable to ``(b, 1, sq, sk)`` or a plain int."""
    rows = torch.arange(seqlen_q, device=device, dtype=torch.long)[:, None]
    cols = torch.arange(seqlen_k, device=device, dtype=torch.long)
    if key_leftpad is not None:
        pad = key_leftpad.to(device=device, dtype=torch.long).view(-1, 1, 1, 1)
        cols = cols.view(1, 1, 1, -1).expand(pad.shape[0], 1, 1, seqlen_k)
        cols = torch.where(cols >= pad, cols - pad, torch.full_like(cols, _FAR))
    sk = seqlen_k if key_padding_mask is None else key_padding_mask.sum(-1).view(-1, 1, 1, 1)
    sq = seqlen_q if query_padding_mask is None else query_padding_mask.sum(-1).view(-1, 1, 1, 1)
    return rows, cols, sq, sk


def construct_local_mask(seqlen_q: int, seqlen_k: int, window_size=(-1, -1), sink_token_length: int = 0,
                         query_padding_mask: Tensor | None = None, key_padding_mask: Tensor | None = None,
                         key_leftpad: Tensor | None = None, device=None) -> Tensor:
    """``True`` where query ``i`` may not see key ``j`` under the window ``(left, right)`` (``-1``: unbounded)
    aligned to the bottom-right corner of each sequence's scores (lengths from the padding masks); the first
    ``sink_token_length`` keys stay visible on the left. Shape ``(sq, sk)`` or ``(b, 1, sq, sk)``."""
    rows, cols, sq, sk = _grid(seqlen_q, seqlen_k, query_padding_mask, key_padding_mask, key_leftpad, device)
    diag = rows + sk - sq
    if window_size[0] < 0:
        return cols > diag + window_size[1]
    if key_padding_mask is None:
        sk = torch.full_like(cols, seqlen_k)
    right = cols > torch.minimum(diag + window_size[1], sk)
    left = (cols < diag - window_size[0]) & (cols >= sink_token_length)
    return right | left


def construct_chunk_mask(seqlen_q: int, seqlen_k: int, attention_chunk: int,
                         query_padding_mask: Tensor | None = None, key_padding_mask: Tensor | None = None,
                         key_leftpad: Tensor | None = None, device=None) -> Tensor:
    """``True`` where key ``j`` lies outside query ``i``'s chunk: chunks of ``attention_chunk`` keys, counted
    from the start of each sequence's keys, query ``i`` sitting at key position ``i + sk - sq``."""
    rows, cols, sq, sk = _grid(seqlen_q, seqlen_k, query_padding_mask, key_padding_mask, key_leftpad, device)
    if key_padding_mask is None:
        sk = torch.full_like(cols, seqlen_k)
    pos = rows + sk - sq
    start = pos - torch.remainder(pos, attention_chunk)  # floor to a chunk boundary, negatives too
    return (cols < start) | (cols >= start + attention_chunk)


def _heads_like(t: Tensor, heads: int) -> Tensor:
    return t.repeat_interleave(heads // t.shape[2], dim=2)


def attention_ref(q: Tensor, k: Tensor, v: Tensor, query_padding_mask: Tensor | None = None,
                  key_padding_mask: Tensor | None = None, key_leftpad: Tensor | None = None,
                  attn_bias: Tensor | None = None, dropout_p: float = 0.0, dropout_mask: Tensor | None = None,
                  causal: bool = False, qv: Tensor | None = None, q_descale: Tensor | None = None,
                  k_descale: Tensor | None = None, v_descale: Tensor | None = None, window_size=(-1, -1),
                  attention_chunk: int = 0, sink_token_length: int = 0, softcap: float = 0.0, upcast: bool = True,
                  reorder_ops: bool = False, intermediate_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Attention in plain PyTorch: ``(output (b, sq, h, dv), attention (b, h, sq, sk))`` in ``q``'s dtype,
    ``attention`` being the softmax before dropout.

    ``q (b, sq, h, d)``, ``k (b, sk, hk, d)``, ``v (b, sk, hk, dv)`` (``h`` a multiple of ``hk``); ``qv (b, sq,
    h, dv)`` adds ``qv . v`` to the scores (the scale then counts ``d + dv``). ``upcast``: compute in fp32
    (else in the inputs' dtype). ``*_descale`` ``(b, hk)`` multiply the inputs first. ``attn_bias``
    broadcasts to the scores; ``dropout_mask`` (``True`` = kept) with ``dropout_p`` scales the kept
    probabilities by ``1 / (1 - dropout_p)``. Masked-out queries and fully hidden rows give zeros.
    ``reorder_ops`` scales ``k`` instead of ``q``; ``intermediate_dtype`` rounds the probabilities through
    that dtype before the second product (both estimate a kernel's rounding).
    """
    if causal:
        window_size = (window_size[0], 0)
    dtype_og = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
        qv = qv.float() if qv is not None else None
    h, hk = q.shape[2], k.shape[2]
    if q_descale is not None:
        qd = q_descale.repeat_interleave(h // hk, dim=1)[:, None, :, None]
        q = (q.float() * qd).to(q.dtype)
        qv = (qv.float() * qd).to(qv.dtype) if qv is not None else None
    if k_descale is not None:
        k = (k.float() * k_descale[:, None, :, None]).to(k.dtype)
    if v_descale is not None:
        v = (v.float() * v_descale[:, None, :, None]).to(v.dtype)
    sq, sk = q.shape[1], k.shape[1]
    k, v = _heads_like(k, h), _heads_like(v, h)
    scale = 1.0 / math.sqrt(q.shape[-1] + (v.shape[-1] if qv is not None else 0))
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)  # (b, h, s, d)
    scores = (qt @ (kt * scale).transpose(-1, -2)) if reorder_ops else ((qt * scale) @ kt.transpose(-1, -2))
    if qv is not None:
        scores = scores + (qv.transpose(1, 2) * scale) @ v.transpose(1, 2).transpose(-1, -2)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if key_padding_mask is not None:
        scores = scores.masked_fill(~key_padding_mask[:, None, None, :], float("-inf"))
    hidden = None
    if window_size[0] >= 0 or window_size[1] >= 0:
        hidden = construct_local_mask(sq, sk, window_size, sink_token_length, query_padding_mask, key_padding_mask,
                                      key_leftpad=key_leftpad, device=q.device)
    if attention_chunk > 0:
        chunk = construct_chunk_mask(sq, sk, attention_chunk, query_padding_mask, key_padding_mask,
                                     key_leftpad=key_leftpad, device=q.device)
        hidden = chunk if hidden is None else hidden | chunk
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    if attn_bias is not None:
        scores = scores + attn_bias
    attention = torch.softmax(scores, dim=-1).to(v.dtype)
    # zeros, not NaN, where a row or column is masked out (so gradients stay finite)
    if query_padding_mask is not None:
        attention = attention.masked_fill(~query_padding_mask[:, None, :, None], 0.0)
    if key_padding_mask is not None:
        attention = attention.masked_fill(~key_padding_mask[:, None, None, :], 0.0)
    if hidden is not None:
        attention = attention.masked_fill(hidden.all(dim=-1, keepdim=True), 0.0)
    dropped = attention.masked_fill(~dropout_mask, 0.0) if dropout_mask is not None else attention
    if intermediate_dtype is not None:
        dropped = dropped.to(intermediate_dtype).to(dropped.dtype)
    output = (dropped @ (v.transpose(1, 2) / (1.0 - dropout_p))).transpose(1, 2)
    if query_padding_mask is not None:
        output = output.masked_fill(~query_padding_mask[:, :, None, None], 0.0)
    return output.to(dtype_og), attention.to(dtype_og)
