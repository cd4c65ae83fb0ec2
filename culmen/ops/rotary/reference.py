"""Pure-PyTorch references of the rotary position embedding.

``rotary_emb_ref`` is the oracle the tests compare against: plain differentiable PyTorch in the
inputs' dtype (float64 inputs for the oracle, low-precision inputs for the "same computation in
PyTorch" baseline of the tolerance rule), written as ``x * cos + rotate_half(x) * sin``.

``rotary_fwd_ref`` is the CPU path of the plans (``launch.RotaryPlan``): the kernel's contract (tables,
positions, packed sequences, 2-D form, conjugate, partial copy), computed in fp32 and written into
``out``; traceable by ``torch.compile`` (no data-dependent shapes).
"""

from __future__ import annotations

import torch
from torch import Tensor


def rotate_half(x: Tensor, interleaved: bool = False) -> Tensor:
    """``(-x2, x1)`` of the halves (GPT-NeoX) or of each (even, odd) pair (GPT-J), along the last dim."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def expand_table(t: Tensor, interleaved: bool, full_table: bool) -> Tensor:
    """A cos/sin table ``(..., W)`` as one value per rotated element ``(..., rotary_dim)``."""
    if full_table:
        return t
    return t.repeat_interleave(2, dim=-1) if interleaved else torch.cat((t, t), dim=-1)


def rotary_emb_ref(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False, full_table: bool = False) -> Tensor:
    """Oracle: rotate the first ``rotary_dim`` columns of ``x``, pass the rest through. Differentiable.

    Shapes: ``x`` ``(..., S, H, D)``; ``cos``/``sin`` ``(..., S, W)`` already one row per token of
    ``x`` (broadcast over heads), ``W = rotary_dim / 2`` (one angle per pair) or, with
    ``full_table``, ``W = rotary_dim`` (one value per element, Apex). Computes in ``x``'s dtype.
    """
    c = expand_table(cos, interleaved, full_table).unsqueeze(-2).to(x.dtype)
    s = expand_table(sin, interleaved, full_table).unsqueeze(-2).to(x.dtype)
    rd = c.shape[-1]
    xr = x[..., :rd]
    return torch.cat((xr * c + rotate_half(xr, interleaved) * s, x[..., rd:]), dim=-1)


# ---------------------------------------------------------------------------------------------
# The CPU path of the plans: the same contract as the Triton kernel.
# ---------------------------------------------------------------------------------------------


def _gather(table: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    """Rows ``table[pos]`` in fp32 and whether each position is inside the table."""
    ok = (pos >= 0) & (pos < table.shape[0])
    rows = table.to(torch.promote_types(table.dtype, torch.float32))[pos.clamp(0, max(table.shape[0] - 1, 0))]
    return rows, ok


def _rotate(xr: Tensor, c: Tensor, s: Tensor, ok: Tensor, interleaved: bool, full_table: bool,
            conjugate: bool, round_dtype: torch.dtype | None = None) -> Tensor:
    """``xr`` ``(N, H, 2*half)`` fp32, tables ``(N, W)``; rows with ``ok`` False pass through. With
    ``round_dtype`` every product is rounded to it (the tables already are): Apex's numerics."""
    c = expand_table(c, interleaved, full_table)[:, None, :]
    s = expand_table(s, interleaved, full_table)[:, None, :]
    c = torch.where(ok[:, None, None], c, 1.0)
    s = torch.where(ok[:, None, None], s, 0.0)
    return _rotate_pairs(xr, c, s, interleaved, conjugate, round_dtype)


def _rotate_pairs(xr: Tensor, c: Tensor, s: Tensor, interleaved: bool, conjugate: bool,
                  round_dtype: torch.dtype | None = None) -> Tensor:
    """The rotation of ``xr`` ``(..., 2*half)`` by tables ``c``/``s`` with one value per element, broadcastable
    to ``xr``."""
    if interleaved:
        x_lo, x_hi = xr[..., ::2], xr[..., 1::2]
        c_lo, c_hi, s_lo, s_hi = c[..., ::2], c[..., 1::2], s[..., ::2], s[..., 1::2]
    else:
        h = xr.shape[-1] // 2
        x_lo, x_hi = xr[..., :h], xr[..., h:]
        c_lo, c_hi, s_lo, s_hi = c[..., :h], c[..., h:], s[..., :h], s[..., h:]
    def r(t: Tensor) -> Tensor:
        return t if round_dtype is None else t.to(round_dtype).to(t.dtype)

    if conjugate:  # the transpose of the forward matrix
        y_lo, y_hi = r(x_lo * c_lo) + r(x_hi * s_hi), r(x_hi * c_hi) - r(x_lo * s_lo)
    else:
        y_lo, y_hi = r(x_lo * c_lo) - r(x_hi * s_lo), r(x_hi * c_hi) + r(x_lo * s_hi)
    if interleaved:
        return torch.stack((y_lo, y_hi), dim=-1).flatten(-2)
    return torch.cat((y_lo, y_hi), dim=-1)


def rotary_dense_ref(x: Tensor, cos: Tensor, sin: Tensor, offsets: Tensor | None, offset: int, interleaved: bool,
                     conjugate: bool, full_table: bool, seq_first: bool) -> Tensor:
    """The kernel's rotation of a dense ``x`` as differentiable, traceable PyTorch (what ``torch.compile``
    traces with ``culmen.set_compile_fusion(True)``, so Inductor fuses it): math in fp32 (fp64 for fp64), the
    result in ``x``'s dtype, the columns past the rotary dim passed through.

    Shapes: ``x`` ``(B, S, ..., D)`` (``(S, B, ..., D)`` with ``seq_first``); ``cos``/``sin`` ``(rows, W)``;
    ``offsets`` ``(B,)`` int (positions outside the tables pass through, as in the kernel) or ``None`` (then
    ``offset``, which the caller checked against the tables)."""
    cdt = torch.promote_types(x.dtype, torch.float32)
    S = x.shape[0 if seq_first else 1]
    pos = torch.arange(S, device=x.device)
    c, s = cos.to(cdt), sin.to(cdt)
    if offsets is not None:
        off = offsets.to(device=x.device, dtype=torch.int64)
        pos = pos[:, None] + off[None, :] if seq_first else off[:, None] + pos[None, :]
        c, ok = _gather(c, pos)
        s, _ = _gather(s, pos)
        c = torch.where(ok[..., None], c, 1.0)
        s = torch.where(ok[..., None], s, 0.0)
        lead = x.dim() - 3
    else:
        c, s = c[offset:offset + S], s[offset:offset + S]
        lead = x.dim() - (2 if seq_first else 3)
    c, s = (expand_table(t, interleaved, full_table) for t in (c, s))
    rd = c.shape[-1]
    c, s = (t.reshape(*t.shape[:-1], *([1] * lead), rd) for t in (c, s))
    y = _rotate_pairs(x[..., :rd].to(cdt), c, s, interleaved, conjugate).to(x.dtype)
    return y if rd == x.shape[-1] else torch.cat((y, x[..., rd:]), dim=-1)


def _token_positions(x: Tensor, seqlen_offsets: Tensor | None, cu_seqlens: Tensor | None, offset: int,
                     max_seqlen: int) -> tuple[Tensor, Tensor, Tensor]:
    """For each token of ``x``'s leading dims (flattened): its index in its sequence, its table
    position, and whether the kernel visits it (packed tokens past ``cu_seqlens[-1]`` or
    ``max_seqlen`` are not)."""
    dev = x.device
    if cu_seqlens is None:
        B, S = x.shape[:2]
        s = torch.arange(S, device=dev).repeat(B)
        b = torch.arange(B, device=dev).repeat_interleave(S)
        visited = torch.ones(B * S, dtype=torch.bool, device=dev)
    else:
        T = x.shape[0]
        cu = cu_seqlens.to(device=dev, dtype=torch.int64)
        t = torch.arange(T, device=dev)
        b = torch.searchsorted(cu[1:], t, right=True).clamp(max=max(cu.numel() - 2, 0))
        s = t - cu[b]
        visited = (t >= cu[0]) & (t < cu[-1]) & (s < max_seqlen)
    off = seqlen_offsets.to(dev, torch.int64)[b] if seqlen_offsets is not None else offset
    return s, s + off, visited


def rotary_fwd_ref(x: Tensor, out: Tensor, cos: Tensor, sin: Tensor, cos2: Tensor | None, sin2: Tensor | None,
                   seqlen_offsets: Tensor | None, cu_seqlens: Tensor | None, offset: int, max_seqlen: int,
                   interleaved: bool, conjugate: bool, full_table: bool, img_w: int, copy_rest: bool,
                   round_ops: bool = False) -> None:
    """Rotate ``x`` into ``out`` in fp32 (fp64 for fp64), as the kernel does; with ``round_ops`` and a
    16-bit ``x``, the tables, each product and the sum are rounded to x's dtype (the kernel's ``ROUND``).

    Shapes: ``x``/``out`` ``(B, S, H, D)`` (any strides), or ``(T, H, D)`` packed with ``cu_seqlens``
    ``(B + 1,)`` and ``max_seqlen``; ``cos``/``sin`` ``(rows, W)``, ``W = half`` (``full_table=False``) or
    ``2 * half``; ``cos2``/``sin2`` the column tables of the 2-D form (``img_w > 0``); ``seqlen_offsets``
    ``(B,)`` int or ``None`` (then ``offset``). ``copy_rest`` copies columns ``[2 * half, D)`` too."""
    lead = 1 if cu_seqlens is not None else 2
    H, D = x.shape[lead:]
    xf = x.reshape(-1, H, D).to(torch.promote_types(x.dtype, torch.float32))
    W = cos.shape[1]
    half = W // 2 if full_table else W
    s, pos, visited = _token_positions(x, seqlen_offsets, cu_seqlens, offset, max_seqlen)
    if img_w > 0:
        regions = [(0, cos, sin, s // img_w), (2 * half, cos2, sin2, s % img_w)]
        end = 4 * half
    else:
        regions = [(0, cos, sin, pos)]
        end = D if copy_rest else 2 * half
    rd = x.dtype if round_ops and x.dtype in (torch.float16, torch.bfloat16) else None
    res = xf.clone()
    for col0, tc, ts, p in regions:
        c, ok = _gather(tc, p)
        sn, _ = _gather(ts, p)
        if rd is not None:
            c, sn = c.to(rd), sn.to(rd)
        c, sn = c.to(xf.dtype), sn.to(xf.dtype)
        res[..., col0:col0 + 2 * half] = _rotate(xf[..., col0:col0 + 2 * half], c, sn, ok, interleaved, full_table,
                                                 conjugate, rd)
    # What the kernel does not write (unvisited tokens, the copied columns unless asked) keeps out's
    # content, which is x's when rotating in place (a select, not a boolean index: traceable).
    res = res[..., :end].to(out.dtype)
    if cu_seqlens is not None:
        res = torch.where(visited[:, None, None], res, out.reshape(-1, H, D)[..., :end])
    out[..., :end] = res.reshape(*out.shape[:-1], end)
