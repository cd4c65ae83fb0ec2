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
* FA3's ``attention_chunk = C > 0`` (chunked-local): on top of the window, query ``i`` sees key ``j`` only
  if ``j // C == (i + sk - sq) // C`` (floor division: both key positions lie in one chunk of ``C``).
* ``v`` may have its own head dim ``dv`` (FA3): ``out`` is ``(..., dv)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.attention.dropout import dropout_keep_mask


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


PROBS_BLOCK_N = 128
"""Key-block width of the running max in ``S_dmask`` (``flash_attn_interface._get_block_size_n``)."""


def round_multiple(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m``."""
    return (x + m - 1) // m * m


# The layout of every computation below: grouped ``(B, hk, g, sq, d)`` queries against ``(B, hk, 1, sk,
# d)`` keys; a mask geometry is ``rel`` (key column minus the row's diagonal, broadcastable to ``(B, hk,
# g, sq, sk)``) plus ``valid`` (bool, the same shape, or ``None``: every (row, key) pair exists). Dense
# inputs have one diagonal for all rows; padded varlen and KV-cache rows have one per batch row. Only
# tensor ops, no loops over data and no host syncs: the varlen and KV-cache paths trace under
# ``torch.compile`` too.


def _dense_rel(sq: int, sk: int, device) -> Tensor:
    i = torch.arange(sq, device=device).view(-1, 1)
    j = torch.arange(sk, device=device).view(1, -1)
    return j - (i + (sk - sq))


def _rows_rel(sq: int, sk: int, diag_end: Tensor) -> Tensor:
    """``(B, 1, 1, sq, sk)`` ``rel`` of rows whose last query sits on key ``diag_end[b] - 1``."""
    dev = diag_end.device
    i = torch.arange(sq, device=dev).view(1, -1, 1)
    j = torch.arange(sk, device=dev).view(1, 1, -1)
    return (j - (i + diag_end.view(-1, 1, 1) - sq)).unsqueeze(1).unsqueeze(1)


def _visible(rel: Tensor, valid: Tensor | None, causal: bool, window_size, chunk: int = 0,
             kpos: Tensor | None = None) -> Tensor | None:
    """Bool mask of the (row, key) pairs attended, or ``None`` when all are. ``chunk > 0`` needs ``kpos``,
    the key positions broadcastable against ``rel`` (the row's position is ``kpos - rel``)."""
    left, right = int(window_size[0]), int(window_size[1])
    if chunk > 0:
        same = torch.div(kpos, chunk, rounding_mode="floor") == torch.div(kpos - rel, chunk, rounding_mode="floor")
        valid = same if valid is None else valid & same
    if causal:
        right = 0
    ok = valid
    if right >= 0:
        ok = rel <= right if ok is None else ok & (rel <= right)
    if left >= 0:
        ok = rel >= -left if ok is None else ok & (rel >= -left)
    return ok


def _scores(q, k, softmax_scale, rel, vis, softcap, alibi):
    """Scores ``(B, hk, g, sq, sk)`` after scale, softcap, ALiBi and masking (``-inf``), plus the
    tanh of the softcap (for the backward) or ``None``. ``alibi``: ``(B, hk, g)`` or ``None``."""
    s = torch.matmul(q, k.transpose(-1, -2)) * softmax_scale
    t = None
    if softcap > 0.0:
        t = torch.tanh(s / softcap)
        s = softcap * t
    if alibi is not None:
        s = s - alibi[..., None, None] * rel.abs().to(s.dtype)
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
        al = alibi.to(device=q.device, dtype=dt)
        al = al.expand(B, h) if al.dim() == 1 else al
        al = al.reshape(B, hk, g)
    return qg, kg, vg, al


def _keep(rng_state, dropout_p, batch_idx, h, hk, sq, sk, sq_stride, sk_stride):
    keep = dropout_keep_mask(rng_state, dropout_p, batch_idx, h, sq, sk, sq_stride, sk_stride)
    return keep.reshape(keep.shape[0], hk, h // hk, sq, sk)


def _softmax(s: Tensor) -> tuple[Tensor, Tensor]:
    """``(p, lse)`` of masked scores; rows that see nothing get ``p = 0`` and ``lse = +inf``."""
    lse = torch.logsumexp(s, dim=-1)  # -inf on rows that see nothing
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    return torch.exp(s - lse.unsqueeze(-1)), lse  # exp(-inf - inf) = 0 on empty rows


def _flash_layout_probs(s: Tensor, keep: Tensor) -> Tensor:
    """flash_attn's ``S_dmask`` values from masked scores ``s (..., sk)`` and the keep-mask: entry ``(i, j)``
    is ``exp(s_ij - m)`` where ``m`` is the running row max of flash_attn's forward when it reaches key
    block ``j // PROBS_BLOCK_N`` (it walks the key blocks from the last one down: ``m`` is the max of
    ``s_i`` over that block and every later one), negated where dropped. Masked entries are ``+-0``.
    flash_attn's tests undo this scaling with ``_get_block_size_n`` (= ``PROBS_BLOCK_N``) and the lse."""
    sk = s.shape[-1]
    nblk = -(-sk // PROBS_BLOCK_N)
    blocks = torch.nn.functional.pad(s, (0, nblk * PROBS_BLOCK_N - sk), value=float("-inf"))
    bmax = blocks.unflatten(-1, (nblk, PROBS_BLOCK_N)).amax(-1)  # (..., nblk)
    running = bmax.flip(-1).cummax(-1).values.flip(-1)
    m = running.repeat_interleave(PROBS_BLOCK_N, -1)[..., :sk]
    # Blocks whose running max is -inf hold only masked scores: 0 there (flash_attn's Check_inf).
    val = torch.exp(s - torch.where(torch.isneginf(m), torch.zeros_like(m), m))
    return torch.where(keep, val, -val)


def _dense_fwd(q, k, v, softmax_scale, rel, vis, softcap, alibi, dropout_p, rng_state, batch_idx, sq_stride,
               sk_stride, return_probs):
    """One dense block. Returns ``out (B, sq, h, d)`` (contiguous) in the compute dtype, ``lse (B, h,
    sq)`` and, with ``return_probs``, ``(B, h, sq, sk)``: with dropout flash_attn's ``S_dmask`` values
    (``_flash_layout_probs``: the keep-mask in the sign bit), without it the normalized probabilities."""
    dt = _compute_dtype(q)
    B, sq, h, d = q.shape
    hk, sk = k.shape[2], k.shape[1]
    qg, kg, vg, al = _group(q, k, v, alibi, dt)
    s, _ = _scores(qg, kg, softmax_scale, rel, vis, softcap, al)
    p, lse = _softmax(s)
    probs = None
    if dropout_p > 0.0:
        keep = _keep(rng_state, dropout_p, batch_idx, h, hk, sq, sk, sq_stride, sk_stride)
        pd = torch.where(keep, p, torch.zeros_like(p)) / (1.0 - dropout_p)
        if return_probs:
            probs = _flash_layout_probs(s, keep)
    else:
        pd = p
        if return_probs:
            probs = p
    out = torch.matmul(pd, vg)  # (B, hk, g, sq, dv)
    # Contiguous (B, sq, h, dv) like the kernels' output and flash_attn's: the fake implementations say so.
    out = out.reshape(B, h, sq, v.shape[-1]).transpose(1, 2).contiguous()
    lse = lse.reshape(B, h, sq)
    if probs is not None:
        probs = probs.reshape(B, h, sq, sk)
    return out, lse, probs


def _dense_bwd(dout, q, k, v, out, lse, softmax_scale, rel, vis, softcap, alibi, dropout_p, rng_state, batch_idx,
               sq_stride, sk_stride):
    """Explicit gradient formula for one dense block; dK/dV are summed over each KV head's query
    group inside the contraction (never expanded to ``nheads``)."""
    dt = _compute_dtype(q)
    B, sq, h, d = q.shape
    hk, sk = k.shape[2], k.shape[1]
    g = h // hk
    dv_ = v.shape[-1]
    qg, kg, vg, al = _group(q, k, v, alibi, dt)
    dog = dout.to(dt).permute(0, 2, 1, 3).reshape(B, hk, g, sq, dv_)
    og = out.to(dt).permute(0, 2, 1, 3).reshape(B, hk, g, sq, dv_)
    s, t = _scores(qg, kg, softmax_scale, rel, vis, softcap, al)
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
    dq = dq.reshape(B, h, sq, d).transpose(1, 2).contiguous()
    return dq, dk.transpose(1, 2).contiguous(), dv.transpose(1, 2).contiguous()


def _rng(rng_state: Tensor | None, dropout_p: float, device) -> Tensor | None:
    if dropout_p <= 0.0:
        return None
    if rng_state is None:
        raise ValueError("dropout_p > 0 needs rng_state (an int64 (seed, offset) tensor)")
    return rng_state.to(device=device, dtype=torch.int64).reshape(2)


def attention_fwd_ref(q: Tensor, k: Tensor, v: Tensor, *, softmax_scale: float, causal: bool = False,
                      window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                      alibi_slopes: Tensor | None = None, dropout_p: float = 0.0, rng_state: Tensor | None = None,
                      return_probs: bool = False, attention_chunk: int = 0) -> tuple[Tensor, Tensor, Tensor | None]:
    """Dense forward. ``q``: ``(B, sq, h, d)``; ``k``/``v``: ``(B, sk, hk, d)`` (``v``'s head dim may differ).
    Returns ``out`` (q's dtype, contiguous), ``lse`` ``(B, h, sq)`` (fp32; fp64 for fp64 inputs) and, with
    ``return_probs``, ``(B, h, sq, sk)`` in q's dtype (``_dense_fwd``: flash_attn's ``S_dmask`` values
    with dropout, the probabilities without) or ``None``."""
    rng = _rng(rng_state, dropout_p, q.device)
    bidx = torch.arange(q.shape[0], device=q.device)
    rel = _dense_rel(q.shape[1], k.shape[1], q.device)
    vis = _visible(rel, None, causal, window_size, attention_chunk, torch.arange(k.shape[1], device=q.device))
    out, lse, probs = _dense_fwd(q, k, v, softmax_scale, rel, vis, softcap, alibi_slopes, dropout_p, rng, bidx,
                                 q.shape[1], k.shape[1], return_probs)
    return out.to(q.dtype), lse, (probs.to(q.dtype) if probs is not None else None)


def attention_bwd_ref(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                      softmax_scale: float, causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                      softcap: float = 0.0, alibi_slopes: Tensor | None = None, dropout_p: float = 0.0,
                      rng_state: Tensor | None = None, attention_chunk: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Dense backward: ``(dq, dk, dv)`` in the dtypes of ``q``, ``k``, ``v`` (``dk``/``dv`` per KV head)."""
    rng = _rng(rng_state, dropout_p, q.device)
    bidx = torch.arange(q.shape[0], device=q.device)
    rel = _dense_rel(q.shape[1], k.shape[1], q.device)
    vis = _visible(rel, None, causal, window_size, attention_chunk, torch.arange(k.shape[1], device=q.device))
    dq, dk, dv = _dense_bwd(dout, q, k, v, out, lse, softmax_scale, rel, vis, softcap, alibi_slopes, dropout_p, rng,
                            bidx, q.shape[1], k.shape[1])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _Packing:
    """Where the rows of packed ``(total, ...)`` tensors sit in a padded ``(B, max_len, ...)`` batch.

    ``pad`` ``(B, max_len)`` indexes the packed row of position ``i`` of sequence ``b`` (clamped: check
    ``lens``); ``seq`` / ``pos`` ``(total,)`` locate each packed row in the padded batch and ``mine``
    says whether it belongs to a sequence at all (rows past ``cu[-1]`` or past ``max_len`` do not).
    Offsets are clamped into range, so bad ``cu_seqlens`` give wrong numbers, never an index error.
    """

    def __init__(self, cu: Tensor, max_len: int, total: int) -> None:
        dev = cu.device
        cu = cu.to(torch.int64)
        start = cu[:-1].clamp(0, total)
        end = torch.maximum(cu[1:].clamp(0, total), start)
        self.lens = (end - start).clamp(max=max_len)
        B = cu.shape[0] - 1
        ar = torch.arange(max_len, device=dev)
        self.pad = (start[:, None] + ar[None, :]).clamp(max=max(total - 1, 0))
        t = torch.arange(total, device=dev)
        seq = torch.searchsorted(end.contiguous(), t, right=True).clamp(max=max(B - 1, 0))
        pos = t - start[seq]
        self.mine = (pos >= 0) & (pos < self.lens[seq]) & (t < end[-1] if B > 0 else t < 0)
        self.seq, self.pos = seq, pos.clamp(0, max(max_len - 1, 0))

    def padded(self, x: Tensor) -> Tensor:
        """``(total, ...)`` -> ``(B, max_len, ...)`` (rows past a sequence's end hold other rows)."""
        return x[self.pad]

    def packed(self, x: Tensor, fill: float = 0.0) -> Tensor:
        """``(B, max_len, ...)`` -> ``(total, ...)``, ``fill`` on rows of no sequence."""
        y = x[self.seq, self.pos]
        mine = self.mine.view(-1, *([1] * (y.dim() - 1)))
        return torch.where(mine, y, torch.full_like(y, fill))


def _varlen_geometry(cu_q, cu_k, max_q, max_k, total_q, total_k, causal, window_size, device, chunk=0):
    cu_q, cu_k = cu_q.to(device), cu_k.to(device)
    pq, pk = _Packing(cu_q, max_q, total_q), _Packing(cu_k, max_k, total_k)
    rel = _rows_rel(max_q, max_k, pk.lens - pq.lens + max_q)  # each sequence's diagonal: i + lens_k - lens_q
    i = torch.arange(max_q, device=cu_q.device).view(1, 1, 1, -1, 1)
    j = torch.arange(max_k, device=cu_q.device).view(1, 1, 1, 1, -1)
    valid = (i < pq.lens.view(-1, 1, 1, 1, 1)) & (j < pk.lens.view(-1, 1, 1, 1, 1))
    return pq, pk, rel, _visible(rel, valid, causal, window_size, chunk, j)


def attention_varlen_fwd_ref(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                             max_seqlen_q: int, max_seqlen_k: int, *, softmax_scale: float, causal: bool = False,
                             window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Tensor | None = None, dropout_p: float = 0.0,
                             rng_state: Tensor | None = None, return_probs: bool = False,
                             attention_chunk: int = 0) -> tuple[Tensor, Tensor, Tensor | None]:
    """Varlen forward on packed ``(total, heads, d)`` inputs. Returns ``out (total_q, h, d)``,
    ``lse (h, total_q)`` and, when asked, ``(B, h, max_seqlen_q, max_seqlen_k)`` as in
    ``attention_fwd_ref`` (sequence ``b``'s rows and columns from 0, zero outside each sequence).
    Sequence ``b`` is batch index ``b`` for ALiBi and dropout.

    Computed on a padded ``(B, max_seqlen, ...)`` batch with per-sequence masks: tensor ops only, so
    it traces under ``torch.compile``. Rows outside every sequence give 0 and ``lse = +inf``."""
    rng = _rng(rng_state, dropout_p, q.device)
    total_q, h, d = q.shape
    B = cu_seqlens_q.shape[0] - 1
    dt = _compute_dtype(q)
    if total_q == 0 or k.shape[0] == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        out = torch.zeros((total_q, h, v.shape[-1]), dtype=q.dtype, device=q.device)
        lse = torch.full((h, total_q), float("inf"), dtype=dt, device=q.device)
        probs = torch.zeros(B, h, max_seqlen_q, max_seqlen_k, dtype=q.dtype, device=q.device) if return_probs else None
        return out, lse, probs
    pq, pk, rel, vis = _varlen_geometry(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, k.shape[0],
                                        causal, window_size, q.device, attention_chunk)
    bidx = torch.arange(B, device=q.device)
    out, lse, probs = _dense_fwd(pq.padded(q), pk.padded(k), pk.padded(v), softmax_scale, rel, vis, softcap,
                                 alibi_slopes, dropout_p, rng, bidx, max_seqlen_q, max_seqlen_k, return_probs)
    out = pq.packed(out)
    lse = pq.packed(lse.transpose(1, 2), float("inf")).t().contiguous()
    if probs is not None:  # +0 outside each sequence (the padding of the (max_q, max_k) layout)
        inside = ((torch.arange(max_seqlen_q, device=q.device).view(1, 1, -1, 1) < pq.lens.view(-1, 1, 1, 1))
                  & (torch.arange(max_seqlen_k, device=q.device).view(1, 1, 1, -1) < pk.lens.view(-1, 1, 1, 1)))
        probs = torch.where(inside, probs, torch.zeros_like(probs)).to(q.dtype)
    return out.to(q.dtype), lse, probs


def attention_varlen_bwd_ref(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                             softmax_scale: float, causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                             softcap: float = 0.0, alibi_slopes: Tensor | None = None, dropout_p: float = 0.0,
                             rng_state: Tensor | None = None,
                             attention_chunk: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Varlen backward: ``(dq, dk, dv)`` packed like ``q``, ``k``, ``v`` (0 on rows of no sequence)."""
    rng = _rng(rng_state, dropout_p, q.device)
    if q.shape[0] == 0 or k.shape[0] == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    B = cu_seqlens_q.shape[0] - 1
    pq, pk, rel, vis = _varlen_geometry(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0],
                                        k.shape[0], causal, window_size, q.device, attention_chunk)
    lse_p = pq.padded(lse.t()).transpose(1, 2)  # (B, h, max_q)
    bidx = torch.arange(B, device=q.device)
    dq, dk, dv = _dense_bwd(pq.padded(dout), pq.padded(q), pk.padded(k), pk.padded(v), pq.padded(out), lse_p,
                            softmax_scale, rel, vis, softcap, alibi_slopes, dropout_p, rng, bidx, max_seqlen_q,
                            max_seqlen_k)
    return pq.packed(dq).to(q.dtype), pk.packed(dk).to(k.dtype), pk.packed(dv).to(v.dtype)


def attention_range_fwd_ref(q: Tensor, k: Tensor, v: Tensor, k_start: Tensor | None, k_end: Tensor, *,
                            softmax_scale: float, causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                            softcap: float = 0.0, alibi_slopes: Tensor | None = None,
                            attention_chunk: int = 0) -> tuple[Tensor, Tensor]:
    """Dense forward where batch row ``b`` attends to keys ``k_start[b] .. k_end[b]`` of ``k``/``v``
    ``(B, sk, hk, d)`` only, its causal diagonal aligned to ``k_end[b]`` (a KV cache's filled part).
    ``k_start`` (default 0) / ``k_end``: integer ``(B,)``, clamped into ``[0, sk]``. Returns ``(out (B,
    sq, h, d) in q's dtype, lse (B, h, sq))``."""
    sk = k.shape[1]
    end = k_end.to(device=q.device, dtype=torch.int64).clamp(0, sk)
    start = (torch.zeros_like(end) if k_start is None
             else torch.minimum(k_start.to(device=q.device, dtype=torch.int64).clamp(min=0), end))
    rel = _rows_rel(q.shape[1], sk, end)
    j = torch.arange(sk, device=q.device).view(1, 1, 1, 1, -1)
    valid = (j >= start.view(-1, 1, 1, 1, 1)) & (j < end.view(-1, 1, 1, 1, 1))
    vis = _visible(rel, valid, causal, window_size, attention_chunk, j - start.view(-1, 1, 1, 1, 1))
    # Slots outside the range may hold anything (a cache from torch.empty): a zero probability times a
    # NaN value is still NaN, so they are zeroed rather than only masked.
    keep = (j >= start.view(-1, 1, 1, 1, 1)) & (j < end.view(-1, 1, 1, 1, 1))
    keep = keep.reshape(-1, sk)[:, :, None, None]
    k = k.masked_fill(~keep, 0)
    v = v.masked_fill(~keep, 0)
    out, lse, _ = _dense_fwd(q, k, v, softmax_scale, rel, vis, softcap, alibi_slopes, 0.0, None, None, 0, 0, False)
    return out.to(q.dtype), lse


def _bounds(cu: Tensor) -> list[int]:
    return [int(x) for x in cu.tolist()]


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
    rel = _dense_rel(sq, sk, q.device)
    s, _ = _scores(qg, kg, scale, rel, _visible(rel, None, causal, window_size), softcap, al)
    p, lse = _softmax(s)
    if mask is not None:
        p = torch.where(mask.reshape(B, hk, h // hk, sq, sk), p, torch.zeros_like(p)) / (1.0 - dropout_p)
    elif dropout_p > 0.0:
        bidx = torch.arange(b0, b0 + B, device=q.device)
        keep = _keep(rng, dropout_p, bidx, h, hk, sq, sk, sq_stride, sk_stride)
        p = torch.where(keep, p, torch.zeros_like(p)) / (1.0 - dropout_p)
    out = torch.matmul(p, vg).reshape(B, h, sq, d).transpose(1, 2).contiguous()
    return out, lse.reshape(B, h, sq)


def dequantize_fp8(q, k, v, descales, cu_q=None, cu_k=None):
    """float8 ``q``/``k``/``v`` as fp32 times their descales (fp32 ``(B, hk)``; ``None``: 1): query head
    ``h`` uses KV head ``h // (h_q / h_k)``'s. Packed (varlen) rows take their sequence's batch index."""
    qf, kf, vf = q.float(), k.float(), v.float()
    if descales is None:
        return qf, kf, vf
    g = q.shape[-2] // k.shape[-2]

    def rows(cu, n):  # batch index of each packed row
        t = torch.arange(n, device=cu.device)
        return torch.searchsorted(cu[1:].to(torch.int64).contiguous(), t, right=True).clamp(max=cu.shape[0] - 2)

    out = []
    for x, d, cu, grp in ((qf, descales[0], cu_q, g), (kf, descales[1], cu_k, 1), (vf, descales[2], cu_k, 1)):
        d = d.to(device=x.device, dtype=torch.float32)
        if grp > 1:
            d = d.repeat_interleave(grp, dim=1)
        if x.dim() == 3:
            d = d[rows(cu, x.shape[0])]  # (total, h)
        else:  # (B, 1, h); a KV cache may hold more rows than the batch (the first B are attended)
            x, d = x[:d.shape[0]], d[:, None]
        out.append(x * d[..., None])
    return tuple(out)
