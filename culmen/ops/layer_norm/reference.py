"""Pure-PyTorch references for the fused add + LayerNorm / RMSNorm op.

``layer_norm_ref`` is the oracle the tests compare against: plain differentiable PyTorch, run in
whatever dtype its inputs have (pass float64 inputs for the oracle, low-precision inputs for the
"same computation in PyTorch" baseline of the tolerance rule).

``layer_norm_fwd_ref`` / ``layer_norm_bwd_ref`` are the CPU path of the custom ops: they take and
return exactly what the Triton launchers take and return, computing in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _dropout(x: Tensor, p: float, mask: Tensor | None) -> Tensor:
    if p == 0.0:
        return x
    if mask is None:
        return F.dropout(x, p=p)
    return x.masked_fill(~mask, 0.0) / (1.0 - p)


def _normalize(h: Tensor, w: Tensor | None, b: Tensor | None, eps: float, is_rms_norm: bool) -> Tensor:
    n = h.shape[-1]
    if w is not None:
        w = w.to(h.dtype)
    if b is not None:
        b = b.to(h.dtype)
    if is_rms_norm:
        out = F.rms_norm(h, (n,), w, eps)
        return out + b if b is not None else out
    return F.layer_norm(h, (n,), w, b, eps)


def layer_norm_ref(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None = None,
    x1: Tensor | None = None,
    weight1: Tensor | None = None,
    bias1: Tensor | None = None,
    eps: float = 1e-6,
    dropout_p: float = 0.0,
    rowscale: Tensor | None = None,
    prenorm: bool = False,
    zero_centered_weight: bool = False,
    dropout_mask: Tensor | None = None,
    dropout_mask1: Tensor | None = None,
    upcast: bool = False,
    is_rms_norm: bool = False,
    residual_in_fp32: bool = False,
    out_dtype: torch.dtype | None = None,
):
    """Unfused reference: ``norm(dropout(x * rowscale) + dropout(x1) + residual)``.

    Shapes: ``x``, ``residual``, ``x1``: ``(..., N)``; ``weight``, ``bias``, ``weight1``, ``bias1``:
    ``(N,)``; ``rowscale``: ``x.shape[:-1]``; dropout masks: bool, shaped like ``x`` (``True`` = kept).
    With ``upcast`` every input is cast to fp32 first. Returns ``out`` / ``(out, out1)`` and, with
    ``prenorm``, the pre-norm sum last (flash_attn's ``layer_norm_ref`` convention). Differentiable.
    """
    dtype = x.dtype
    out_dtype = out_dtype or dtype
    if upcast:
        x, residual, x1 = (t.float() if t is not None else None for t in (x, residual, x1))
        weight, bias, weight1, bias1 = (t.float() if t is not None else None for t in (weight, bias, weight1, bias1))
    if zero_centered_weight:
        weight = weight + 1.0 if weight is not None else None
        weight1 = weight1 + 1.0 if weight1 is not None else None
    if rowscale is not None:
        x = x * rowscale[..., None].to(x.dtype)
    x = _dropout(x, dropout_p, dropout_mask)
    if x1 is not None:
        x = x + _dropout(x1, dropout_p, dropout_mask1)
    if residual is not None:
        x = (x + residual).to(residual.dtype if not upcast else x.dtype)
    elif residual_in_fp32 and not upcast:
        x = x.float()
    out = _normalize(x, weight, bias, eps, is_rms_norm).to(out_dtype)
    if weight1 is None:
        return out if not prenorm else (out, x)
    out1 = _normalize(x, weight1, bias1, eps, is_rms_norm).to(out_dtype)
    return (out, out1) if not prenorm else (out, out1, x)


def rms_norm_ref(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                 rowscale=None, prenorm=False, zero_centered_weight=False, dropout_mask=None, dropout_mask1=None,
                 upcast=False, residual_in_fp32=False, out_dtype=None):
    """``layer_norm_ref`` with ``is_rms_norm=True`` (flash_attn's ``rms_norm_ref``)."""
    return layer_norm_ref(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                          zero_centered_weight, dropout_mask, dropout_mask1, upcast, True, residual_in_fp32, out_dtype)


# ---------------------------------------------------------------------------------------------
# The CPU path of the custom ops: same arguments and outputs as the Triton launchers.
# ---------------------------------------------------------------------------------------------


def keep_masks_ref(seed: Tensor, shape: tuple[int, int], dropout_p: float, two: bool) -> tuple[Tensor, Tensor | None]:
    """The kernels' dropout keep-masks, bit for bit: element ``(row, col)`` keeps when Philox-4x32 with
    7 rounds, key ``seed + row`` (``seed + M + row`` for ``x1``) and counter ``col`` draws above
    ``dropout_p``. ``seed`` is the 1-element int64 tensor the op draws; pure tensor ops (traceable)."""
    from culmen.ops.attention.dropout import philox_rand

    M, N = shape
    s = seed.reshape(1, 1).to(torch.int64)
    rows = torch.arange(M, device=seed.device, dtype=torch.int64)[:, None]
    cols = torch.arange(N, device=seed.device, dtype=torch.int64)[None, :]
    keep = philox_rand(s + rows, cols, n_rounds=7) > dropout_p
    keep1 = philox_rand(s + M + rows, cols, n_rounds=7) > dropout_p if two else None
    return keep, keep1


def _weights(weight, weight1, zero_centered_weight):
    w = weight.float() if weight is not None else None
    w1 = weight1.float() if weight1 is not None else None
    if zero_centered_weight:
        w = w + 1.0 if w is not None else None
        w1 = w1 + 1.0 if w1 is not None else None
    return w, w1


def _prenorm_sum(x, residual, x1, rowscale, seed, dropout_p):
    M, N = x.shape
    h = x.float()
    keep = keep1 = None
    if rowscale is not None:
        h = h * rowscale.float()[:, None]
    if dropout_p > 0.0:
        keep, keep1 = keep_masks_ref(seed, (M, N), dropout_p, x1 is not None)
        keep, keep1 = keep.to(x.device), keep1.to(x.device) if keep1 is not None else None
        h = torch.where(keep, h / (1.0 - dropout_p), 0.0)
    if x1 is not None:
        h1 = x1.float()
        if dropout_p > 0.0:
            h1 = torch.where(keep1, h1 / (1.0 - dropout_p), 0.0)
        h = h + h1
    if residual is not None:
        h = h + residual.float()
    return h, keep, keep1


def layer_norm_fwd_ref(x, weight, bias, residual, x1, weight1, bias1, rowscale, seed, eps, dropout_p,
                       is_rms_norm, zero_centered_weight, residual_dtype, out_dtype, store_residual_out,
                       store_mask):
    """Reference forward on 2-D ``(M, N)`` inputs; see ``launch.layer_norm_fwd`` for the contract."""
    M, N = x.shape
    h, keep, keep1 = _prenorm_sum(x, residual, x1, rowscale, seed, dropout_p)
    res_out = h.to(residual_dtype) if store_residual_out else None
    if store_residual_out:
        h = res_out.float()
    if is_rms_norm:
        mean = None
        var = (h * h).mean(-1) if N else h.new_zeros(M)
        hc = h
    else:
        mean = h.mean(-1) if N else h.new_zeros(M)
        hc = h - mean[:, None]
        var = (hc * hc).mean(-1) if N else h.new_zeros(M)
    rstd = torch.rsqrt(var + eps)
    xhat = hc * rstd[:, None]
    w, w1 = _weights(weight, weight1, zero_centered_weight)
    y = xhat * w if w is not None else xhat
    y = (y + bias.float() if bias is not None else y).to(out_dtype)
    if weight1 is not None:
        y1 = xhat * w1
        y1 = (y1 + bias1.float() if bias1 is not None else y1).to(out_dtype)
    else:
        y1 = None
    mask = keep if store_mask else None
    mask1 = keep1 if (store_mask and x1 is not None) else None
    return y, y1, mean, rstd, res_out, mask, mask1


def layer_norm_bwd_ref(dy, dy1, dres_out, xs, weight, bias, weight1, bias1, rowscale, seed, mean, rstd, eps,
                       dropout_p, is_rms_norm, zero_centered_weight, recompute_from_y, has_residual, has_x1,
                       x_dtype, x1_dtype, residual_dtype, store_dres):
    """Reference backward on 2-D inputs; see ``launch.layer_norm_bwd`` for the contract."""
    M, N = dy.shape
    dev = dy.device
    w, w1 = _weights(weight, weight1, zero_centered_weight)
    if recompute_from_y:
        yv = xs.float()
        if bias is not None:
            yv = yv - bias.float()
        xhat = yv / w if w is not None else yv
    elif is_rms_norm:
        xhat = xs.float() * rstd[:, None]
    else:
        xhat = (xs.float() - mean[:, None]) * rstd[:, None]
    g = dy.float()
    wdy = g * w if w is not None else g
    if dy1 is not None:
        g1 = dy1.float()
        wdy = wdy + g1 * w1
    c1 = (xhat * wdy).mean(-1, keepdim=True) if N else wdy.new_zeros(M, 1)
    if is_rms_norm:
        dh = (wdy - xhat * c1) * rstd[:, None]
    else:
        c2 = wdy.mean(-1, keepdim=True) if N else wdy.new_zeros(M, 1)
        dh = (wdy - (xhat * c1 + c2)) * rstd[:, None]
    if dres_out is not None:
        dh = dh + dres_out.float()
    # the column sums over all M rows accumulate in fp64: rounded once to the parameter dtype, so they sit
    # within an ulp of the exact sum whatever order another implementation sums in
    f64 = torch.float64
    dw = torch.sum(g * xhat, 0, dtype=f64).to(weight.dtype) if weight is not None else None
    db = torch.sum(g, 0, dtype=f64).to(bias.dtype) if bias is not None else None
    dw1 = torch.sum(g1 * xhat, 0, dtype=f64).to(weight1.dtype) if weight1 is not None else None
    db1 = torch.sum(g1, 0, dtype=f64).to(bias1.dtype) if bias1 is not None else None
    keep = keep1 = None
    if dropout_p > 0.0:
        keep, keep1 = keep_masks_ref(seed, (M, N), dropout_p, has_x1)
        keep, keep1 = keep.to(dev), keep1.to(dev) if keep1 is not None else None
    dx = dh
    if dropout_p > 0.0:
        dx = torch.where(keep, dx / (1.0 - dropout_p), 0.0)
    if rowscale is not None:
        dx = dx * rowscale.float()[:, None]
    dx = dx.to(x_dtype)
    dres = dh.to(residual_dtype) if store_dres else None
    if has_x1:
        dx1 = torch.where(keep1, dh / (1.0 - dropout_p), 0.0) if dropout_p > 0.0 else dh
        dx1 = dx1.to(x1_dtype)
    else:
        dx1 = None
    return dx, dw, db, dw1, db1, dres, dx1
