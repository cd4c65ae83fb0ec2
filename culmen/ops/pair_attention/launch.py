"""Call plans of pair-bias attention: validate once per call signature, then allocate and launch.

A ``PairAttnPlan`` is built from the canonical 5-d arguments (``q [Z1, Z2, H, M, D]``, ``k`` / ``v``
``[Z1, Z2, H, N, D]``, ``bias`` / ``mask`` 5-d with every dim 1 or full): it runs the checks, chooses the
backend, fixes tiles, grids and strides (0 on broadcast dims), decides how the bias gradient is reduced,
and binds one ``Launch`` per kernel. ``TUNING`` holds the tile rules (every change drops the plans).

The bias gradient: when the bias is broadcast over none of ``(Z1, Z2, H)`` the dQ kernel stores ``dS``
directly; otherwise ``_pair_attn_bwd_dbias_kernel`` sums ``dS`` over the broadcast ones (OpenFold's
triangle attention: over ``Z2 = I``) tile by tile in registers. A bias broadcast over ``M`` or ``N`` (rare)
gets its ``[.., M, N]`` gradient in fp32 and summed by PyTorch afterwards.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from culmen.ops.backend import choose_backend, interpreter_enabled
from culmen.ops.common.launch import Launch, PlanTuning, aligned_16, cdiv, next_pow2, stream_getter
from culmen.ops.common.plans import PlanCache, clear_plans
from culmen.ops.pair_attention.kernels import (
    _pair_attn_bwd_dbias_kernel,
    _pair_attn_bwd_delta_kernel,
    _pair_attn_bwd_dkdv_kernel,
    _pair_attn_bwd_dq_kernel,
    _pair_attn_fwd_kernel,
)

TUNING = PlanTuning({
    # Forward tiles (rows x columns) for head dims <= 64 and above; warps and pipeline stages.
    "fwd_block_m": 128, "fwd_block_m_wide": 64, "fwd_block_n": 64, "fwd_warps": 4, "fwd_stages": 3,
    # Backward tiles (dK/dV, dQ and dBias kernels), warps and stages.
    "bwd_block_m": 64, "bwd_block_n": 64, "bwd_warps": 4, "bwd_stages": 2,
    # Tiles under the CPU interpreter: small, so tests at odd sizes cross several blocks.
    "interp_block": 16,
}, clear_plans)

PLANS = PlanCache("pair_attention")

LOG2E = 1.4426950408889634
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def _strides5(t: Tensor | None) -> tuple[int, ...]:
    """Strides of a 5-d tensor with 0 on size-1 dims (broadcast), or zeros for an absent tensor."""
    if t is None:
        return (0, 0, 0, 0, 0)
    return tuple(0 if n == 1 else s for n, s in zip(t.shape, t.stride()))


def check_canonical(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, mask: Tensor | None) -> None:
    """The checks of canonical 5-d arguments; errors name the argument and what it got."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or not t.dtype.is_floating_point:
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(f"pair_attention: {name} must be a floating-point tensor, got {got}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"pair_attention: q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"pair_attention: k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if q.shape[:3] != k.shape[:3] or q.shape[4] != k.shape[4]:
        raise ValueError(f"pair_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must agree in every dim "
                         "but the sequence length (-2)")
    if not q.device == k.device == v.device:
        raise ValueError(f"pair_attention: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    z1, z2, h, m, _ = q.shape
    full = (z1, z2, h, m, k.shape[3])
    for name, t in (("bias", bias), ("mask", mask)):
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"pair_attention: {name} must be a tensor or None, got {type(t).__name__}")
        if t.dim() != 5 or any(s not in (1, f) for s, f in zip(t.shape, full)):
            raise ValueError(f"pair_attention: {name} of shape {tuple(t.shape)} does not broadcast to the "
                             f"logits {full}")
        if t.device != q.device:
            raise ValueError(f"pair_attention: {name} is on {t.device}, q on {q.device}")
    if bias is not None and not bias.dtype.is_floating_point:
        raise TypeError(f"pair_attention: bias must be a floating-point tensor, got {bias.dtype}")


class PairAttnPlan:
    """Everything derived from one call signature of canonical arguments (see the module docstring)."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, mask: Tensor | None, inf: float,
                 scale: float | None) -> None:
        check_canonical(q, k, v, bias, mask)
        if not math.isfinite(float(inf)) or float(inf) <= 0:
            raise ValueError(f"pair_attention: inf must be a positive finite number, got {inf}")
        z1, z2, h, m, d = q.shape
        n = k.shape[3]
        self.shape = (z1, z2, h, m, d)
        self.N = n
        self.device = q.device
        self.dtype = q.dtype
        self.scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        self.inf = float(inf)
        self.has_bias, self.has_mask = bias is not None, mask is not None
        empty = q.numel() == 0 or k.numel() == 0
        self.use_kernel = (choose_backend(q.device) == "triton" and q.dtype in KERNEL_DTYPES and d <= MAX_HEAD_DIM
                           and not empty)
        if not self.use_kernel:
            return
        self.slices = z1 * z2 * h
        interp = interpreter_enabled() and q.device.type == "cpu"
        bd = max(16, next_pow2(d))
        if interp:
            fbm = fbn = bbm = bbn = TUNING["interp_block"]
        else:
            fbm = TUNING["fwd_block_m"] if bd <= 64 else TUNING["fwd_block_m_wide"]
            fbn = TUNING["fwd_block_n"] if bd <= 128 else 32
            bbm = TUNING["bwd_block_m"]
            bbn = TUNING["bwd_block_n"] if bd <= 128 else 32
        common = {"BLOCK_D": bd, "DOT_PREC": "ieee" if q.dtype == torch.float32 else "tf32", "UPCAST": interp}
        flags = {"HAS_BIAS": self.has_bias, "HAS_MASK": self.has_mask}
        dev = q.device
        self.stream = stream_getter(dev)
        self.strides = (*q.stride(), *k.stride(), *v.stride(), *_strides5(bias), *_strides5(mask))
        fw, bw = TUNING["fwd_warps"], TUNING["bwd_warps"]
        if bd > 64:
            fw, bw = 8, 8
        self.fwd = Launch(_pair_attn_fwd_kernel, (self.slices, cdiv(m, fbm)),
                          {**flags, "BLOCK_M": fbm, "BLOCK_N": fbn, **common}, fw, TUNING["fwd_stages"], dev)
        self.delta = Launch(_pair_attn_bwd_delta_kernel, (self.slices, cdiv(m, bbm)),
                            {"BLOCK_M": bbm, "BLOCK_D": bd}, 4, 1, dev)
        bmeta = {**flags, "BLOCK_M": bbm, "BLOCK_N": bbn, **common}
        stages = TUNING["bwd_stages"]
        self.dkdv = Launch(_pair_attn_bwd_dkdv_kernel, (self.slices, cdiv(n, bbn)), bmeta, bw, stages, dev)
        self.dq = {s: Launch(_pair_attn_bwd_dq_kernel, (self.slices, cdiv(m, bbm)), {**bmeta, "STORE_DS": s}, bw,
                             stages, dev) for s in (False, True)}
        if self.has_bias:
            full = (z1, z2, h)
            bsz = tuple(bias.shape)
            self.bias_shape = bsz
            self.kept = tuple(bsz[:3])
            # A dim is summed in the kernel when the bias is broadcast over it (size 1, full size > 1).
            self.red = tuple(f if b == 1 else 1 for b, f in zip(bsz[:3], full))
            self.reduce_r = self.red[0] * self.red[1] * self.red[2]
            self.sum_dims = tuple(i for i, (b, f) in enumerate(zip(bsz[3:], (m, n)), start=3) if b == 1 and f > 1)
            self.db_dtype = torch.float32 if self.sum_dims else bias.dtype
            kept = self.kept[0] * self.kept[1] * self.kept[2]
            self.dbias = Launch(_pair_attn_bwd_dbias_kernel, (kept, cdiv(m, bbm), cdiv(n, bbn)),
                                {"HAS_MASK": self.has_mask, "BLOCK_M": bbm, "BLOCK_N": bbn, **common}, bw, stages,
                                dev)
        sl = math.log2(math.e) * self.scale
        self.scalars = (z2, h, m, n, d, sl, self.inf * LOG2E)
        self.bscalars = (z2, h, m, n, d, self.scale, sl, self.inf * LOG2E)

    # ------------------------------------------------------------------------------ forward

    def forward(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, mask: Tensor | None
                ) -> tuple[Tensor, Tensor]:
        """``(o, lse)``: ``o`` contiguous ``[Z1, Z2, H, M, D]`` in q's dtype, ``lse`` fp32 ``[slices, M]``
        (log2 units)."""
        z1, z2, h, m, d = self.shape
        o = torch.empty((z1, z2, h, m, d), device=self.device, dtype=self.dtype)
        lse = torch.empty((self.slices, m), device=self.device, dtype=torch.float32)
        b = q if bias is None else bias
        mk = q if mask is None else mask
        self.fwd(self.stream(), aligned_16(q, k, v, b, mk, o), q, k, v, b, mk, o, lse, *self.strides,
                 *self.scalars)
        return o, lse

    # ----------------------------------------------------------------------------- backward

    def backward(self, do: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, mask: Tensor | None,
                 o: Tensor, lse: Tensor, need_dbias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """``(dq, dk, dv, dbias)``: contiguous gradients of the canonical q/k/v shapes, and the bias gradient
        in the bias' (5-d) shape and dtype (``None`` unless ``need_dbias``)."""
        z1, z2, h, m, d = self.shape
        n = self.N
        do = do.contiguous()
        stream = self.stream()
        delta = torch.empty((self.slices, m), device=self.device, dtype=torch.float32)
        self.delta(stream, aligned_16(o, do), o, do, delta, m, d)
        dq = torch.empty_like(o)
        dk = torch.empty((z1, z2, h, n, d), device=self.device, dtype=self.dtype)
        dv = torch.empty_like(dk)
        b = q if bias is None else bias
        mk = q if mask is None else mask
        aligned = aligned_16(q, k, v, b, mk, do, dq, dk, dv)
        self.dkdv(stream, aligned, q, k, v, b, mk, do, lse, delta, dk, dv, *self.strides, *self.bscalars)
        db = None
        need_dbias = need_dbias and self.has_bias
        direct = need_dbias and self.reduce_r == 1
        if need_dbias:
            db = torch.empty((*self.kept, m, n), device=self.device, dtype=self.db_dtype)
        self.dq[direct](stream, aligned, q, k, v, b, mk, do, lse, delta, dq, db if direct else dq,
                        *self.strides, *self.bscalars)
        if need_dbias:
            if not direct:
                r = self.red
                self.dbias(stream, aligned and aligned_16(db), q, k, v, b, mk, do, lse, delta, db, *self.strides,
                           z2, h, m, n, d, self.kept[1], self.kept[2], r[1], r[2], self.reduce_r,
                           self.bscalars[6], self.bscalars[7])
            if self.sum_dims:
                db = db.sum(self.sum_dims, keepdim=True).to(bias.dtype)
        return dq, dk, dv, db
