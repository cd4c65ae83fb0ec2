"""Pure-PyTorch FlashAttention: the oracle of the Triton kernels and the CPU path.

Semantics follow flash_attn 2.8 (BSHD layout). The math runs in fp32 (fp64 for fp64 inputs):

* scores ``s = softmax_scale * q @ k^T``; with ``softcap > 0``: ``s = softcap * tanh(s / softcap)``;
  with ALiBi: ``s -= slope * |i + seqlen_k - seqlen_q - j|``; then masking.
* causal and ``window_size=(left, right)`` are aligned to the bottom-right corner: query ``i`` sees
  key ``j`` iff ``i + sk - sq - left <= j <= i + sk - sq + right`` (``-1`` = unbounded; causal sets
  ``right = 0``).
* a query row that sees no key outputs 0 and has ``lse = +inf`` (flash_attn's convention), never NaN.
* dropout: ``keep`` from ``culmen.ops.attention.dropout`` (Philox, replayable), kept probabilities
  scaled by ``1 / (1 - dropout_p)``; ``lse`` is that of the undropped softmax.
* MQA/GQA: query head ``h`` uses KV head ``h // (nheads // nheads_k)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.attention.dropout import dropout_keep_mask


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def round_multiple(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m``."""
    return (x + m - 1) // m * m


def _visible(sq: int, sk: int, causal: bool, window_size: tuple[int, int], device) -> Tensor | None:
    """Bool ``(sq, sk)``: True where query ``i`` may see key ``j``; ``None`` when all are visible."""
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    if left >= sk:
        left = -1
    if left < 0 and right < 0:
        return None
    i = torch.arange(sq, device=device).view(-1, 1)
    j = torch.arange(sk, device=device).view(1, -1)
    diag = i + sk - sq
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        ok &= j <= diag + right
    if left >= 0:
        ok &= j >= diag - left
    return ok


def _scores(q, k, softmax_scale, causal, window_size, softcap, alibi):
    """Scores ``(B, hk, g, sq, sk)`` after scale, softcap, ALiBi and masking (``-inf``), plus the
    tanh of the softcap (for the backward) or ``None``. ``q``: ``(B, hk, g, sq, d)``, ``k``:
    ``(B, hk, 1, sk, d)`` in the compute dtype; ``alibi``: ``(B, hk, g)`` or ``None``."""
    sq, sk = q.shape[-2], k.shape[-2]
    s = torch.matmul(q, k.transpose(-1, -2)) * softmax_scale
    t = None
    if softcap > 0.0:
        t = torch.tanh(s / softcap)
        s = softcap * t
    if alibi is not None:
        i = torch.arange(sq, device=q.device).view(-1, 1)
        j = torch.arange(sk, device=q.device).view(1, -1)
        dist = (i + sk - sq - j).abs().to(s.dtype)
        s = s - alibi[..., None, None] * dist
    vis = _visible(sq, sk, causal, window_size, q.device)
    if vis is not None:
        s = s.masked_fill(~vis, float("-inf"))
    return s, t


def _group(q: Tensor, k: Tensor, v: Tensor, alibi: Tensor | None, dt: torch.dtype):
    """BSHD -> grouped ``(B, hk, g, s, d)`` views in the compute dtype."""
    B, sq, h, d = q.shape
    hk = k.shape[2]
    g = h // hk
    qg = q.to(dt).permute(0, 2, 1, 3).reshape(B, hk, g, sq, d)
    kg = k.to(dt).permute(0, 2, 1, 3).unsqueeze(2)
    vg = v.to(dt).permute(0, 2, 1, 3).unsqueeze(2)
    al = None
    if alibi is not None:
        al = alibi.to(dt)
        al = al.expand(B, h) if al.dim() == 1 else al
        al = al.reshape(B, hk, g)
    return qg, kg, vg, al


def _keep(rng_state, dropout_p, batch_idx, h, hk, sq, sk, sq_stride, sk_stride):
    keep = dropout_keep_mask(rng_state, dropout_p, batch_idx, h, sq, sk, sq_stride, sk_stride)
    return keep.reshape(keep.shape[0], hk, h // hk, sq, sk)


def _dense_fwd(q, k, v, softmax_scale, causal, window_size, softcap, alibi, dropout_p, rng_state, batch_idx,
               sq_stride, sk_stride, return_probs):
    """One dense block. Returns ``out (B, sq, h, d)`` in the compute dtype, ``lse (B, h, sq)`` and
    the probabilities ``(B, h, sq, sk)`` (dropped entries negated) or ``None``."""
    dt = _compute_dtype(q)
    B, sq, h, d = q.shape
    hk, sk = k.shape[2], k.shape[1]
    qg, kg, vg, al = _group(q, k, v, alibi, dt)
    s, _ = _scores(qg, kg, softmax_scale, causal, window_size, softcap, al)
    lse = torch.logsumexp(s, dim=-1)  # -inf on rows that see nothing
    empty = torch.isneginf(lse)
    lse = torch.where(empty, torch.full_like(lse, float("inf")), lse)
    p = torch.exp(s - lse.unsqueeze(-1))  # exp(-inf - inf) = 0 on empty rows
    probs = None
    if dropout_p > 0.0:
        keep = _keep(rng_state, dropout_p, batch_idx, h, hk, sq, sk, sq_stride, sk_stride)
        pd = torch.where(keep, p, torch.zeros_like(p)) / (1.0 - dropout_p)
        if return_probs:
            probs = torch.where(keep, p, -p)
    else:
        pd = p
        if return_probs:
            probs = p
    out = torch.matmul(pd, vg)  # (B, hk, g, sq, d)
    out = out.reshape(B, h, sq, d).permute(0, 2, 1, 3)
    lse = lse.reshape(B, h, sq)
    if probs is not None:
        probs = probs.reshape(B, h, sq, sk)
    return out, lse, probs


def _dense_bwd(dout, q, k, v, out, lse, softmax_scale, causal, window_size, softcap, alibi, dropout_p, rng_state,
               batch_idx, sq_stride, sk_stride):
    """Explicit gradient formula for one dense block; dK/dV are summed over each KV head's query
    group inside the contraction (never expanded to ``nheads``)."""
    dt = _compute_dtype(q)
    B, sq, h, d = q.shape
    hk, sk = k.shape[2], k.shape[1]
    g = h // hk
    qg, kg, vg, al = _group(q, k, v, alibi, dt)
    dog = dout.to(dt).permute(0, 2, 1, 3).reshape(B, hk, g, sq, d)
    og = out.to(dt).permute(0, 2, 1, 3).reshape(B, hk, g, sq, d)
    s, t = _scores(qg, kg, softmax_scale, causal, window_size, softcap, al)
    lse_g = lse.to(dt).reshape(B, hk, g, sq, 1)
    p = torch.exp(s - lse_g)
    dp = torch.matmul(dog, vg.transpose(-1, -2))  # (B, hk, g, sq, sk)
    if dropout_p > 0.0:
        keep = _keep(rng_state, dropout_p, batch_idx, h, hk, sq, sk, sq_stride, sk_stride)
        scale = 1.0 / (1.0 - dropout_p)
        pd = torch.where(keep, p, torch.zeros_like(p)) * scale
        dp = torch.where(keep, dp, torch.zeros_like(dp)) * scale
    else:
        pd = p
    dv = torch.einsum("bhgij,bhgid->bhjd", pd, dog)
    delta = (dog * og).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    if t is not None:
        ds = ds * (1.0 - t * t)
    dq = torch.matmul(ds, kg) * softmax_scale
    dk = torch.einsum("bhgij,bhgid->bhjd", ds, qg) * softmax_scale
    dq = dq.reshape(B, h, sq, d).permute(0, 2, 1, 3)
    return dq, dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3)


def _rng(rng_state: Tensor | None, dropout_p: float, device) -> Tensor | None:
    if dropout_p <= 0.0:
        return None
    if rng_state is None:
        raise ValueError("dropout_p > 0 needs rng_state (an int64 (seed, offset) tensor)")
    return rng_state.to(device=device, dtype=torch.int64).reshape(2)


def attention_fwd_ref(q: Tensor, k: Tensor, v: Tensor, *, softmax_scale: float, causal: bool = False,
                      window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                      alibi_slopes: Tensor | None = None, dropout_p: float = 0.0, rng_state: Tensor | None = None,
                      return_probs: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """Dense forward. ``q``: ``(B, sq, h, d)``; ``k``/``v``: ``(B, sk, hk, d)``. Returns ``out``
    (q's dtype), ``lse`` ``(B, h, sq)`` (fp32; fp64 for fp64 inputs) and the probabilities
    ``(B, h, sq, sk)`` in q's dtype (dropped entries negated) or ``None``."""
    rng = _rng(rng_state, dropout_p, q.device)
    bidx = torch.arange(q.shape[0], device=q.device)
    out, lse, probs = _dense_fwd(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
                                 rng, bidx, q.shape[1], k.shape[1], return_probs)
    return out.to(q.dtype), lse, (probs.to(q.dtype) if probs is not None else None)


def attention_bwd_ref(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                      softmax_scale: float, causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                      softcap: float = 0.0, alibi_slopes: Tensor | None = None, dropout_p: float = 0.0,
                      rng_state: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Dense backward: ``(dq, dk, dv)`` in the dtypes of ``q``, ``k``, ``v`` (``dk``/``dv`` per KV head)."""
    rng = _rng(rng_state, dropout_p, q.device)
    bidx = torch.arange(q.shape[0], device=q.device)
    dq, dk, dv = _dense_bwd(dout, q, k, v, out, lse, softmax_scale, causal, window_size, softcap, alibi_slopes,
                            dropout_p, rng, bidx, q.shape[1], k.shape[1])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _bounds(cu: Tensor) -> list[int]:
    return [int(x) for x in cu.tolist()]


def attention_varlen_fwd_ref(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                             max_seqlen_q: int, max_seqlen_k: int, *, softmax_scale: float, causal: bool = False,
                             window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Tensor | None = None, dropout_p: float = 0.0,
                             rng_state: Tensor | None = None,
                             return_probs: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """Varlen forward on packed ``(total, heads, d)`` inputs. Returns ``out (total_q, h, d)``,
    ``lse (h, total_q)`` and, when asked, probabilities ``(B, h, max_seqlen_q, max_seqlen_k)``
    (zero outside each sequence). Sequence ``b`` is batch index ``b`` for ALiBi and dropout."""
    rng = _rng(rng_state, dropout_p, q.device)
    dt = _compute_dtype(q)
    total_q, h, d = q.shape
    bq, bk = _bounds(cu_seqlens_q), _bounds(cu_seqlens_k)
    nb = len(bq) - 1
    out = torch.zeros(total_q, h, d, dtype=dt, device=q.device)
    lse = torch.full((h, total_q), float("inf"), dtype=dt, device=q.device)
    probs = (torch.zeros(nb, h, max_seqlen_q, max_seqlen_k, dtype=dt, device=q.device) if return_probs else None)
    for b in range(nb):
        q0, q1, k0, k1 = bq[b], bq[b + 1], bk[b], bk[b + 1]
        if q1 == q0:
            continue
        al = alibi_slopes[b:b + 1] if (alibi_slopes is not None and alibi_slopes.dim() == 2) else alibi_slopes
        o, ls, pr = _dense_fwd(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale, causal, window_size,
                               softcap, al, dropout_p, rng, torch.tensor([b], device=q.device), max_seqlen_q,
                               max_seqlen_k, return_probs)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = ls[0]
        if probs is not None:
            probs[b, :, :q1 - q0, :k1 - k0] = pr[0]
    return out.to(q.dtype), lse, (probs.to(q.dtype) if probs is not None else None)


def attention_varlen_bwd_ref(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                             softmax_scale: float, causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                             softcap: float = 0.0, alibi_slopes: Tensor | None = None, dropout_p: float = 0.0,
                             rng_state: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Varlen backward: ``(dq, dk, dv)`` packed like ``q``, ``k``, ``v``."""
    rng = _rng(rng_state, dropout_p, q.device)
    dt = _compute_dtype(q)
    bq, bk = _bounds(cu_seqlens_q), _bounds(cu_seqlens_k)
    dq = torch.zeros(q.shape, dtype=dt, device=q.device)
    dk = torch.zeros(k.shape, dtype=dt, device=q.device)
    dv = torch.zeros(v.shape, dtype=dt, device=q.device)
    for b in range(len(bq) - 1):
        q0, q1, k0, k1 = bq[b], bq[b + 1], bk[b], bk[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        al = alibi_slopes[b:b + 1] if (alibi_slopes is not None and alibi_slopes.dim() == 2) else alibi_slopes
        g = _dense_bwd(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
                       lse[None, :, q0:q1], softmax_scale, causal, window_size, softcap, al, dropout_p, rng,
                       torch.tensor([b], device=q.device), max_seqlen_q, max_seqlen_k)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def attention_ref(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                  softcap: float = 0.0, alibi_slopes: Tensor | None = None, softmax_scale: float | None = None,
                  dropout_p: float = 0.0, rng_state: Tensor | None = None, dropout_mask: Tensor | None = None,
                  cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None,
                  max_seqlen_q: int | None = None, max_seqlen_k: int | None = None) -> tuple[Tensor, Tensor]:
    """Reference attention ``(out, softmax_lse)``, differentiable through PyTorch autograd.

    Args:
        q: ``(B, sq, h, d)``, or packed ``(total_q, h, d)`` with ``cu_seqlens_q``.
        k, v: ``(B, sk, hk, d)`` or packed ``(total_k, hk, d)``; ``h % hk == 0``.
        causal, window_size, softcap, alibi_slopes: flash_attn semantics (see the module docstring);
            ``alibi_slopes`` is ``(h,)`` or ``(B, h)``.
        softmax_scale: default ``d ** -0.5``.
        dropout_p, rng_state: Philox dropout (``rng_state`` int64 ``(seed, offset)``), or
        dropout_mask: an explicit bool keep-mask ``(B, h, sq, sk)`` (dense only), which wins.
        cu_seqlens_q/k, max_seqlen_q/k: varlen (int32 ``(B + 1,)``).

    Returns:
        ``out`` in q's dtype (computed in fp32, fp64 for fp64) and ``lse`` ``(B, h, sq)`` or
        ``(h, total_q)`` in the compute dtype; rows that see no key give 0 and ``+inf``.
    """
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if cu_seqlens_q is not None:
        outs, lses = [], []
        bq, bk = _bounds(cu_seqlens_q), _bounds(cu_seqlens_k)
        msq = max_seqlen_q if max_seqlen_q is not None else max(b - a for a, b in zip(bq, bq[1:]))
        msk = max_seqlen_k if max_seqlen_k is not None else max(b - a for a, b in zip(bk, bk[1:]))
        rng = _rng(rng_state, dropout_p, q.device)
        for b in range(len(bq) - 1):
            al = alibi_slopes[b:b + 1] if (alibi_slopes is not None and alibi_slopes.dim() == 2) else alibi_slopes
            o, ls = _ref_dense(q[None, bq[b]:bq[b + 1]], k[None, bk[b]:bk[b + 1]], v[None, bk[b]:bk[b + 1]], scale,
                               causal, window_size, softcap, al, dropout_p, rng, None, b, msq, msk)
            outs.append(o[0])
            lses.append(ls[0])
        return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=-1)
    rng = _rng(rng_state, dropout_p, q.device) if dropout_mask is None else None
    out, lse = _ref_dense(q, k, v, scale, causal, window_size, softcap, alibi_slopes, dropout_p, rng, dropout_mask,
                          0, q.shape[1], k.shape[1])
    return out.to(q.dtype), lse


def _ref_dense(q, k, v, scale, causal, window_size, softcap, alibi, dropout_p, rng, mask, b0, sq_stride, sk_stride):
    dt = _compute_dtype(q)
    B, sq, h, d = q.shape
    hk, sk = k.shape[2], k.shape[1]
    qg, kg, vg, al = _group(q, k, v, alibi, dt)
    s, _ = _scores(qg, kg, scale, causal, window_size, softcap, al)
    lse = torch.logsumexp(s, dim=-1)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    p = torch.exp(s - lse.unsqueeze(-1))
    if mask is not None:
        p = torch.where(mask.reshape(B, hk, h // hk, sq, sk), p, torch.zeros_like(p)) / (1.0 - dropout_p)
    elif dropout_p > 0.0:
        bidx = torch.arange(b0, b0 + B, device=q.device)
        keep = _keep(rng, dropout_p, bidx, h, hk, sq, sk, sq_stride, sk_stride)
        p = torch.where(keep, p, torch.zeros_like(p)) / (1.0 - dropout_p)
    out = torch.matmul(p, vg).reshape(B, h, sq, d).permute(0, 2, 1, 3)
    return out, lse.reshape(B, h, sq)
