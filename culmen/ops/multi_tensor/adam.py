"""Adam / AdamW over tensor lists: ``multi_tensor_adam`` and its capturable and master-weight forms.

One kernel serves every variant (constexpr switches): ``lr`` and ``step`` as host numbers or device
tensors (CUDA-graph capturable, no host sync), gradient unscaling by a host number, a device inverse
scale or a device scale (GradScaler's, divided out in the kernel), and fp32 master weights for 16-bit
params. Every update skips its work when the noop flag (int32 overflow flag, or the grad scaler's float
``found_inf``) is non-zero.

``FusedAdam`` keeps an ``AdamPlan`` per param group (``culmen.optimizers.fused_adam``); its device step
counter is advanced by the kernel itself (``STEP=2``: the last program to finish adds 1 unless the step
was skipped), so a step costs no PyTorch op besides the launch.
"""

from __future__ import annotations

import torch

from culmen.ops.common.launch import PlanTuning
from culmen.ops.common.plans import clear_plans
from culmen.ops.multi_tensor.common import (
    TL_DTYPE,
    ListPlan,
    bias_corrections,
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

TUNING = PlanTuning({"chunk": 8192, "block": 2048, "num_warps": 8}, clear_plans)

ADAM_MODE_L2, ADAM_MODE_ADAMW = 0, 1
# INV: how the gradients are unscaled. STEP: how a device step counter is read.
INV_NONE, INV_HOST, INV_DEVICE, INV_DIVIDE = 0, 1, 2, 3
STEP_AS_IS, STEP_NEXT, STEP_ADVANCE = 0, 1, 2

if triton is not None:

    @triton.jit
    def _adam_range(gp, pp, mp, vp, qp, start, n, lr, b1, b2, eps, bc1, bc2, wd, inv,
                    MODE: tl.constexpr, MASTER: tl.constexpr, REM: tl.constexpr, HAS_INV: tl.constexpr,
                    MASKED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        for i in range(0, CHUNK, BLOCK):
            offs = block_offsets(start, i, BLOCK)
            g = load_f32(gp, offs, n, MASKED)
            if HAS_INV:
                g = g * inv
                store(gp, offs, n, g, MASKED)  # the gradient is left unscaled, as GradScaler.unscale_ leaves it
            if REM:
                p = _rem_master(pp, qp, offs, n, MASKED)
            elif MASTER:
                p = load_f32(qp, offs, n, MASKED)
            else:
                p = load_f32(pp, offs, n, MASKED)
            m = load_f32(mp, offs, n, MASKED)
            v = load_f32(vp, offs, n, MASKED)
            if MODE == 0:
                g = g + wd * p
            m = b1 * m + (1.0 - b1) * g
            v = b2 * v + (1.0 - b2) * g * g
            denom = tl.sqrt_rn(tl.div_rn(v, bc2)) + eps
            upd = tl.div_rn(tl.div_rn(m, bc1), denom)
            if MODE == 1:
                upd = upd + wd * p
            p = p - lr * upd
            store(mp, offs, n, m, MASKED)
            store(vp, offs, n, v, MASKED)
            if REM:
                # bf16 param = the fp32 master's top half rounded to nearest; the int16 remainder keeps the rest
                bits = p.to(tl.int32, bitcast=True)
                hi = (bits + 0x8000) >> 16
                store(qp, offs, n, bits - (hi << 16), MASKED)
                store(pp, offs, n, hi.to(tl.int16).to(tl.bfloat16, bitcast=True), MASKED)
            else:
                if MASTER:
                    store(qp, offs, n, p, MASKED)
                store(pp, offs, n, p, MASKED)

    @triton.jit
    def _rem_master(pp, qp, offs, n, MASKED: tl.constexpr):
        """The fp32 master held as a bf16 param (top 16 bits) plus an int16 remainder (signed low part)."""
        if MASKED:
            hi = tl.load(pp + offs, mask=offs < n, other=0.0)
            r = tl.load(qp + offs, mask=offs < n, other=0)
        else:
            hi = tl.load(pp + offs)
            r = tl.load(qp + offs)
        bits = (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16) + r.to(tl.int32)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _unscale_range(gp, start, n, inv, MASKED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        for i in range(0, CHUNK, BLOCK):
            offs = block_offsets(start, i, BLOCK)
            store(gp, offs, n, load_f32(gp, offs, n, MASKED) * inv, MASKED)

    @triton.jit(do_not_specialize=["T", "C"])
    def _adam_kernel(ptrs, geo, noop, lr_ptr, step_ptr, inv_ptr, ticket, T, C, lr, b1, b2, eps, bc1, bc2, wd, inv,
                     G_DT: tl.constexpr, P_DT: tl.constexpr, M_DT: tl.constexpr, V_DT: tl.constexpr,
                     Q_DT: tl.constexpr, L: tl.constexpr, MODE: tl.constexpr, LR_T: tl.constexpr,
                     STEP_T: tl.constexpr, STEP: tl.constexpr, INV: tl.constexpr, BIAS_CORR: tl.constexpr,
                     REM: tl.constexpr, UNSCALE_SKIPPED: tl.constexpr, SHIFT: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCK: tl.constexpr):
        # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
        b1 = tl.cast(b1, tl.float32)
        b2 = tl.cast(b2, tl.float32)
        bc1 = tl.cast(bc1, tl.float32)
        bc2 = tl.cast(bc2, tl.float32)
        eps = tl.cast(eps, tl.float32)
        inv = tl.cast(inv, tl.float32)
        lr = tl.cast(lr, tl.float32)
        wd = tl.cast(wd, tl.float32)
        go = tl.load(noop) == 0
        if STEP_T:
            s = tl.load(step_ptr)
            if STEP != 0:
                s = s + 1
        if go:
            t, j, n = chunk_coords(geo, T, C)
            gp = tensor_ptr(ptrs, T, t, 0, G_DT, SHIFT)
            pp = tensor_ptr(ptrs, T, t, 1, P_DT, SHIFT)
            mp = tensor_ptr(ptrs, T, t, 2, M_DT, SHIFT)
            vp = tensor_ptr(ptrs, T, t, 3, V_DT, SHIFT)
            qp = pp
            if L == 5:
                qp = tensor_ptr(ptrs, T, t, 4, Q_DT, SHIFT)
            if LR_T:
                lr = tl.load(lr_ptr).to(tl.float32)
            if STEP_T:
                if BIAS_CORR:
                    sf = s.to(tl.float32)
                    bc1 = 1.0 - tl.exp2(sf * tl.log2(b1))
                    bc2 = 1.0 - tl.exp2(sf * tl.log2(b2))
            if INV == 2:
                inv = tl.load(inv_ptr).to(tl.float32)
            if INV == 3:
                inv = tl.div_rn(1.0, tl.load(inv_ptr).to(tl.float32))
            start = j * CHUNK
            if start + CHUNK <= n:
                _adam_range(gp, pp, mp, vp, qp, start, n, lr, b1, b2, eps, bc1, bc2, wd, inv, MODE, L == 5,
                            REM, INV != 0, False, CHUNK, BLOCK)
            else:
                _adam_range(gp, pp, mp, vp, qp, start, n, lr, b1, b2, eps, bc1, bc2, wd, inv, MODE, L == 5,
                            REM, INV != 0, True, CHUNK, BLOCK)
        elif UNSCALE_SKIPPED:
            # A skipped step (inf/NaN found) still unscales the gradients, as torch's GradScaler.unscale_ does
            # before any optimizer reads them (FusedAdam's contract; amp_C's capturable ops leave them as Apex).
            t, j, n = chunk_coords(geo, T, C)
            gp = tensor_ptr(ptrs, T, t, 0, G_DT, SHIFT)
            if INV == 2:
                inv = tl.load(inv_ptr).to(tl.float32)
            if INV == 3:
                inv = tl.div_rn(1.0, tl.load(inv_ptr).to(tl.float32))
            start = j * CHUNK
            if start + CHUNK <= n:
                _unscale_range(gp, start, n, inv, False, CHUNK, BLOCK)
            else:
                _unscale_range(gp, start, n, inv, True, CHUNK, BLOCK)
        if STEP == 2:
            # Every program read the step above; the last one to get here advances it (and re-arms the
            # ticket), so the counter moves once per launch, and only on a step that was not skipped.
            done = tl.atomic_add(ticket, 1)
            if done == C - 1:
                tl.store(ticket, 0)
                if go:
                    tl.store(step_ptr, s)


def adam_ref(tensor_lists, *, lr, beta1: float, beta2: float, eps: float, step, mode: int, bias_correction: bool,
             weight_decay: float, noop_flag: torch.Tensor, inv_scale=None, scale_divides: bool = False,
             unscale_skipped: bool = False) -> None:
    """Reference of :func:`adam_update` (fp32 math, one tensor at a time, no host sync on device flags)."""
    masters = tensor_lists[4] if len(tensor_lists) == 5 else [None] * len(tensor_lists[0])
    for g, p, m, v, q in zip(*tensor_lists[:4], masters):
        dev = p.device
        skip = ref_skip(noop_flag, dev)
        lr_t = scalar_f32(lr, dev)
        if bias_correction:
            bc1, bc2 = bias_corrections(beta1, beta2, step, dev)
        else:
            bc1 = bc2 = torch.ones((), dtype=torch.float32, device=dev)
        gf = g.float()
        if inv_scale is not None:
            inv = scalar_f32(inv_scale, dev)
            gf = gf * (torch.reciprocal(inv) if scale_divides else inv)
            # The unscaled gradient is stored back (also on a skipped step with ``unscale_skipped``).
            g.copy_(gf.to(g.dtype) if unscale_skipped else torch.where(skip, g, gf.to(g.dtype)))
        rem = q is not None and q.dtype == torch.int16
        if rem:
            pf = rem_master(p, q)
        else:
            pf = (q if q is not None else p).float()
        mf, vf = m.float(), v.float()
        if mode == ADAM_MODE_L2:
            gf = gf + weight_decay * pf
        mf = beta1 * mf + (1.0 - beta1) * gf
        vf = beta2 * vf + (1.0 - beta2) * gf * gf
        upd = (mf / bc1) / (torch.sqrt(vf / bc2) + eps)
        if mode == ADAM_MODE_ADAMW:
            upd = upd + weight_decay * pf
        pf = pf - lr_t * upd
        if rem:
            hi, low = rem_split(pf)
            pairs = ((m, mf), (v, vf), (p, hi), (q, low))
        else:
            pairs = ((m, mf), (v, vf), (p, pf), (q, pf))
        for dst, val in pairs:
            if dst is not None:
                dst.copy_(torch.where(skip, dst, val.to(dst.dtype)))


def rem_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """fp32 master from a bf16 ``param`` (its top 16 bits) and an int16 ``remainder`` (the signed rest)."""
    bits = (param.view(torch.int16).to(torch.int32) << 16) + remainder.to(torch.int32)
    return bits.view(torch.float32)


def rem_split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`rem_master`: ``(bf16 param rounded to nearest, int16 remainder)``."""
    bits = master.contiguous().view(torch.int32).to(torch.int64)
    hi = (bits + 0x8000) >> 16
    return hi.to(torch.int16).view(torch.bfloat16), (bits - (hi << 16)).to(torch.int16)


class AdamPlan(ListPlan):
    """``adam_update``'s plan for one signature and variant: ``[g, p, m, v(, p_master)]``.

    ``lr_t`` / ``step_t``: lr and step are device tensors; ``inv``: an ``INV_*`` mode; ``step_mode``: a
    ``STEP_*`` mode (the optimizer's in-kernel counter; amp_C callers pass the step already advanced).
    ``static``: lists whose addresses stay fixed (an optimizer's params and states). ``unscale_skipped``:
    a skipped step still unscales the gradients (FusedAdam under a GradScaler).
    """

    def __init__(self, op: str, tensor_lists, noop_flag, *, mode: int, lr_t: bool, step_t: bool, inv: int,
                 bias_correction: bool, step_mode: int = STEP_AS_IS, static: tuple[int, ...] = (),
                 unscale_skipped: bool = False) -> None:
        noop_pointer(noop_flag, op)
        if mode not in (0, 1):
            raise ValueError(f"{op}: mode must be 0 (Adam, L2) or 1 (AdamW), got {mode!r}")
        self.mode, self.lr_t, self.step_t, self.inv = mode, lr_t, step_t, inv
        self.bias_correction, self.step_mode = bool(bias_correction), step_mode
        self.unscale_skipped = bool(unscale_skipped) and inv != INV_NONE
        self.chunk, self.num_warps, self.block = TUNING["chunk"], TUNING["num_warps"], TUNING["block"]
        super().__init__(op, tensor_lists, (4, 5), tuple(range(1, len(tensor_lists))), static)
        self.ticket = None
        if self.use_kernel and step_mode == STEP_ADVANCE:
            self.ticket = torch.zeros(1, dtype=torch.int32, device=self.tables.groups[-1].device)

    def meta(self, g, kernel, variant) -> dict:
        dts = [TL_DTYPE[d] for d in g.dtypes]
        return dict(G_DT=dts[0], P_DT=dts[1], M_DT=dts[2], V_DT=dts[3], Q_DT=dts[4] if len(dts) == 5 else dts[1],
                    L=len(dts), MODE=self.mode, LR_T=self.lr_t, STEP_T=self.step_t, STEP=variant, INV=self.inv,
                    BIAS_CORR=self.bias_correction, REM=len(dts) == 5 and g.dtypes[4] == torch.int16,
                    UNSCALE_SKIPPED=self.unscale_skipped, CHUNK=self.chunk,
                    BLOCK=self.block)

    def run(self, tabs, noop, lr, step, inv, b1: float, b2: float, eps: float, wd: float,
            only: int | None = None) -> None:
        """Launch every group (or group ``only``): ``noop`` a flag on the groups' device, ``lr``/``step``/
        ``inv`` numbers or device tensors as the plan's variant says (``inv`` ``None`` without unscaling)."""
        lr_p = lr if self.lr_t else None
        step_p = step if self.step_t else None
        inv_p = inv if self.inv >= INV_DEVICE else None
        if self.step_t or not self.bias_correction:
            bc1 = bc2 = 1.0
        else:
            bc1, bc2 = 1.0 - b1 ** step, 1.0 - b2 ** step
        scalars = (0.0 if self.lr_t else float(lr), b1, b2, eps, bc1, bc2, wd,
                   float(inv) if self.inv == INV_HOST else 1.0)
        bits = noop.data_ptr()
        for t in (lr_p, step_p, inv_p):
            if t is not None:
                bits |= t.data_ptr()
        aligned = bits & 15 == 0
        groups = self.tables.groups
        last = len(groups) - 1
        for i in range(len(groups)) if only is None else (only,):
            g = groups[i]
            if g.C:
                ptab, shift, _ = tabs[i]
                # Only the last group advances an in-kernel step counter; the others read it as step + 1.
                mode = STEP_NEXT if self.step_mode == STEP_ADVANCE and i != last else self.step_mode
                self.launch(i, _adam_kernel, shift, variant=mode)(g.stream(), aligned, ptab, g.geo, noop, lr_p,
                                                                  step_p, inv_p, self.ticket, g.T, g.C, *scalars)


def _inv_mode(inv_scale) -> int:
    return INV_NONE if inv_scale is None else (INV_DEVICE if isinstance(inv_scale, torch.Tensor) else INV_HOST)


def adam_update(tensor_lists, *, lr, beta1: float, beta2: float, eps: float, step, mode: int,
                bias_correction: bool, weight_decay: float, noop_flag: torch.Tensor, inv_scale=None,
                unscale_skipped: bool = False, op: str = "adam_update") -> None:
    """One Adam (``mode=0``, L2) or AdamW (``mode=1``, decoupled) step over ``[g, p, m, v(, p_master)]``.

    ``lr`` and ``step`` are numbers or 1-element device tensors (capturable: no host sync), ``inv_scale``
    ``None``, a number or a device tensor multiplying the gradients. With five lists the fp32 masters
    are updated and copied into the (16-bit) params. Nothing happens where ``noop_flag`` is non-zero.
    With an int16 fifth list (bf16 params) the fp32 master is the param's bits plus that remainder
    (``store_param_remainders``), rebuilt and split again inside the kernel.
    With ``inv_scale`` the unscaled gradients are written back (as Apex's capturable kernels do); with
    ``unscale_skipped`` too when the step is skipped (torch's GradScaler contract: ``.grad`` is unscaled).
    Math in fp32: ``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g^2``;
    ``p -= lr * ((m / bc1) / (sqrt(v / bc2) + eps) + [AdamW] wd p)``.
    """
    if torch.compiler.is_compiling():
        from culmen.ops.multi_tensor.library import adam_via_op

        return adam_via_op(tensor_lists, lr=lr, beta1=beta1, beta2=beta2, eps=eps, step=step, mode=mode,
                           bias_correction=bias_correction, weight_decay=weight_decay, noop_flag=noop_flag,
                           inv_scale=inv_scale, unscale_skipped=unscale_skipped)
    lr_t, step_t, inv = isinstance(lr, torch.Tensor), isinstance(step, torch.Tensor), _inv_mode(inv_scale)
    unscale_skipped = bool(unscale_skipped)
    try:
        flat, sig = signature(tensor_lists)
        key = ("adam", op, mode, lr_t, step_t, inv, bool(bias_correction), unscale_skipped, noop_flag.dtype,
               noop_flag.device, sig)
    except (TypeError, AttributeError, IndexError):
        flat, key = None, None
    plan = cached_plan(key, lambda: AdamPlan(op, tensor_lists, noop_flag, mode=mode, lr_t=lr_t, step_t=step_t,
                                             inv=inv, bias_correction=bias_correction,
                                             unscale_skipped=unscale_skipped))
    if not plan.n:
        return
    if not plan.use_kernel:
        return adam_ref(tensor_lists, lr=lr, beta1=beta1, beta2=beta2, eps=eps, step=step, mode=mode,
                        bias_correction=bias_correction, weight_decay=weight_decay, noop_flag=noop_flag,
                        inv_scale=inv_scale, unscale_skipped=unscale_skipped)
    tabs, copy_back = plan.pointers(tensor_lists, flat)
    if plan.single_group(noop_flag.device) and (not lr_t or lr.device == noop_flag.device) and \
            (not step_t or step.device == noop_flag.device) and (inv != INV_DEVICE or inv_scale.device ==
                                                                   noop_flag.device):
        plan.run(tabs, noop_flag, lr, step, inv_scale, float(beta1), float(beta2), float(eps), float(weight_decay))
    else:  # tensors on several devices: every device tensor argument moved to each group's device
        for i, g in enumerate(plan.tables.groups):
            noop, lr_i, step_i, inv_i = (x.to(g.device) if isinstance(x, torch.Tensor) else x
                                         for x in (noop_flag, lr, step, inv_scale))
            plan.run(tabs, noop, lr_i, step_i, inv_i, float(beta1), float(beta2), float(eps), float(weight_decay),
                     only=i)
    finish(copy_back)


def multi_tensor_adam(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float, beta1: float, beta2: float,
                      epsilon: float, step: int, mode: int, bias_correction: int, weight_decay: float) -> None:
    """Apex ``amp_C.multi_tensor_adam``: ``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]``."""
    check_chunk(chunk_size, "multi_tensor_adam")
    adam_update(tensor_lists, lr=lr, beta1=beta1, beta2=beta2, eps=epsilon, step=step, mode=mode,
                bias_correction=bool(bias_correction), weight_decay=weight_decay, noop_flag=noop_flag,
                op="multi_tensor_adam")


def multi_tensor_adam_capturable(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: torch.Tensor,
                                 beta1: float, beta2: float, epsilon: float, step: torch.Tensor, mode: int,
                                 bias_correction: int, weight_decay: float, inv_scale: torch.Tensor) -> None:
    """Apex ``amp_C.multi_tensor_adam_capturable``: ``lr``, ``step`` and ``inv_scale`` are device tensors."""
    check_chunk(chunk_size, "multi_tensor_adam_capturable")
    adam_update(tensor_lists, lr=lr, beta1=beta1, beta2=beta2, eps=epsilon, step=step, mode=mode,
                bias_correction=bool(bias_correction), weight_decay=weight_decay, noop_flag=noop_flag,
                inv_scale=inv_scale, op="multi_tensor_adam_capturable")


def multi_tensor_adam_capturable_master(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: torch.Tensor,
                                        beta1: float, beta2: float, epsilon: float, step: torch.Tensor, mode: int,
                                        bias_correction: int, weight_decay: float, inv_scale: torch.Tensor) -> None:
    """Apex ``amp_C.multi_tensor_adam_capturable_master``: ``[g, p, m, v, p_master]`` with fp32 masters."""
    if len(tensor_lists) != 5:
        raise ValueError(f"multi_tensor_adam_capturable_master: expected 5 tensor lists, got {len(tensor_lists)}")
    multi_tensor_adam_capturable(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode,
                                 bias_correction, weight_decay, inv_scale)
