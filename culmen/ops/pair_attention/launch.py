"""Call plans of pair-bias attention: validate once per call signature, then allocate and launch.

A ``PairAttnPlan`` is built from the canonical 5-d arguments (``q [Z1, Z2, H, M, D]``, ``k`` / ``v``
``[Z1, Z2, H, N, D]``, ``bias`` / ``mask`` 5-d with every dim 1 or full): it runs the checks, chooses the
backend, fixes tiles, grids and strides (0 on broadcast dims), decides how the bias gradient is reduced,
and binds one ``Launch`` per kernel. ``TUNING`` holds the tile rules (every change drops the plans).

The backward computes each probability / ``dS`` tile once, in the kernel that owns a column block
(``dK``, ``dV``). When the bias gradient is wanted, that kernel stores ``dS`` (the logits' gradient,
``[slices, M, N]``) and two cheap passes read it: ``dQ = dS K`` and the bias gradient. A bias broadcast
over none of ``(Z1, Z2, H)`` gets ``dS`` itself (stored in the bias gradient's dtype when that loses
nothing for ``dQ``); otherwise ``dS`` is summed over the broadcast dims (OpenFold's triangle attention:
over ``Z2 = I``) by ``torch.sum`` (``TUNING["dbias_reduce"] = "torch"``, the default: faster on the H200)
or by ``_pair_attn_bwd_dbias_reduce_kernel`` in fp32 registers. Summing inside the column-block kernel
instead would need either
the ``dK`` / ``dV`` accumulators of every ``I`` or the bias tiles of every row block in registers, and
cuts the grid to ``H x column blocks`` programs. A bias broadcast over ``M`` or ``N`` (rare) gets its
``[.., M, N]`` gradient in fp32 and summed by PyTorch afterwards. Without a bias gradient, ``dQ``
recomputes the tiles (``TUNING["dq_nodbias"] = "recompute"``: memory stays O(rows)) or goes through the
stored ``dS`` (``"staged"``). Every reduction has one fixed order: the backward is bitwise reproducible.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from culmen.ops.backend import choose_backend, interpreter_enabled
from culmen.ops.common.launch import Launch, PlanTuning, aligned_16, cdiv, next_pow2, stream_getter
from culmen.ops.common.plans import PlanCache, clear_plans
from culmen.ops.pair_attention.kernels import (
    _pair_attn_bwd_dbias_reduce_kernel,
    _pair_attn_bwd_delta_kernel,
    _pair_attn_bwd_dq_kernel,
    _pair_attn_bwd_dq_staged_kernel,
    _pair_attn_bwd_kv_kernel,
    _pair_attn_fwd_kernel,
)

TUNING = PlanTuning({
    # Forward tiles (rows x columns) for head dims <= 64 and above; warps and pipeline stages.
    "fwd_block_m": 128, "fwd_block_m_wide": 64, "fwd_block_n": 64, "fwd_warps": 4, "fwd_stages": 3,
    # dK/dV/dS kernel for head dims <= kv_small_d: columns per program, rows per step, warps, stages. Small
    # head dims make the [cols, rows] logit tiles the register cost, so a tall column block with short row
    # steps (FA2's backward shape) keeps four fp32 tiles live without spilling. Wider heads: 64 x 64.
    "kv_small_d": 32, "kv_block_n": 128, "kv_block_m": 32, "kv_warps": 4, "kv_stages": 3,
    # dQ from the stored dS (rows per program, columns per step), warps, stages.
    "dq_block_m": 128, "dq_block_n": 64, "dq_warps": 4, "dq_stages": 3,
    # dQ recomputing the tiles (no bias gradient, "recompute"): rows per program, columns per step.
    "dqr_block_m": 64, "dqr_block_n": 64, "dqr_warps": 4, "dqr_stages": 2,
    # Bias-gradient reduction over the broadcast dims: tile, warps, loads in flight per step.
    "red_block_m": 32, "red_block_n": 64, "red_warps": 4, "red_unroll": 8,
    # "triton" (the reduce kernel) or "torch" (torch.sum of the stored dS). H200 sweep (2026-11-27, triangle
    # attention B1 H4 d32 bf16): torch.sum 0.539 / 1.664 ms fwd+bwd at N256 / N384, the kernel 0.596 / 1.847.
    "dbias_reduce": "torch",
    # dQ without a bias gradient: "recompute" (3 matmuls per tile, no dS buffer) or "staged" (dS stored).
    "dq_nodbias": "recompute",
    # Tiles under the CPU interpreter: small, so tests at odd sizes cross several blocks.
    "interp_block": 16, "interp_unroll": 2,
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
        T = TUNING
        if interp:
            ib = T["interp_block"]
            fbm = fbn = kbm = kbn = qbm = qbn = rbm = rbn = dbm = dbn = ib
            unroll = T["interp_unroll"]
            fw = kw = qw = dw = rw = 4
        else:
            fbm = T["fwd_block_m"] if bd <= 64 else T["fwd_block_m_wide"]
            fbn = T["fwd_block_n"] if bd <= 128 else 32
            fw = T["fwd_warps"] if bd <= 64 else 8
            if bd <= T["kv_small_d"]:
                kbn, kbm, kw = T["kv_block_n"], T["kv_block_m"], T["kv_warps"]
            else:
                kbn, kbm, kw = (64 if bd <= 128 else 32), 64, (4 if bd <= 64 else 8)
            qbm, qbn, qw = (T["dq_block_m"], T["dq_block_n"], T["dq_warps"]) if bd <= 64 else (64, 32, 8)
            dbm = T["dqr_block_m"]
            dbn = T["dqr_block_n"] if bd <= 128 else 32
            dw = T["dqr_warps"] if bd <= 64 else 8
            rbm, rbn, rw, unroll = T["red_block_m"], T["red_block_n"], T["red_warps"], T["red_unroll"]
        common = {"BLOCK_D": bd, "DOT_PREC": "ieee" if q.dtype == torch.float32 else "tf32", "UPCAST": interp}
        # A mask with one row (a key mask) is read as one vector per column block.
        mask_rows = self.has_mask and mask.shape[3] > 1
        flags = {"HAS_BIAS": self.has_bias, "HAS_MASK": self.has_mask, "MASK_ROWS": mask_rows}
        dev = q.device
        self.stream = stream_getter(dev)
        self.strides = (*q.stride(), *k.stride(), *v.stride(), *_strides5(bias), *_strides5(mask))
        self.k_strides = tuple(k.stride())
        self.fwd = Launch(_pair_attn_fwd_kernel, (self.slices, cdiv(m, fbm)),
                          {**flags, "BLOCK_M": fbm, "BLOCK_N": fbn, **common}, fw, T["fwd_stages"], dev)
        self.delta = Launch(_pair_attn_bwd_delta_kernel, (self.slices, cdiv(m, 64)), {"BLOCK_M": 64, "BLOCK_D": bd},
                            4, 1, dev)
        kmeta = {**flags, "BLOCK_M": kbm, "BLOCK_N": kbn, **common}
        kstages = T["kv_stages"] if not interp else 1
        self.kv = {s: Launch(_pair_attn_bwd_kv_kernel, (self.slices, cdiv(n, kbn)), {**kmeta, "STORE_DS": s}, kw,
                             kstages, dev) for s in (False, True)}
        self.dq_staged = Launch(_pair_attn_bwd_dq_staged_kernel, (self.slices, cdiv(m, qbm)),
                                {"BLOCK_M": qbm, "BLOCK_N": qbn, **common}, qw, T["dq_stages"], dev)
        self.dq_recompute = Launch(_pair_attn_bwd_dq_kernel, (self.slices, cdiv(m, dbm)),
                                   {**flags, "BLOCK_M": dbm, "BLOCK_N": dbn, **common}, dw, T["dqr_stages"], dev)
        self.staged_nodbias = T["dq_nodbias"] == "staged"
        if T["dq_nodbias"] not in ("staged", "recompute"):
            raise ValueError(f"pair_attention: TUNING['dq_nodbias'] must be 'staged' or 'recompute', got "
                             f"{T['dq_nodbias']!r}")
        if T["dbias_reduce"] not in ("triton", "torch"):
            raise ValueError(f"pair_attention: TUNING['dbias_reduce'] must be 'triton' or 'torch', got "
                             f"{T['dbias_reduce']!r}")
        self.ds_dtype = q.dtype
        if self.has_bias:
            full = (z1, z2, h)
            bsz = tuple(bias.shape)
            self.bias_shape = bsz
            self.kept = tuple(bsz[:3])
            # A dim is summed when the bias is broadcast over it (size 1, full size > 1).
            self.red = tuple(f if b == 1 else 1 for b, f in zip(bsz[:3], full))
            self.red_dims = tuple(i for i, r in enumerate(self.red) if r > 1)
            self.reduce_r = self.red[0] * self.red[1] * self.red[2]
            self.sum_dims = tuple(i for i, (b, f) in enumerate(zip(bsz[3:], (m, n)), start=3) if b == 1 and f > 1)
            self.db_dtype = torch.float32 if self.sum_dims else bias.dtype
            # dS goes straight into the bias gradient when nothing is reduced over slices and the gradient's
            # dtype is the one dQ's matmul reads anyway (or wider).
            self.db_is_ds = self.reduce_r == 1 and (self.db_dtype == q.dtype or self.db_dtype == torch.float32)
            if self.db_is_ds:
                self.ds_dtype = self.db_dtype
            self.torch_reduce = T["dbias_reduce"] == "torch"
            kept = self.kept[0] * self.kept[1] * self.kept[2]
            self.reduce = Launch(_pair_attn_bwd_dbias_reduce_kernel, (kept, cdiv(m, rbm), cdiv(n, rbn)),
                                 {"BLOCK_M": rbm, "BLOCK_N": rbn, "UNROLL": unroll}, rw, 1, dev)
            self.rscalars = (z2, h, m, n, self.kept[1], self.kept[2], self.red[1], self.red[2], self.reduce_r)
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
        dev = self.device
        do = do.contiguous()
        stream = self.stream()
        delta = torch.empty((self.slices, m), device=dev, dtype=torch.float32)
        self.delta(stream, aligned_16(o, do), o, do, delta, m, d)
        dq = torch.empty_like(o)
        dk = torch.empty((z1, z2, h, n, d), device=dev, dtype=self.dtype)
        dv = torch.empty_like(dk)
        b = q if bias is None else bias
        mk = q if mask is None else mask
        need_dbias = need_dbias and self.has_bias
        staged = need_dbias or self.staged_nodbias
        ds = torch.empty((z1, z2, h, m, n), device=dev, dtype=self.ds_dtype) if staged else dk
        aligned = aligned_16(q, k, v, b, mk, do, dq, dk, dv, ds)
        self.kv[staged](stream, aligned, q, k, v, b, mk, do, lse, delta, dk, dv, ds, *self.strides, *self.bscalars)
        if staged:
            self.dq_staged(stream, aligned, k, ds, dq, *self.k_strides, z2, h, m, n, d, self.scale)
        else:
            self.dq_recompute(stream, aligned, q, k, v, b, mk, do, lse, delta, dq, *self.strides, *self.bscalars)
        db = None
        if need_dbias:
            if self.db_is_ds:
                db = ds
            elif self.torch_reduce:
                # torch.sum accumulates half types in fp32; an fp32 result is only needed for a later sum.
                wide = torch.float32 if self.db_dtype == torch.float32 else None
                db = ds.sum(self.red_dims, keepdim=True, dtype=wide) if self.red_dims else ds
            else:
                db = torch.empty((*self.kept, m, n), device=dev, dtype=self.db_dtype)
                self.reduce(stream, aligned and aligned_16(db), ds, db, *self.rscalars)
            if self.sum_dims:
                db = db.sum(self.sum_dims, keepdim=True)
            if db.dtype != bias.dtype:
                db = db.to(bias.dtype)
        return dq, dk, dv, db
