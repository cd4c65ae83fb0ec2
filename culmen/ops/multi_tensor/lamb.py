"""LAMB over tensor lists: Apex's ``multi_tensor_lamb``, ``_lamb_mp`` and ``_lamb_stage1_cuda`` / ``_stage2_cuda``.

LAMB scales each tensor's Adam update by the trust ratio ``||p|| / ||update||``, so the per-tensor
norms of the parameters and of the updates are needed between computing the update and applying it.
``multi_tensor_lamb(_mp)`` does it in three launches per group, whatever the number of tensors, with
no host sync:

1. **stage 1**, one program per chunk: ``g' = g * inv_scale / clip`` where ``clip = ||g||_global /
   max_grad_norm`` if the global norm exceeds ``max_grad_norm`` (else 1); the Adam moments
   ``m = beta1 m + beta3 g'``, ``v = beta2 v + (1-beta2) g'^2`` (mode 0 first adds ``wd p`` to ``g'``);
   ``u = (m / bc1) / (sqrt(v / bc2) + eps)`` (mode 1 then adds ``wd p``). Like Apex, ``u`` is written
   over the gradient (in the gradient's dtype). The program also writes its chunk's sums of ``p^2``
   and ``u^2`` (``u`` as stored);
2. **finalize**, one program per tensor: sums its chunks in a fixed order (deterministic) into
   ``||p||`` and ``||u||``;
3. **stage 2**, one program per chunk: ``p -= ratio u`` with ``ratio = lr ||p|| / ||u||`` when both
   norms are non-zero and (``use_nvlamb`` or ``weight_decay != 0``), else ``lr``; with five lists the
   fp32 masters are updated and copied into the 16-bit model params.

``bc1 = 1 - beta1^step``, ``bc2 = 1 - beta2^step`` (1 without bias correction), ``beta3 = 1 - beta1``
with grad averaging (else 1). The parameter norm is read only where the trust ratio needs it.

Unlike Apex, whose non-``_mp`` LAMB kernels ignore the noop flag, every kernel here does nothing while
it (or ``found_inf`` for ``_mp``) is set.

Rounding: the element-wise math rounds exactly as the PyTorch LAMB that Apex tests against does on
CUDA (torch ops are IEEE, and torch fuses ``a + s * b`` inside one kernel into an fma), so fp32 results
agree bit for bit but for the trust ratio's norms. Per element, with ``fma(a, b, c) = a * b + c``
rounded once::

    g = g * cr                       cr = (1 / G) * max_norm if G > max_norm else 1  (G*: fp32 rounded)
    m = fma(beta3, g, m * beta1)     v = fma(1 - beta2, g * g, v * beta2)
    u = (m * (1 / bc1)) / (sqrt(v * (1 / bc2)) + eps)       u = fma(wd, p, u) (mode 1)
    p = fma(-lr * (||p|| / ||u||), u, p)

``beta3 = 1 - beta1``, ``1 - beta2`` and ``bc = 1 - beta^step`` are computed in double (on the host,
or in fp64 from the double betas for a device step) and rounded to fp32, as torch rounds Python
scalars; divisions and square roots are the correctly rounded ``div_rn`` / ``sqrt_rn``. The norms are
fp64 sums of squares, rounded once to fp32, so they are within an ulp of any accurate fp32 norm
(PyTorch's fp32 ``sum`` has its own, unreproducible, order). Apex's CUDA kernels divide by ``G`` and
``bc`` and take ``1 - beta2`` in fp32 instead: the same values to within an ulp or two.
"""

from __future__ import annotations

import struct

import torch

from culmen.ops.backend import device_guard
from culmen.ops.common.launch import PlanTuning
from culmen.ops.common.plans import clear_plans
from culmen.ops.multi_tensor.common import (
    TL_DTYPE,
    ListPlan,
    cached_plan,
    check_chunk,
    finish,
    noop_pointer,
    ref_skip,
    scalar_f32,
    signature,
    triton,
)

if triton is not None:
    import triton.language as tl

    from culmen.ops.multi_tensor.common import block_offsets, chunk_coords, load_f32, store, tensor_ptr

TUNING = PlanTuning({"chunk": 8192, "block": 1024, "num_warps": 4, "final_block": 1024}, clear_plans)

LAMB_MODE_L2, LAMB_MODE_DECOUPLED = 0, 1

if triton is not None:

    @triton.jit
    def _s1_range(gp, pp, mp, vp, up, start, n, b1, b2, b3, omb2, eps, rc1, rc2, wd, cr, inv, accp, accu,
                  MODE: tl.constexpr, HAS_WD: tl.constexpr, NEED_P: tl.constexpr, NORMS: tl.constexpr,
                  INV: tl.constexpr, MASKED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        # Rounding follows torch's CUDA ops in the order PyTorch LAMB references write them (module
        # docstring, "Rounding"): every fp32 op rounds once; each ``a + s * b`` that torch computes in one
        # kernel (``add_(b, alpha=s)``, ``addcmul_``) is an explicit fma, nothing else may be contracted.
        for i in range(0, CHUNK, BLOCK):
            offs = block_offsets(start, i, BLOCK)
            g = load_f32(gp, offs, n, MASKED)
            if INV:
                g = g * inv
            g = g * cr
            if NEED_P:
                p = load_f32(pp, offs, n, MASKED)
            m = load_f32(mp, offs, n, MASKED)
            v = load_f32(vp, offs, n, MASKED)
            if MODE == 0:
                if HAS_WD:
                    g = tl.fma(wd, p, g)
            m = tl.fma(b3, g, m * b1)
            v = tl.fma(omb2, g * g, v * b2)
            u = tl.div_rn(m * rc1, tl.sqrt_rn(v * rc2) + eps)
            if MODE == 1:
                if HAS_WD:
                    u = tl.fma(wd, p, u)
            store(mp, offs, n, m, MASKED)
            store(vp, offs, n, v, MASKED)
            store(up, offs, n, u, MASKED)
            if NORMS:
                # fp64 sums of squares: the trust ratio then differs from an exact one by its last rounding only
                us = u.to(up.dtype.element_ty).to(tl.float64)  # the norm of the update as stored
                accu += us * us
                if NEED_P:
                    p64 = p.to(tl.float64)
                    accp += p64 * p64
        return accp, accu

    @triton.jit
    def _pow_int(b, e):
        # b ** e for an fp64 b and an int32 e >= 0 by binary powering: fp64 multiplies only (no libdevice),
        # a relative error of a few fp64 ulps, far below the fp32 rounding of 1 - b ** e.
        r = tl.full((), 1.0, tl.float64)
        for _ in range(31):
            r = tl.where((e & 1) != 0, r * b, r)
            b = b * b
            e = e >> 1
        return r

    @triton.jit(do_not_specialize=["T", "C", "poff"])
    def _lamb_stage1_kernel(ptrs, geo, noop, found, partial, gnorm, maxn_ptr, step_ptr, inv_ptr, decay_ptr, idx, T, C,
                            poff, b1, b2, b3, omb2, eps, bc1, bc2, wd, maxn, inv, b1lo, b2lo,
                            G_DT: tl.constexpr, P_DT: tl.constexpr, M_DT: tl.constexpr, V_DT: tl.constexpr,
                            U_DT: tl.constexpr, L: tl.constexpr, U_IDX: tl.constexpr, MODE: tl.constexpr,
                            HAS_WD: tl.constexpr, WD_T: tl.constexpr, NEED_P: tl.constexpr, NORMS: tl.constexpr,
                            FOUND: tl.constexpr, MAXN_T: tl.constexpr, STEP_T: tl.constexpr, INV: tl.constexpr,
                            UNSCALE_SKIPPED: tl.constexpr, IDX: tl.constexpr, SHIFT: tl.constexpr,
                            CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        c = tl.program_id(0)
        accp = tl.zeros([BLOCK], dtype=tl.float64)
        accu = tl.zeros([BLOCK], dtype=tl.float64)
        go = tl.load(noop) == 0
        if FOUND:
            go = go & (tl.load(found).to(tl.float32) == 0.0)
        if go:
            t, j, n = chunk_coords(geo, T, C)
            gp = tensor_ptr(ptrs, T, t, 0, G_DT, SHIFT)
            pp = tensor_ptr(ptrs, T, t, 1, P_DT, SHIFT)
            mp = tensor_ptr(ptrs, T, t, 2, M_DT, SHIFT)
            vp = tensor_ptr(ptrs, T, t, 3, V_DT, SHIFT)
            up = tensor_ptr(ptrs, T, t, U_IDX, U_DT, SHIFT)
            if WD_T:
                pos = t
                if IDX:
                    pos = tl.load(idx + t)
                wd = tl.load(decay_ptr + pos).to(tl.float32)
            if MAXN_T:
                maxn = tl.load(maxn_ptr).to(tl.float32)
            if STEP_T:
                # 1 - beta^step in fp64 from the host's double beta (hi + lo fp32 parts), rounded once to fp32:
                # the value the host computes for a host step (``1.0 - beta ** step`` passed as fp32).
                s = tl.load(step_ptr).to(tl.int32)
                bc1 = (1.0 - _pow_int(tl.cast(b1, tl.float64) + tl.cast(b1lo, tl.float64), s)).to(tl.float32)
                bc2 = (1.0 - _pow_int(tl.cast(b2, tl.float64) + tl.cast(b2lo, tl.float64), s)).to(tl.float32)
            # torch divides by a host scalar as a multiply by its fp32 reciprocal
            rc1 = tl.div_rn(1.0, bc1)
            rc2 = tl.div_rn(1.0, bc2)
            if INV:
                inv = tl.load(inv_ptr).to(tl.float32)
            gg = tl.load(gnorm).to(tl.float32)
            # clip ratio max_norm / G as torch writes it (``max_norm / G`` = ``G.reciprocal() * max_norm``)
            cr = tl.where(gg > maxn, tl.div_rn(1.0, gg) * maxn, 1.0)
            start = j * CHUNK
            if start + CHUNK <= n:
                accp, accu = _s1_range(gp, pp, mp, vp, up, start, n, b1, b2, b3, omb2, eps, rc1, rc2, wd, cr, inv,
                                       accp, accu, MODE, HAS_WD, NEED_P, NORMS, INV, False, CHUNK, BLOCK)
            else:
                accp, accu = _s1_range(gp, pp, mp, vp, up, start, n, b1, b2, b3, omb2, eps, rc1, rc2, wd, cr, inv,
                                       accp, accu, MODE, HAS_WD, NEED_P, NORMS, INV, True, CHUNK, BLOCK)
        elif UNSCALE_SKIPPED:
            # A skipped step leaves the gradients unscaled (not overwritten by updates), as torch's
            # GradScaler.unscale_ would have left them (the fused LAMB optimizers' GradScaler contract).
            t, j, n = chunk_coords(geo, T, C)
            gp = tensor_ptr(ptrs, T, t, 0, G_DT, SHIFT)
            inv = tl.load(inv_ptr).to(tl.float32)
            start = j * CHUNK
            for i in range(0, CHUNK, BLOCK):
                offs = block_offsets(start, i, BLOCK)
                store(gp, offs, n, load_f32(gp, offs, n, True) * inv, True)
        if NORMS:
            tl.store(partial + poff + c, tl.sum(accp, axis=0))
            tl.store(partial + poff + C + c, tl.sum(accu, axis=0))

    @triton.jit(do_not_specialize=["T", "C", "poff"])
    def _lamb_finalize_kernel(norms, geo, T, C, poff, BLOCK: tl.constexpr):
        # Program t sums the chunks of tensor t in order: norms[t] = ||p_t||, norms[T + t] = ||u_t||.
        t = tl.program_id(0)
        first = geo + T
        partial = norms + poff
        lo = tl.load(first + t)
        hi = tl.load(first + t + 1)
        accp = tl.zeros([BLOCK], dtype=tl.float64)
        accu = tl.zeros([BLOCK], dtype=tl.float64)
        for i in range(lo, hi, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            mask = offs < hi
            accp += tl.load(partial + offs, mask=mask, other=0.0)
            accu += tl.load(partial + C + offs, mask=mask, other=0.0)
        # fp64 sqrt (IEEE for fp64) rounded to fp32: the correctly rounded norm of the fp64 sum; stage 2 reads fp32
        tl.store(norms + t, tl.sqrt(tl.sum(accp, axis=0)).to(tl.float32).to(tl.float64))
        tl.store(norms + T + t, tl.sqrt(tl.sum(accu, axis=0)).to(tl.float32).to(tl.float64))

    @triton.jit
    def _s2_range(up, pp, op, start, n, ratio, HAS_OUT: tl.constexpr, MASKED: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK: tl.constexpr):
        for i in range(0, CHUNK, BLOCK):
            offs = block_offsets(start, i, BLOCK)
            u = load_f32(up, offs, n, MASKED)
            p = load_f32(pp, offs, n, MASKED)
            p = tl.fma(-ratio, u, p)  # torch's p.add_(u, alpha=-ratio), one kernel: one fma
            store(pp, offs, n, p, MASKED)
            if HAS_OUT:
                store(op, offs, n, p, MASKED)

    @triton.jit(do_not_specialize=["T", "C", "uoff"])
    def _lamb_stage2_kernel(ptrs, geo, noop, found, pn_ptr, un_ptr, lr_ptr, idx, T, C, uoff, lr,
                            U_DT: tl.constexpr, P_DT: tl.constexpr, O_DT: tl.constexpr, L: tl.constexpr,
                            U_IDX: tl.constexpr, P_IDX: tl.constexpr, HAS_OUT: tl.constexpr, TRUST: tl.constexpr,
                            LR_T: tl.constexpr, FOUND: tl.constexpr, IDX: tl.constexpr, SHIFT: tl.constexpr,
                            CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        go = tl.load(noop) == 0
        if FOUND:
            go = go & (tl.load(found).to(tl.float32) == 0.0)
        if go:
            t, j, n = chunk_coords(geo, T, C)
            up = tensor_ptr(ptrs, T, t, U_IDX, U_DT, SHIFT)
            pp = tensor_ptr(ptrs, T, t, P_IDX, P_DT, SHIFT)
            op = pp
            if HAS_OUT:
                op = tensor_ptr(ptrs, T, t, 4, O_DT, SHIFT)
            if LR_T:
                lr = tl.load(lr_ptr).to(tl.float32)
            ratio = lr
            if TRUST:
                pos = t
                if IDX:
                    pos = tl.load(idx + t)
                pn = tl.load(pn_ptr + pos).to(tl.float32)
                un = tl.load(un_ptr + uoff + pos).to(tl.float32)
                ratio = tl.where((pn != 0.0) & (un != 0.0), lr * tl.div_rn(pn, un), lr)
            start = j * CHUNK
            if start + CHUNK <= n:
                _s2_range(up, pp, op, start, n, ratio, HAS_OUT, False, CHUNK, BLOCK)
            else:
                _s2_range(up, pp, op, start, n, ratio, HAS_OUT, True, CHUNK, BLOCK)


# --------------------------------------------------------------------------------------------------
# references


def _clip_ratio(global_grad_norm, max_grad_norm, device) -> torch.Tensor:
    """0-dim fp32 factor of the gradients: ``(1 / G) * max_norm`` (torch's ``max_norm / G``) when ``G > max_norm``."""
    gg = scalar_f32(global_grad_norm, device)
    mx = scalar_f32(max_grad_norm, device)
    return torch.where(gg > mx, torch.reciprocal(gg) * mx, torch.ones_like(gg))


def _lamb_bias_corrections(beta1: float, beta2: float, step, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``1 - beta^step`` in double (host step: on the host; device step: on the device), rounded to fp32."""
    if isinstance(step, torch.Tensor):
        s = step.reshape(-1)[0].to(device=device, dtype=torch.float64)
        b = torch.tensor([beta1, beta2], dtype=torch.float64, device=device)
        bc = (1.0 - torch.pow(b, s)).float()
        return bc[0], bc[1]
    return scalar_f32(1.0 - beta1 ** step, device), scalar_f32(1.0 - beta2 ** step, device)


def _norm_f32(x: torch.Tensor) -> torch.Tensor:
    """The L2 norm of ``x`` summed in fp64 and rounded to fp32 (as the kernels compute the trust-ratio norms)."""
    return torch.linalg.vector_norm(x.double()).float()


def _put(dst: torch.Tensor, val: torch.Tensor, skip: torch.Tensor) -> None:
    dst.copy_(torch.where(skip, dst, val.to(dst.dtype)))


def lamb_ref(tensor_lists, *, lr, beta1, beta2, eps, step, bias_correction, weight_decay, grad_averaging, mode,
             global_grad_norm, max_grad_norm, use_nvlamb, noop_flag, found_inf=None, inv_scale=None,
             unscale_skipped: bool = False) -> None:
    """Reference of :func:`lamb_update` (fp32 math, one tensor at a time, no host sync on device flags)."""
    beta3 = 1.0 - beta1 if grad_averaging else 1.0
    outs = tensor_lists[4] if len(tensor_lists) == 5 else [None] * len(tensor_lists[0])
    trust = bool(use_nvlamb) or weight_decay != 0
    for g, p, m, v, out in zip(*tensor_lists[:4], outs):
        dev = p.device
        skip = ref_skip(noop_flag, dev, found_inf)
        if bias_correction:
            bc1, bc2 = _lamb_bias_corrections(beta1, beta2, step, dev)
        else:
            bc1 = bc2 = scalar_f32(1.0, dev)
        gf = g.float()
        if inv_scale is not None:
            gf = gf * scalar_f32(inv_scale, dev)
        gf = gf * _clip_ratio(global_grad_norm, max_grad_norm, dev)
        pf, mf, vf = p.float(), m.float(), v.float()
        # the kernels' op order (module docstring, "Rounding")
        if mode == LAMB_MODE_L2 and weight_decay != 0:
            gf = torch.add(gf, pf, alpha=weight_decay)
        mf = torch.add(mf * beta1, gf, alpha=beta3)
        vf = torch.addcmul(vf * beta2, gf, gf, value=1.0 - beta2)
        u = (mf * torch.reciprocal(bc1)) / (torch.sqrt(vf * torch.reciprocal(bc2)) + eps)
        if mode == LAMB_MODE_DECOUPLED and weight_decay != 0:
            u = torch.add(u, pf, alpha=weight_decay)
        u = u.to(g.dtype).float()  # stored over the gradient, then read back
        lr_t = scalar_f32(lr, dev)
        ratio = lr_t
        if trust:
            pn, un = _norm_f32(pf), _norm_f32(u)
            ratio = torch.where((pn != 0) & (un != 0), lr_t * (pn / un), lr_t)
        pf = pf - ratio * u
        if unscale_skipped and inv_scale is not None:  # a skipped step leaves the unscaled gradient
            g.copy_(torch.where(skip, (g.float() * scalar_f32(inv_scale, dev)).to(g.dtype), u.to(g.dtype)))
            g = None
        for dst, val in ((m, mf), (v, vf), (g, u), (p, pf), (out, pf)):
            if dst is not None:
                _put(dst, val, skip)


def multi_tensor_lamb_stage1_ref(chunk_size, noop_flag, tensor_lists, per_tensor_decay, step, beta1, beta2,
                                 epsilon, global_grad_norm, max_global_grad_norm) -> None:
    """Reference of :func:`multi_tensor_lamb_stage1_cuda`."""
    for i, (g, p, m, v, u) in enumerate(zip(*tensor_lists)):
        dev = p.device
        skip = ref_skip(noop_flag, dev)
        bc1, bc2 = scalar_f32(1.0 - beta1 ** (step + 1), dev), scalar_f32(1.0 - beta2 ** (step + 1), dev)
        gf = g.float() * _clip_ratio(global_grad_norm, max_global_grad_norm, dev)
        pf, mf, vf = p.float(), m.float(), v.float()
        mf = torch.add(mf * beta1, gf, alpha=1.0 - beta1)
        vf = torch.addcmul(vf * beta2, gf, gf, value=1.0 - beta2)
        uf = (mf * torch.reciprocal(bc1)) / (torch.sqrt(vf * torch.reciprocal(bc2)) + epsilon)
        uf = uf + per_tensor_decay[i].to(dev).float() * pf
        for dst, val in ((m, mf), (v, vf), (u, uf)):
            _put(dst, val, skip)


def multi_tensor_lamb_stage2_ref(chunk_size, noop_flag, tensor_lists, per_tensor_param_norm, per_tensor_update_norm,
                                 lr, weight_decay, use_nvlamb=None) -> None:
    """Reference of :func:`multi_tensor_lamb_stage2_cuda`."""
    trust = bool(use_nvlamb) or weight_decay != 0
    for i, (p, u) in enumerate(zip(*tensor_lists)):
        dev = p.device
        skip = ref_skip(noop_flag, dev)
        lr_t = scalar_f32(lr, dev)
        ratio = lr_t
        if trust:
            pn, un = per_tensor_param_norm[i].to(dev).float(), per_tensor_update_norm[i].to(dev).float()
            ratio = torch.where((pn != 0) & (un != 0), lr_t * (pn / un), lr_t)
        _put(p, p.float() - ratio * u.float(), skip)


# --------------------------------------------------------------------------------------------------
# launchers


def _f32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value (as a Python float)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _flag_on(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return x if x.device == device else x.to(device)


def _tensor_arg(name: str, x, op: str) -> None:
    if not isinstance(x, torch.Tensor) or x.numel() < 1:
        raise TypeError(f"{op}: {name} must be a tensor with at least one element, got {type(x).__name__}")


def _dtype(x):
    return x.dtype if isinstance(x, torch.Tensor) else None


class LambPlan(ListPlan):
    """``lamb_update``'s plan: ``[g, p, m, v(, p_model)]``, one variant (see ``lamb_update``)."""

    def __init__(self, op: str, tensor_lists, noop_flag, global_grad_norm, *, mode: int, has_wd: bool, trust: bool,
                 found: bool, maxn_t: bool, step_t: bool, inv: bool, lr_t: bool, static: tuple[int, ...] = (),
                 unscale_skipped: bool = False):
        noop_pointer(noop_flag, op)
        if mode not in (0, 1):
            raise ValueError(f"{op}: mode must be 0 (L2) or 1 (decoupled weight decay), got {mode!r}")
        _tensor_arg("global_grad_norm", global_grad_norm, op)
        self.mode, self.has_wd, self.trust, self.found = int(mode), bool(has_wd), bool(trust), bool(found)
        self.maxn_t, self.step_t, self.inv, self.lr_t = maxn_t, step_t, inv, lr_t
        self.unscale_skipped = bool(unscale_skipped) and bool(inv)
        self.chunk, self.num_warps, self.block = TUNING["chunk"], TUNING["num_warps"], TUNING["block"]
        self.final_block = TUNING["final_block"]
        super().__init__(op, tensor_lists, (4, 5), tuple(range(len(tensor_lists))), static)

    def meta(self, g, kernel, variant) -> dict:
        dts = [TL_DTYPE[d] for d in g.dtypes]
        L = self.num_lists
        if kernel is _lamb_stage1_kernel:
            return dict(G_DT=dts[0], P_DT=dts[1], M_DT=dts[2], V_DT=dts[3], U_DT=dts[0], L=L, U_IDX=0, MODE=self.mode,
                        HAS_WD=self.has_wd, WD_T=False, NEED_P=self.trust, NORMS=self.trust, FOUND=self.found,
                        MAXN_T=self.maxn_t, STEP_T=self.step_t, INV=self.inv,
                        UNSCALE_SKIPPED=self.unscale_skipped, IDX=False, CHUNK=self.chunk, BLOCK=self.block)
        if kernel is _lamb_finalize_kernel:
            return dict(BLOCK=self.final_block)
        return dict(U_DT=dts[0], P_DT=dts[1], O_DT=dts[4] if L == 5 else dts[1], L=L, U_IDX=0, P_IDX=1,
                    HAS_OUT=L == 5, TRUST=self.trust, LR_T=self.lr_t, FOUND=self.found, IDX=False, CHUNK=self.chunk,
                    BLOCK=self.block)

    def run(self, tabs, noop, found, gnorm, lr, step, maxn, inv, b1: float, b2: float, b3: float, eps: float,
            wd: float, bias_correction: bool, only: int | None = None) -> None:
        """Three launches per group (or group ``only``): stage 1, per-tensor norms, stage 2. Tensor arguments
        must be on the groups' device (``lamb_update`` moves them for multi-device lists)."""
        if bias_correction and not self.step_t:
            bc1, bc2 = 1.0 - b1 ** step, 1.0 - b2 ** step
        else:
            bc1 = bc2 = 1.0
        maxn_p = maxn if self.maxn_t else None
        step_p = step if self.step_t else None
        inv_p = inv if self.inv else None
        lr_p = lr if self.lr_t else None
        found_p = found if self.found else None
        bits = noop.data_ptr() | gnorm.data_ptr()
        for t in (maxn_p, step_p, inv_p, lr_p, found_p):
            if t is not None:
                bits |= t.data_ptr()
        aligned = bits & 15 == 0
        b1lo = b2lo = 0.0
        if self.step_t:  # the kernel rebuilds the double betas from these (fp32 hi + lo parts)
            b1lo, b2lo = b1 - _f32(b1), b2 - _f32(b2)
        s1 = (b1, b2, b3, 1.0 - b2, eps, bc1, bc2, wd, 0.0 if self.maxn_t else float(maxn), 1.0, b1lo, b2lo)
        lr_f = 0.0 if self.lr_t else float(lr)
        groups = self.tables.groups
        for i in range(len(groups)) if only is None else (only,):
            g = groups[i]
            if not g.C:
                continue
            ptab, shift, _ = tabs[i]
            T, C = g.T, g.C
            stream = g.stream()
            buf = None
            if self.trust:  # [||p|| T | ||u|| T | partial sums 2C], fp64 (the norms hold fp32 values)
                with device_guard(g.device):
                    buf = torch.empty(2 * T + 2 * C, dtype=torch.float64, device=g.device)
            self.launch(i, _lamb_stage1_kernel, shift)(stream, aligned, ptab, g.geo, noop, found_p, buf, gnorm, maxn_p,
                                                       step_p, inv_p, None, None, T, C, 2 * T, *s1)
            if self.trust:
                self.launch(i, _lamb_finalize_kernel, None, grid=(T,), num_warps=4)(stream, True, buf, g.geo, T, C,
                                                                                     2 * T)
            self.launch(i, _lamb_stage2_kernel, shift)(stream, aligned, ptab, g.geo, noop, found_p, buf, buf, lr_p,
                                                       None, T, C, T, lr_f)


def lamb_update(tensor_lists, *, lr, beta1: float, beta2: float, eps: float, step, bias_correction: bool,
                weight_decay: float, grad_averaging: bool, mode: int, global_grad_norm: torch.Tensor, max_grad_norm,
                use_nvlamb: bool, noop_flag: torch.Tensor, found_inf=None, inv_scale=None,
                unscale_skipped: bool = False, op: str = "lamb_update") -> None:
    """One LAMB step over ``[g, p, m, v(, p_model)]`` in three launches per group (module docstring).

    ``lr``, ``step``, ``max_grad_norm`` and ``inv_scale`` are numbers or 1-element device tensors;
    ``global_grad_norm`` a 1-element device tensor. The gradients are overwritten with the updates.
    With five lists, ``p`` are fp32 masters and ``p_model`` receives their new values. ``unscale_skipped``:
    a skipped step multiplies the gradients by ``inv_scale`` (the optimizers' GradScaler contract).
    """
    trust = bool(use_nvlamb) or weight_decay != 0
    step_t = isinstance(step, torch.Tensor) and bool(bias_correction)
    variant = dict(mode=mode, has_wd=weight_decay != 0, trust=trust, found=found_inf is not None,
                   maxn_t=isinstance(max_grad_norm, torch.Tensor), step_t=step_t, inv=inv_scale is not None,
                   lr_t=isinstance(lr, torch.Tensor), unscale_skipped=bool(unscale_skipped) and inv_scale is not None)
    try:
        flat, sig = signature(tensor_lists)
        key = ("lamb", op, tuple(variant.values()), noop_flag.dtype, noop_flag.device, global_grad_norm.dtype,
               _dtype(lr), _dtype(step), _dtype(max_grad_norm), _dtype(found_inf), _dtype(inv_scale), sig)
    except (TypeError, AttributeError, IndexError):
        flat, key = None, None
    plan = cached_plan(key, lambda: LambPlan(op, tensor_lists, noop_flag, global_grad_norm, **variant))
    if not plan.n:
        return
    if not plan.use_kernel:
        return lamb_ref(tensor_lists, lr=lr, beta1=beta1, beta2=beta2, eps=eps, step=step,
                        bias_correction=bias_correction, weight_decay=weight_decay, grad_averaging=grad_averaging,
                        mode=mode, global_grad_norm=global_grad_norm, max_grad_norm=max_grad_norm,
                        use_nvlamb=use_nvlamb, noop_flag=noop_flag, found_inf=found_inf, inv_scale=inv_scale,
                        unscale_skipped=variant["unscale_skipped"])
    tabs, copy_back = plan.pointers(tensor_lists, flat)
    beta3 = 1.0 - beta1 if grad_averaging else 1.0
    scal = (float(beta1), float(beta2), float(beta3), float(eps), float(weight_decay), bool(bias_correction))
    if inv_scale is not None and not isinstance(inv_scale, torch.Tensor):
        inv_scale = torch.full((1,), float(inv_scale), dtype=torch.float32, device=noop_flag.device)
    args = (noop_flag, found_inf, global_grad_norm, lr, step, max_grad_norm, inv_scale)
    dev = noop_flag.device
    if plan.single_group(dev) and all(not isinstance(x, torch.Tensor) or x.device == dev for x in args):
        plan.run(tabs, *args, *scal)
    else:  # several devices: each group gets its own copies of the device arguments
        for i, g in enumerate(plan.tables.groups):
            moved = tuple(_flag_on(x, g.device) if isinstance(x, torch.Tensor) else x for x in args)
            plan.run(tabs, *moved, *scal, only=i)
    finish(copy_back)


def multi_tensor_lamb(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float, beta1: float, beta2: float,
                      epsilon: float, step: int, bias_correction: int, weight_decay: float, grad_averaging: int,
                      mode: int, global_grad_norm: torch.Tensor, max_grad_norm: float,
                      use_nvlamb: bool | None = None) -> None:
    """Apex ``amp_C.multi_tensor_lamb``: ``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]``.

    ``global_grad_norm``: 1-element device tensor (the norm of all gradients, for clipping to
    ``max_grad_norm``). The gradients are overwritten with the LAMB updates, as in Apex.
    """
    if torch.compiler.is_compiling():
        from culmen.ops.multi_tensor.library import amp_c_update

        return amp_c_update("multi_tensor_lamb", noop_flag, tensor_lists, (
            lr, beta1, beta2, epsilon, step, bias_correction, weight_decay, grad_averaging, mode, global_grad_norm,
            max_grad_norm, use_nvlamb,
        ))
    op = "multi_tensor_lamb"
    check_chunk(chunk_size, op)
    if len(tensor_lists) != 4:
        raise ValueError(f"{op}: expected 4 tensor lists, got {len(tensor_lists)}")
    lamb_update(tensor_lists, lr=lr, beta1=beta1, beta2=beta2, eps=epsilon, step=step,
                bias_correction=bool(bias_correction), weight_decay=weight_decay, grad_averaging=bool(grad_averaging),
                mode=mode, global_grad_norm=global_grad_norm, max_grad_norm=max_grad_norm,
                use_nvlamb=bool(use_nvlamb), noop_flag=noop_flag, op=op)


def multi_tensor_lamb_mp(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: torch.Tensor, beta1: float,
                         beta2: float, epsilon: float, step: torch.Tensor, bias_correction: int, weight_decay: float,
                         grad_averaging: int, mode: int, global_grad_norm: torch.Tensor, max_grad_norm: torch.Tensor,
                         use_nvlamb: bool | None, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Apex ``amp_C.multi_tensor_lamb_mp`` (``FusedMixedPrecisionLamb``).

    ``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]`` or ``[grads, fp32 master params, exp_avgs,
    exp_avg_sqs, 16-bit model params]``. ``lr``, ``step`` (int), ``global_grad_norm``, ``max_grad_norm``,
    ``found_inf`` and ``inv_scale`` are 1-element device tensors (no host sync): gradients are
    multiplied by ``inv_scale`` and the step is skipped where ``noop_flag`` or ``found_inf`` is set.
    """
    if torch.compiler.is_compiling():
        from culmen.ops.multi_tensor.library import amp_c_update

        return amp_c_update("multi_tensor_lamb_mp", noop_flag, tensor_lists, (
            lr, beta1, beta2, epsilon, step, bias_correction, weight_decay, grad_averaging, mode, global_grad_norm,
            max_grad_norm, use_nvlamb, found_inf, inv_scale,
        ))
    op = "multi_tensor_lamb_mp"
    check_chunk(chunk_size, op)
    for name, x in (("lr", lr), ("step", step), ("max_grad_norm", max_grad_norm), ("found_inf", found_inf),
                    ("inv_scale", inv_scale)):
        _tensor_arg(name, x, op)
    lamb_update(tensor_lists, lr=lr, beta1=beta1, beta2=beta2, eps=epsilon, step=step,
                bias_correction=bool(bias_correction), weight_decay=weight_decay, grad_averaging=bool(grad_averaging),
                mode=mode, global_grad_norm=global_grad_norm, max_grad_norm=max_grad_norm,
                use_nvlamb=bool(use_nvlamb), noop_flag=noop_flag, found_inf=found_inf, inv_scale=inv_scale, op=op)


def _per_tensor_arg(name: str, x, n: int, device, op: str) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{op}: {name} must be a floating-point tensor")
    if x.numel() != n:
        raise ValueError(f"{op}: {name} has {x.numel()} elements for {n} tensors")
    if x.device != device:
        raise ValueError(f"{op}: {name} is on {x.device} but the tensors are on {device}")


class _StagePlan(ListPlan):
    """Plan of ``multi_tensor_lamb_stage1_cuda`` (``[g, p, m, v, u]``) / ``_stage2_cuda`` (``[p, u]``)."""

    def __init__(self, op: str, chunk_size, noop_flag, tensor_lists, per_tensor: tuple, stage: int,
                 trust: bool = False) -> None:
        check_chunk(chunk_size, op)
        noop_pointer(noop_flag, op)
        self.stage, self.trust = stage, trust
        self.chunk, self.num_warps, self.block = TUNING["chunk"], TUNING["num_warps"], TUNING["block"]
        super().__init__(op, tensor_lists, 5 if stage == 1 else 2, (2, 3, 4) if stage == 1 else (0,))
        if self.n:
            dev0 = tensor_lists[0][0].device
            for name, x in per_tensor:
                if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                    raise TypeError(f"{op}: {name} must be a floating-point tensor")
                if x.numel() != self.n:
                    raise ValueError(f"{op}: {name} has {x.numel()} elements for {self.n} tensors")
                if x.device != dev0:
                    raise ValueError(f"{op}: {name} is on {x.device} but the tensors are on {dev0}")

    def meta(self, g, kernel, variant) -> dict:
        dts = [TL_DTYPE[d] for d in g.dtypes]
        if self.stage == 1:
            return dict(G_DT=dts[0], P_DT=dts[1], M_DT=dts[2], V_DT=dts[3], U_DT=dts[4], L=5, U_IDX=4,
                        MODE=LAMB_MODE_DECOUPLED, HAS_WD=True, WD_T=True, NEED_P=True, NORMS=False, FOUND=False,
                        MAXN_T=False, STEP_T=False, INV=False, UNSCALE_SKIPPED=False, IDX=g.pos is not None,
                        CHUNK=self.chunk,
                        BLOCK=self.block)
        return dict(U_DT=dts[1], P_DT=dts[0], O_DT=dts[0], L=2, U_IDX=1, P_IDX=0, HAS_OUT=False, TRUST=self.trust,
                    LR_T=False, FOUND=False, IDX=g.pos is not None, CHUNK=self.chunk, BLOCK=self.block)


def _stage_plan(op, chunk_size, noop_flag, tensor_lists, per_tensor, stage, trust=False):
    try:
        flat, sig = signature(tensor_lists)
        key = (op, chunk_size, trust, noop_flag.device,
               tuple((x.dtype, x.numel(), x.device) for _, x in per_tensor), sig)
    except (TypeError, AttributeError, IndexError):
        flat, key = None, None
    return flat, cached_plan(key, lambda: _StagePlan(op, chunk_size, noop_flag, tensor_lists, per_tensor, stage,
                                                     trust))


def multi_tensor_lamb_stage1_cuda(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                                  per_tensor_decay: torch.Tensor, step: int, beta1: float, beta2: float,
                                  epsilon: float, global_grad_norm: torch.Tensor, max_global_grad_norm: float) -> None:
    """Apex ``amp_C.multi_tensor_lamb_stage1_cuda`` (first half of distributed LAMB), one launch per group.

    ``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs, updates]``; ``per_tensor_decay``: one weight
    decay per tensor (device). Writes ``m``, ``v`` and ``update = (m / bc1) / (sqrt(v / bc2) + eps) +
    decay p`` with ``m = beta1 m + (1-beta1) g'``, ``g' = g / clip`` and bias corrections for step
    ``step + 1`` (as Apex: the caller passes the number of steps already taken).
    """
    if torch.compiler.is_compiling():
        from culmen.ops.multi_tensor.library import amp_c_update

        return amp_c_update("multi_tensor_lamb_stage1_cuda", noop_flag, tensor_lists, (
            per_tensor_decay, step, beta1, beta2, epsilon, global_grad_norm, max_global_grad_norm,
        ))
    op = "multi_tensor_lamb_stage1_cuda"
    _tensor_arg("global_grad_norm", global_grad_norm, op)
    flat, plan = _stage_plan(op, chunk_size, noop_flag, tensor_lists, (("per_tensor_decay", per_tensor_decay),), 1)
    if not plan.n:
        return
    if not plan.use_kernel:
        return multi_tensor_lamb_stage1_ref(chunk_size, noop_flag, tensor_lists, per_tensor_decay, step, beta1,
                                            beta2, epsilon, global_grad_norm, max_global_grad_norm)
    bc1, bc2 = 1.0 - beta1 ** (step + 1), 1.0 - beta2 ** (step + 1)
    decay = per_tensor_decay if per_tensor_decay.is_contiguous() else per_tensor_decay.contiguous()
    tabs, copy_back = plan.pointers(tensor_lists, flat)
    for i, g in enumerate(plan.tables.groups):
        if g.C:
            ptab, shift, _ = tabs[i]
            flag = _flag_on(noop_flag, g.device)
            gnorm = _flag_on(global_grad_norm, g.device)
            aligned = (flag.data_ptr() | gnorm.data_ptr() | decay.data_ptr()) & 15 == 0
            plan.launch(i, _lamb_stage1_kernel, shift)(
                g.stream(), aligned, ptab, g.geo, flag, None, None, gnorm, None, None, None, decay, g.pos, g.T, g.C, 0,
                float(beta1), float(beta2), 1.0 - float(beta1), 1.0 - float(beta2), float(epsilon), float(bc1),
                float(bc2), 0.0, float(max_global_grad_norm), 1.0, 0.0, 0.0)
    finish(copy_back)


def multi_tensor_lamb_stage2_cuda(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                                  per_tensor_param_norm: torch.Tensor, per_tensor_update_norm: torch.Tensor,
                                  lr: float, weight_decay: float, use_nvlamb: bool | None = None) -> None:
    """Apex ``amp_C.multi_tensor_lamb_stage2_cuda``: ``p -= ratio * update`` for ``[params, updates]``.

    ``ratio = lr * ||p|| / ||update||`` (the given per-tensor norms, device tensors) when both are
    non-zero and ``use_nvlamb`` or ``weight_decay != 0``, else ``lr``. One launch per group.
    """
    if torch.compiler.is_compiling():
        from culmen.ops.multi_tensor.library import amp_c_update

        return amp_c_update("multi_tensor_lamb_stage2_cuda", noop_flag, tensor_lists, (
            per_tensor_param_norm, per_tensor_update_norm, lr, weight_decay, use_nvlamb,
        ))
    op = "multi_tensor_lamb_stage2_cuda"
    trust = bool(use_nvlamb) or weight_decay != 0
    flat, plan = _stage_plan(op, chunk_size, noop_flag, tensor_lists,
                             (("per_tensor_param_norm", per_tensor_param_norm),
                              ("per_tensor_update_norm", per_tensor_update_norm)), 2, trust)
    if not plan.n:
        return
    if not plan.use_kernel:
        return multi_tensor_lamb_stage2_ref(chunk_size, noop_flag, tensor_lists, per_tensor_param_norm,
                                            per_tensor_update_norm, lr, weight_decay, use_nvlamb)
    pn = per_tensor_param_norm.contiguous().float()
    un = per_tensor_update_norm.contiguous().float()
    tabs, copy_back = plan.pointers(tensor_lists, flat)
    for i, g in enumerate(plan.tables.groups):
        if g.C:
            ptab, shift, _ = tabs[i]
            flag = _flag_on(noop_flag, g.device)
            aligned = (flag.data_ptr() | pn.data_ptr() | un.data_ptr()) & 15 == 0
            plan.launch(i, _lamb_stage2_kernel, shift)(g.stream(), aligned, ptab, g.geo, flag, None, pn, un, None,
                                                       g.pos, g.T, g.C, 0, float(lr))
    finish(copy_back)
