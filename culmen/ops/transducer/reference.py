"""Pure-PyTorch transducer joint and RNN-T loss: the CPU path of the ops and the tests' oracles.

``transducer_joint_fwd_ref`` / ``transducer_joint_bwd_ref`` and ``rnnt_loss_fwd_ref`` /
``rnnt_loss_bwd_ref`` compute what the kernels compute (same layouts, same dropout mask, fp32
statistics, fp64 for fp64 inputs). ``rnnt_loss_ref`` is the textbook definition (log-softmax, then the
alpha recursion cell by cell) kept differentiable, so autograd checks the hand-derived gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

NEG = -1.0e30  # the kernels' finite log zero


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _base_rows(batch_offset: Tensor, B: int) -> Tensor:
    """First packed row of each batch (``batch_offset`` is the inclusive cumsum of the row counts)."""
    boff = batch_offset.to(torch.int64).reshape(-1)[:B]
    return torch.cat([boff.new_zeros(1), boff[:-1]])


def grid_rows(t_len: Tensor, u_len: Tensor, T: int, U: int, packed: bool, batch_offset: Tensor | None,
              n_rows: int) -> tuple[Tensor, Tensor]:
    """``(rows, valid)``, both ``(B, T, U)``: the row of ``(b, t, u)`` in the dense ``(B*T*U, W)`` or packed
    ``(n_rows, W)`` layout (clamped in range) and whether ``t < t_len[b]``, ``u < u_len[b]`` (and, packed,
    the row exists)."""
    dev = t_len.device
    B = t_len.shape[0]
    tl_ = t_len.to(torch.int64).clamp(0, T).view(B, 1, 1)
    ul = u_len.to(torch.int64).clamp(0, U).view(B, 1, 1)
    t = torch.arange(T, device=dev).view(1, T, 1)
    u = torch.arange(U, device=dev).view(1, 1, U)
    valid = (t < tl_) & (u < ul)
    if packed:
        rows = _base_rows(batch_offset.to(dev), B).view(B, 1, 1) + t * ul + u
        valid = valid & (rows < n_rows)
    else:
        rows = (torch.arange(B, device=dev).view(B, 1, 1) * T + t) * U + u
    return rows.clamp(0, max(n_rows - 1, 0)), valid


# ----------------------------------------------------------------------------------------------- joint


def joint_keep_mask(f: Tensor, g: Tensor, relu: bool, dropout_p: float | None, rng: Tensor | None) -> Tensor:
    """The dense ``(B, T, U, H)`` bool keep-mask of ReLU (``f + g > 0``, summed in fp32) and dropout
    (``tl.rand(seed, off + ((b*T + t)*U + u)*H + h) >= p``, replayed bit-exactly on the host)."""
    B, T, H = f.shape
    U = g.shape[1]
    keep = torch.ones((B, T, U, H), dtype=torch.bool, device=f.device)
    if relu:
        acc = _acc(f.dtype)
        keep &= (f.to(acc).unsqueeze(2) + g.to(acc).unsqueeze(1)) > 0
    if dropout_p is not None:
        from culmen.ops.attention.dropout import philox_rand

        counter = rng[1].to(torch.int64) + torch.arange(B * T * U * H, device=f.device).view(B, T, U, H)
        keep &= philox_rand(rng[0], counter) >= dropout_p
    return keep


def transducer_joint_fwd_ref(f: Tensor, g: Tensor, f_len: Tensor, g_len: Tensor, batch_offset: Tensor | None,
                             packed_batch: int, pack_output: bool, relu: bool, dropout_p: float | None,
                             scale: float, rng: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``(h, keep)`` as the joint kernel writes them.

    ``h``: dense ``(B, T, U, H)`` with ``-1`` outside ``t < f_len[b], u < g_len[b]``, or packed
    ``(packed_batch, H)`` (rows no batch owns are zero). ``keep`` (uint8, same layout) when ReLU or dropout
    is on, else ``None``. ``dropout_p=None`` means no dropout; kept elements are scaled by ``scale``.
    """
    B, T, H = f.shape
    U = g.shape[1]
    acc = _acc(f.dtype)
    h = f.to(acc).unsqueeze(2) + g.to(acc).unsqueeze(1)
    keep = None
    if relu or dropout_p is not None:
        keep = joint_keep_mask(f, g, relu, dropout_p, rng)
        h = torch.where(keep, h * scale, h.new_zeros(()))
    h = h.to(f.dtype)
    n_rows = packed_batch if pack_output else B * T * U
    rows, valid = grid_rows(f_len, g_len, T, U, pack_output, batch_offset, n_rows)
    if not pack_output:
        h = torch.where(valid.unsqueeze(-1), h, h.new_full((), -1.0))
        if keep is not None:
            keep = keep & valid.unsqueeze(-1)
        return h, None if keep is None else keep.to(torch.uint8)
    out = _scatter_rows(h.new_zeros((packed_batch, H)), rows, valid, h)
    if keep is None:
        return out, None
    kout = torch.zeros((packed_batch, H), dtype=torch.uint8, device=f.device)
    return out, _scatter_rows(kout, rows, valid, keep.to(torch.uint8))


def _scatter_rows(out: Tensor, rows: Tensor, valid: Tensor, src: Tensor) -> Tensor:
    """``out[rows[valid]] = src[valid]`` for distinct valid rows, without a data-dependent shape (so that
    ``torch.compile`` traces it): invalid cells add zero to their clamped row."""
    if out.shape[0]:
        W = out.shape[-1]
        vals = torch.where(valid.unsqueeze(-1), src, src.new_zeros(())).reshape(-1, W)
        out.index_put_((rows.reshape(-1),), vals, accumulate=True)
    return out


def transducer_joint_bwd_ref(dh: Tensor, f: Tensor, g: Tensor, f_len: Tensor, g_len: Tensor,
                             batch_offset: Tensor | None, pack_output: bool, relu: bool, dropout_p: float | None,
                             scale: float, rng: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(df, dg)``: ``dh * keep * scale`` summed over ``u < g_len`` / ``t < f_len`` (fp32 accumulation),
    zero at ``t >= f_len`` / ``u >= g_len``; the dtypes of ``f`` / ``g``."""
    B, T, H = f.shape
    U = g.shape[1]
    acc = _acc(dh.dtype)
    rows, valid = grid_rows(f_len, g_len, T, U, pack_output, batch_offset, dh.shape[0] if pack_output else B * T * U)
    d = dh.reshape(-1, H)[rows.reshape(-1)].reshape(B, T, U, H).to(acc)
    d = torch.where(valid.unsqueeze(-1), d, d.new_zeros(()))
    if relu or dropout_p is not None:
        keep = joint_keep_mask(f, g, relu, dropout_p, rng)
        d = torch.where(keep, d * scale, d.new_zeros(()))
    return d.sum(2).to(f.dtype), d.sum(1).to(g.dtype)


# ------------------------------------------------------------------------------------------------ loss


def _logaddexp(a: Tensor, b: Tensor) -> Tensor:
    m = torch.maximum(a, b)
    return m + torch.log(torch.exp(a - m) + torch.exp(b - m))


def rnnt_loss_fwd_ref(x: Tensor, label: Tensor, f_len: Tensor, y_len: Tensor, blank: int,
                      batch_offset: Tensor | None, T: int, packed: bool) -> dict[str, Tensor]:
    """The forward of the RNN-T loss on logits ``x`` (dense ``(B, T, U, K)`` or packed ``(N, K)``).

    Returns ``{"loss": (B,) x.dtype, "alpha", "beta", "lse", "lpb", "lpe": (B, T, U) fp32 (fp64 for fp64)}``
    (entries outside the lengths hold ``NEG`` or other finite filler).
    """
    B = f_len.shape[0]
    K = x.shape[-1]
    U = x.shape[2] if not packed else label.shape[1] + 1
    acc = _acc(x.dtype)
    fl = f_len.to(torch.int64).clamp(1, T)
    yl = y_len.to(torch.int64).clamp(0, U - 1)
    xr = x.reshape(-1, K)
    rows, valid = grid_rows(fl, yl + 1, T, U, packed, batch_offset, xr.shape[0])
    xs = xr[rows.reshape(-1)].to(acc)  # (B*T*U, K)
    lse = torch.logsumexp(xs, -1).view(B, T, U)
    lab = torch.zeros((B, U), dtype=torch.int64, device=x.device)
    width = min(U - 1, label.shape[1])
    lab[:, :width] = label[:, :width].to(torch.int64).clamp(0, K - 1)
    lpb = xs[:, blank].view(B, T, U) - lse
    lpe = xs.gather(1, lab.unsqueeze(1).expand(B, T, U).reshape(-1, 1)).view(B, T, U) - lse
    u = torch.arange(U, device=x.device)
    lpe = torch.where(valid & (u < yl.view(B, 1, 1)), lpe, lpe.new_full((), NEG))
    lpb = torch.where(valid, lpb, lpb.new_full((), NEG))
    alpha = lpb.new_full((B, T, U), NEG)
    alpha[:, 0, 0] = 0.0
    for n in range(1, T + U - 1):
        uu = u[max(0, n - T + 1):min(n, U - 1) + 1]  # the cells (t, u) of the anti-diagonal t + u = n
        t = n - uu
        top = torch.where(t > 0, alpha[:, (t - 1).clamp(min=0), uu] + lpb[:, (t - 1).clamp(min=0), uu], NEG)
        left = torch.where(uu > 0, alpha[:, t, (uu - 1).clamp(min=0)] + lpe[:, t, (uu - 1).clamp(min=0)], NEG)
        alpha[:, t, uu] = torch.where(valid[:, t, uu], _logaddexp(top, left), NEG)
    # beta with a virtual end node (fl, yl) of value 0 in a (T+1, U+1) padding
    beta = lpb.new_full((B, T + 1, U + 1), NEG)
    beta[torch.arange(B, device=x.device), fl, yl] = 0.0
    vpad = torch.zeros((B, T + 1, U + 1), dtype=torch.bool, device=x.device)
    vpad[:, :T, :U] = valid
    for n in range(T + U - 2, -1, -1):
        uu = u[max(0, n - T + 1):min(n, U - 1) + 1]
        t = n - uu
        val = _logaddexp(beta[:, t + 1, uu] + lpb[:, t, uu], beta[:, t, uu + 1] + lpe[:, t, uu])
        beta[:, t, uu] = torch.where(vpad[:, t, uu], val, beta[:, t, uu])
    beta = beta[:, :T, :U].contiguous()
    return {"loss": (-beta[:, 0, 0]).to(x.dtype), "alpha": alpha, "beta": beta, "lse": lse, "lpb": lpb, "lpe": lpe}


def rnnt_loss_bwd_ref(loss_grad: Tensor, x: Tensor, label: Tensor, f_len: Tensor, y_len: Tensor, blank: int,
                      batch_offset: Tensor | None, T: int, packed: bool, saved: dict[str, Tensor]) -> Tensor:
    """The gradient of ``sum_b loss_grad[b] * loss[b]`` w.r.t. the logits ``x`` (softmax backward fused);
    zero on rows outside the lengths. ``saved`` is ``rnnt_loss_fwd_ref``'s output."""
    B = f_len.shape[0]
    K = x.shape[-1]
    U = saved["alpha"].shape[2]
    acc = _acc(x.dtype)
    fl = f_len.to(torch.int64).clamp(1, T)
    yl = y_len.to(torch.int64).clamp(0, U - 1)
    xr = x.reshape(-1, K)
    rows, valid = grid_rows(fl, yl + 1, T, U, packed, batch_offset, xr.shape[0])
    a, be = saved["alpha"], saved["beta"]
    b0 = be[:, 0, 0].view(B, 1, 1)
    t = torch.arange(T, device=x.device).view(1, T, 1)
    u = torch.arange(U, device=x.device).view(1, 1, U)
    end = (t == fl.view(B, 1, 1) - 1) & (u == yl.view(B, 1, 1))
    nxt_t = torch.cat([be[:, 1:], be.new_full((B, 1, U), NEG)], 1)
    nxt_t = torch.where(t < fl.view(B, 1, 1) - 1, nxt_t, be.new_full((), NEG))
    nxt_t = torch.where(end, be.new_zeros(()), nxt_t)
    nxt_u = torch.cat([be[:, :, 1:], be.new_full((B, T, 1), NEG)], 2)
    emit = valid & (u < yl.view(B, 1, 1))
    w_blank = torch.exp(a + saved["lpb"] + nxt_t - b0)
    w_label = torch.where(emit, torch.exp(a + saved["lpe"] + nxt_u - b0), be.new_zeros(()))
    xs = xr[rows.reshape(-1)].to(acc).view(B, T, U, K)
    g = torch.exp(xs + (a + be - b0 - saved["lse"]).unsqueeze(-1))
    g[..., blank] -= w_blank
    lab = torch.zeros((B, U), dtype=torch.int64, device=x.device)
    width = min(U - 1, label.shape[1])
    lab[:, :width] = label[:, :width].to(torch.int64).clamp(0, K - 1)
    g.scatter_add_(3, lab.view(B, 1, U, 1).expand(B, T, U, 1).contiguous(), -w_label.unsqueeze(-1))
    g = g * loss_grad.to(acc).view(B, 1, 1, 1)
    g = torch.where(valid.unsqueeze(-1), g, g.new_zeros(()))
    if not packed:
        return g.to(x.dtype).reshape(x.shape)
    return _scatter_rows(torch.zeros_like(xr), rows, valid, g.to(x.dtype)).reshape(x.shape)


def rnnt_loss_ref(logits: Tensor, labels: Tensor, f_len: Tensor, y_len: Tensor, blank: int) -> Tensor:
    """Textbook RNN-T loss ``-log P(y | x)`` per batch, in ``logits.dtype`` (use float64), differentiable.

    ``logits (B, T, U, K)`` (unnormalized), ``labels (B, >= U-1)``; batch ``b`` uses ``t < f_len[b]`` and
    ``u <= y_len[b]``. Cell by cell (Graves 2012, eqs. 16-18): for small shapes only.
    """
    lp = torch.log_softmax(logits, -1)
    losses = []
    for b in range(logits.shape[0]):
        fl, yl = int(f_len[b]), int(y_len[b])
        alpha: dict[tuple[int, int], Tensor] = {}
        for t in range(fl):
            for u in range(yl + 1):
                terms = []
                if t == 0 and u == 0:
                    terms.append(lp.new_zeros(()))
                if t > 0:
                    terms.append(alpha[t - 1, u] + lp[b, t - 1, u, blank])
                if u > 0:
                    terms.append(alpha[t, u - 1] + lp[b, t, u - 1, int(labels[b, u - 1])])
                alpha[t, u] = torch.logsumexp(torch.stack(terms), 0)
        losses.append(-(alpha[fl - 1, yl] + lp[b, fl - 1, yl, blank]))
    return torch.stack(losses)
