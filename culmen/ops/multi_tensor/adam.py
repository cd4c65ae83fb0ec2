"""Adam / AdamW over tensor lists: ``multi_tensor_adam`` and its capturable and master-weight forms.

One kernel serves every variant (constexpr switches): ``lr`` and ``step`` as host numbers or device
tensors (CUDA-graph capturable, no host sync), gradient unscaling by a host number, a device inverse
scale or a device scale (GradScaler's, divided out in the kernel), and fp32 master weights for 16-bit
params. Every update skips its work when the noop flag (int32 overflow flag, or the grad scaler's float
``found_inf``) is non-zero.

``FusedAdam`` keeps an ``AdamPlan`` per param group (``culmen.optimizers.fused_adam``); its device step
counter is advanced by the kernel itself (``STEP=2``: the last program to finish adds 1 unless the step
was skipped), so a step costs no PyTorch op besides the launch.

Rounding: the element-wise math rounds as ``torch.optim.Adam`` / ``AdamW`` (``foreach=False``) does for
fp32 params on CUDA, where every op rounds once and torch's one-kernel ``a + s * b`` (``add(alpha=)``,
``addcmul_``, ``addcdiv_``, ``lerp_``) is an fma; with ``fma(a, b, c) = a * b + c`` rounded once::

    g = fma(wd, p, g)                            (Adam, L2)          p = p * decay    (AdamW)
    m = fma(w, g - m, m)   if w < 0.5, else  m = fma(w - 1, g - m, g)    (exp_avg.lerp_(g, w))
    v = fma(1 - beta2, g * g, v * beta2)
    p = fma(-step_size, m / (sqrt(v) * rc2 + eps), p)

with ``w = 1 - beta1``, ``decay = 1 - lr * wd``, ``step_size = lr / (1 - beta1^step)`` and
``rc2 = 1 / sqrt(1 - beta2^step)`` (torch's CUDA division by a host scalar is a multiply by the scalar's
reciprocal taken in double, then rounded to fp32: scripts/probe_torch_adam_rounding.py measured every op)
computed in double and rounded to fp32, as torch rounds Python scalars: on the host for a host lr and
step, in fp64 inside the kernel from exact fp32 triples of the doubles for a device lr or step
(capturable, GradScaler-driven steps), so both give the same values. Divisions and square roots are the
correctly rounded ``div_rn`` / ``sqrt_rn``; the launches disable fp fusion, so nothing else is
contracted. ``torch.optim.Adam``'s default foreach path divides by ``sqrt(bc2)`` instead of multiplying by
its reciprocal: its denominators differ from these by at most an ulp, on a few elements.
"""

from __future__ import annotations

import functools
import struct

import torch

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
    from culmen.ops.multi_tensor.lamb import _pow_int

TUNING = PlanTuning({"chunk": 8192, "block": 2048, "num_warps": 8}, clear_plans)

ADAM_MODE_L2, ADAM_MODE_ADAMW = 0, 1
# INV: how the gradients are unscaled. STEP: how a device step counter is read.
INV_NONE, INV_HOST, INV_DEVICE, INV_DIVIDE = 0, 1, 2, 3
STEP_AS_IS, STEP_NEXT, STEP_ADVANCE = 0, 1, 2

if triton is not None:

    @triton.jit
    def _adam_range(gp, pp, mp, vp, qp, start, n, nss, rc2, decay, w1, small, omb2, b2, eps, wd, inv,
                    MODE: tl.constexpr, MASTER: tl.constexpr, REM: tl.constexpr, HAS_INV: tl.constexpr,
                    MASKED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        # torch.optim.Adam(W)'s CUDA ops in its order (module docstring, "Rounding"): each op rounds once,
        # an explicit fma where one torch kernel computes ``a + s * b``; the launches disable fp fusion so
        # that nothing else is contracted.
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
                g = tl.fma(wd, p, g)  # grad.add(param, alpha=wd)
            else:
                p = p * decay  # param.mul_(1 - lr * wd)
            # exp_avg.lerp_(grad, w): m + w (g - m) for w < 0.5, else g - (1 - w) (g - m) = g + (w - 1) (g - m)
            m = tl.fma(w1, g - m, tl.where(small != 0.0, m, g))
            v = tl.fma(omb2, g * g, v * b2)  # exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
            den = tl.sqrt_rn(v) * rc2 + eps  # (exp_avg_sq.sqrt() / sqrt(bc2)).add_(eps): a reciprocal multiply
            p = tl.fma(nss, tl.div_rn(m, den), p)  # param.addcdiv_(exp_avg, denom, value=-lr / bc1)
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

    @triton.jit
    def _f64(x0, x1, x2):
        # a host double passed as three fp32 parts (``split_f64``): their fp64 sum is exact
        return (tl.cast(x0, tl.float64) + tl.cast(x1, tl.float64)) + tl.cast(x2, tl.float64)

    @triton.jit(do_not_specialize=["T", "C"])
    def _adam_kernel(ptrs, geo, noop, lr_ptr, step_ptr, inv_ptr, ticket, T, C, nss, rc2, decay, w1, small, omb2, b2,
                     eps, wd, inv, lr0, lr1, lr2, wd0, wd1, wd2, b10, b11, b12, b20, b21, b22, bc10, bc11, bc12,
                     G_DT: tl.constexpr, P_DT: tl.constexpr, M_DT: tl.constexpr, V_DT: tl.constexpr,
                     Q_DT: tl.constexpr, L: tl.constexpr, MODE: tl.constexpr, LR_T: tl.constexpr,
                     STEP_T: tl.constexpr, STEP: tl.constexpr, INV: tl.constexpr, BIAS_CORR: tl.constexpr,
                     REM: tl.constexpr, UNSCALE_SKIPPED: tl.constexpr, SHIFT: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCK: tl.constexpr):
        # Inductor passes Python floats as fp64: keep the element-wise math in fp32 (a no-op in eager launches).
        nss = tl.cast(nss, tl.float32)
        rc2 = tl.cast(rc2, tl.float32)
        decay = tl.cast(decay, tl.float32)
        w1 = tl.cast(w1, tl.float32)
        small = tl.cast(small, tl.float32)
        omb2 = tl.cast(omb2, tl.float32)
        b2 = tl.cast(b2, tl.float32)
        eps = tl.cast(eps, tl.float32)
        inv = tl.cast(inv, tl.float32)
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
            if LR_T or STEP_T:
                # The step's scalars as the host computes them for a host lr and step (``adam_scalars``): in
                # double from the double lr, weight decay, betas (or the device lr's value), rounded once.
                if LR_T:
                    lr64 = tl.load(lr_ptr).to(tl.float64)
                else:
                    lr64 = _f64(lr0, lr1, lr2)
                if STEP_T:
                    if BIAS_CORR:
                        sv = s.to(tl.int32)
                        bc1 = 1.0 - _pow_int(_f64(b10, b11, b12), sv)
                        bc2 = 1.0 - _pow_int(_f64(b20, b21, b22), sv)
                        rc2 = (1.0 / tl.sqrt(bc2)).to(tl.float32)  # fp64 (div.rn.f64 / sqrt.rn.f64)
                    else:
                        bc1 = tl.full((), 1.0, tl.float64)
                else:
                    bc1 = _f64(bc10, bc11, bc12)
                nss = (-(lr64 / bc1)).to(tl.float32)
                decay = (1.0 - lr64 * _f64(wd0, wd1, wd2)).to(tl.float32)
            if INV == 2:
                inv = tl.load(inv_ptr).to(tl.float32)
            if INV == 3:
                inv = tl.div_rn(1.0, tl.load(inv_ptr).to(tl.float32))
            start = j * CHUNK
            if start + CHUNK <= n:
                _adam_range(gp, pp, mp, vp, qp, start, n, nss, rc2, decay, w1, small, omb2, b2, eps, wd, inv, MODE,
                            L == 5, REM, INV != 0, False, CHUNK, BLOCK)
            else:
                _adam_range(gp, pp, mp, vp, qp, start, n, nss, rc2, decay, w1, small, omb2, b2, eps, wd, inv, MODE,
                            L == 5, REM, INV != 0, True, CHUNK, BLOCK)
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


def rem_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """fp32 master from a bf16 ``param`` (its top 16 bits) and an int16 ``remainder`` (the signed rest)."""
    bits = (param.view(torch.int16).to(torch.int32) << 16) + remainder.to(torch.int32)
    return bits.view(torch.float32)


def rem_split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`rem_master`: ``(bf16 param rounded to nearest, int16 remainder)``."""
    bits = master.contiguous().view(torch.int32).to(torch.int64)
    hi = (bits + 0x8000) >> 16
    return hi.to(torch.int16).view(torch.bfloat16), (bits - (hi << 16)).to(torch.int16)


_pack_f32, _unpack_f32 = struct.Struct("f").pack, struct.Struct("f").unpack
_Z3 = (0.0, 0.0, 0.0)


def _f32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value (as a Python float)."""
    return _unpack_f32(_pack_f32(x))[0]


@functools.lru_cache(maxsize=256)
def split_f64(x: float) -> tuple[float, float, float]:
    """A double as three fp32 values whose exact sum is ``x`` (the kernels rebuild it in fp64)."""
    hi = _f32(x)
    mid = _f32(x - hi)
    return hi, mid, _f32(x - hi - mid)


@functools.lru_cache(maxsize=64)
def _lerp_coefficient(beta1: float) -> tuple[float, float]:
    """``(c, small)`` of ``exp_avg.lerp_(grad, w)``, ``w = 1 - beta1`` rounded to fp32 as torch passes it:
    ``m + w (g - m)`` (``small`` = 1) when ``w < 0.5``, else ``g + (w - 1) (g - m)`` (``w - 1`` exact)."""
    w = _f32(1.0 - beta1)
    return (w, 1.0) if abs(w) < 0.5 else (w - 1.0, 0.0)


@functools.lru_cache(maxsize=64)
def _constants(beta1: float, beta2: float, eps: float, wd: float, lr, lr_t: bool, step_t: bool) -> tuple:
    """The kernel's step-independent scalars: ``(c, small, 1 - beta2, beta2, eps, wd)`` and the fp32 triples
    of the doubles a device lr or step needs (``lr``: the host lr, only needed with ``step_t``)."""
    c1, small = _lerp_coefficient(beta1)
    tail = _Z3 * 4
    if lr_t or step_t:
        lr3 = split_f64(float(lr)) if step_t and not lr_t else _Z3
        b13, b23 = (split_f64(beta1), split_f64(beta2)) if step_t else (_Z3, _Z3)
        tail = (*lr3, *split_f64(wd), *b13, *b23)
    return (c1, small, 1.0 - beta2, beta2, eps, wd), tail


def adam_scalars(lr, step, beta1: float, beta2: float, eps: float, wd: float, bias_correction: bool, lr_t: bool,
                 step_t: bool, inv: float = 1.0) -> tuple:
    """The scalar arguments of ``_adam_kernel`` after ``T, C`` (module docstring, "Rounding").

    A host ``lr`` and ``step`` give the step's scalars computed here in double (the launch rounds them to
    fp32, as torch rounds Python scalars); a device ``lr`` or ``step`` (``lr_t`` / ``step_t``) passes the
    doubles the kernel needs as exact fp32 triples instead, and the kernel computes the same values in fp64.
    (``AdamPlan.run`` inlines this: the cached host path makes no Python call for it.)
    """
    head, tail = _constants(float(beta1), float(beta2), float(eps), float(wd),
                            lr if step_t and not lr_t else None, lr_t, step_t)
    nss, rc2, decay, bc13 = 0.0, 1.0, 1.0, _Z3
    bc1 = 1.0
    if not step_t and bias_correction:
        bc1 = 1.0 - beta1 ** step
        rc2 = 1.0 / (1.0 - beta2 ** step) ** 0.5  # torch: a multiply by the double reciprocal, rounded to fp32
    if lr_t or step_t:
        if not step_t:
            bc13 = split_f64(bc1)
    else:
        nss, decay = -(lr / bc1), 1.0 - lr * wd
    return (nss, rc2, decay, *head, inv, *tail, *bc13)


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``a * b + c`` rounded once (to within the rare double-rounding tie of the fp64 sum)."""
    return (a.double() * b.double() + c.double()).float()


def _device_scalars(lr, step, beta1: float, beta2: float, wd: float, bias_correction: bool, dev):
    """0-dim fp32 ``(-lr / bc1, 1 / sqrt(bc2), 1 - lr wd)`` computed in fp64 from a device ``lr`` or ``step``
    (the kernels' device-scalar path), without a host sync."""
    f64 = torch.float64
    lr64 = lr.reshape(-1)[0].to(device=dev, dtype=f64) if isinstance(lr, torch.Tensor) else \
        torch.tensor(float(lr), dtype=f64, device=dev)
    one = torch.ones((), dtype=f64, device=dev)
    if not bias_correction:
        bc1 = bc2 = one
    elif isinstance(step, torch.Tensor):
        s = step.reshape(-1)[0].to(device=dev, dtype=f64)
        bc1 = 1.0 - torch.pow(torch.tensor(float(beta1), dtype=f64, device=dev), s)
        bc2 = 1.0 - torch.pow(torch.tensor(float(beta2), dtype=f64, device=dev), s)
    else:
        bc1 = torch.tensor(1.0 - beta1 ** step, dtype=f64, device=dev)
        bc2 = torch.tensor(1.0 - beta2 ** step, dtype=f64, device=dev)
    rc2 = torch.reciprocal(torch.sqrt(bc2)).float()
    return (-(lr64 / bc1)).float(), rc2, (1.0 - lr64 * wd).float()


def adam_ref(tensor_lists, *, lr, beta1: float, beta2: float, eps: float, step, mode: int, bias_correction: bool,
             weight_decay: float, noop_flag: torch.Tensor, inv_scale=None, scale_divides: bool = False,
             unscale_skipped: bool = False) -> None:
    """Reference of :func:`adam_update`: the kernels' fp32 rounding (module docstring, "Rounding"), one
    tensor at a time, no host sync on device flags."""
    masters = tensor_lists[4] if len(tensor_lists) == 5 else [None] * len(tensor_lists[0])
    lr_t, step_t = isinstance(lr, torch.Tensor), isinstance(step, torch.Tensor)
    host = None if lr_t or step_t else adam_scalars(lr, step, beta1, beta2, eps, weight_decay, bias_correction,
                                                    False, False)
    c1, small = _lerp_coefficient(float(beta1))
    per_device: dict[torch.device, tuple] = {}  # the step's scalars, made once per device, not per tensor
    for g, p, m, v, q in zip(*tensor_lists[:4], masters):
        dev = p.device
        skip = ref_skip(noop_flag, dev)
        if dev not in per_device:
            step3 = (_device_scalars(lr, step, beta1, beta2, weight_decay, bias_correction, dev) if host is None
                     else tuple(scalar_f32(x, dev) for x in host[:3]))
            per_device[dev] = (*step3, *(scalar_f32(x, dev) for x in (weight_decay, c1, 1.0 - beta2, beta2, eps)))
        nss, rc2, decay, wd, w1, omb2, b2, e = per_device[dev]
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
            gf = _fma(wd, pf, gf)
        else:
            pf = pf * decay
        mf = _fma(w1, gf - mf, mf if small else gf)
        vf = _fma(omb2, gf * gf, vf * b2)
        # sqrt and the division in fp64 rounded to fp32: correctly rounded, like sqrt_rn / div_rn (torch's
        # CPU fp32 sqrt may be an ulp off)
        den = torch.sqrt(vf.double()).float() * rc2 + e
        pf = _fma(nss, (mf.double() / den.double()).float(), pf)
        if rem:
            hi, low = rem_split(pf)
            pairs = ((m, mf), (v, vf), (p, hi), (q, low))
        else:
            pairs = ((m, mf), (v, vf), (p, pf), (q, pf))
        for dst, val in pairs:
            if dst is not None:
                dst.copy_(torch.where(skip, dst, val.to(dst.dtype)))


class AdamPlan(ListPlan):
    """``adam_update``'s plan for one signature and variant: ``[g, p, m, v(, p_master)]``.

    ``lr_t`` / ``step_t``: lr and step are device tensors; ``inv``: an ``INV_*`` mode; ``step_mode``: a
    ``STEP_*`` mode (the optimizer's in-kernel counter; amp_C callers pass the step already advanced).
    ``static``: lists whose addresses stay fixed (an optimizer's params and states). ``unscale_skipped``:
    a skipped step still unscales the gradients (FusedAdam under a GradScaler).
    """

    options = {"enable_fp_fusion": False}  # every multiply and add rounds on its own, as torch's separate ops

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
        # adam_scalars inlined: the host-call budget of the cached step (tests/host) has no room for a call
        head, tail = _constants(b1, b2, eps, wd, lr if self.step_t and not self.lr_t else None, self.lr_t,
                                self.step_t)
        nss, rc2, decay, bc13 = 0.0, 1.0, 1.0, _Z3
        bc1 = 1.0
        if not self.step_t and self.bias_correction:
            bc1 = 1.0 - b1 ** step
            rc2 = 1.0 / (1.0 - b2 ** step) ** 0.5
        if self.lr_t or self.step_t:
            if not self.step_t:
                bc13 = split_f64(bc1)
        else:
            nss, decay = -(lr / bc1), 1.0 - lr * wd
        scalars = (nss, rc2, decay, *head, float(inv) if self.inv == INV_HOST else 1.0, *tail, *bc13)
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
    Math in fp32, rounded as torch.optim.Adam(W) rounds it (module docstring): ``m = b1 m + (1-b1) g``;
    ``v = b2 v + (1-b2) g^2``; ``p = [AdamW] (1 - lr wd) p - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)``.
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
