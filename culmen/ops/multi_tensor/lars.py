"""LARS over tensor lists: ROCm Apex's ``amp_C.multi_tensor_lars`` (the kernel of ``FusedLARS``).

``tensor_lists = [grads, params, momentum_buffers]`` or ``[..., model_param_copies]`` (e.g. 16-bit model
weights of fp32 master params, written in the same pass). ``grad_norms`` / ``param_norms`` are the
per-tensor L2 norms (fp32 device tensors, one per tensor, computed by the caller, e.g. with
``multi_tensor_l2norm(..., per_tensor=True)``). One launch per group. Per tensor::

    trust   = trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + epsilon)  if ||g|| > 0 and ||p|| > 0 else 1
    lr_t    = lr if is_skipped else lr * trust

and per element, in fp32, the momentum buffer holding the step already multiplied by the rate (the
LARS paper's form, as ROCm's kernel)::

    g = scale * g (+ weight_decay * p unless wd_after_momentum)
    buf = -lr_t g                                              (first_run)
    buf = momentum buf - (1 - dampening) lr_t g                (otherwise)
    d = momentum buf - lr_t g (nesterov) or buf;  d = -lr_t g without momentum
    d -= lr_t weight_decay p                                   (wd_after_momentum)
    p += d

With ``momentum != 0``, ``dampening == 0``, ``nesterov`` off, ``wd_after_momentum`` off and zero-initialised
buffers (``FusedLARS``'s defaults) this is exactly ROCm's kernel. That kernel ignores ``first_run``,
``dampening`` and ``nesterov``, drops the weight decay when ``wd_after_momentum`` is set, and with
``momentum == 0`` adds the (unchanged) buffer instead of the step, so the params never move; culmen
implements the arguments as documented above instead (torch.optim.SGD's conventions, as in
``multi_tensor_sgd``). Nothing happens while the noop flag is set (as ROCm's kernel).
"""

from __future__ import annotations

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
    signature,
    triton,
)

if triton is not None:
    import triton.language as tl

    from culmen.ops.multi_tensor.common import block_offsets, chunk_coords, load_f32, store, tensor_ptr

TUNING = PlanTuning({"chunk": 8192, "block": 1024, "num_warps": 4}, clear_plans)

if triton is not None:

    @triton.jit
    def _lars_range(gp, pp, bp, cp, start, n, lr, wd, momentum, dampening, scale, HAS_WD: tl.constexpr,
                    HAS_MOM: tl.constexpr, FIRST: tl.constexpr, NESTEROV: tl.constexpr, WD_AFTER: tl.constexpr,
                    COPY: tl.constexpr, MASKED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        for i in range(0, CHUNK, BLOCK):
            offs = block_offsets(start, i, BLOCK)
            g = load_f32(gp, offs, n, MASKED) * scale
            p = load_f32(pp, offs, n, MASKED)
            if HAS_WD and not WD_AFTER:
                g = g + wd * p
            step = lr * g
            if HAS_MOM:
                if FIRST:
                    buf = -step
                else:
                    buf = momentum * load_f32(bp, offs, n, MASKED) - (1.0 - dampening) * step
                store(bp, offs, n, buf, MASKED)
                if NESTEROV:
                    d = momentum * buf - step
                else:
                    d = buf
            else:
                d = -step
            if HAS_WD and WD_AFTER:
                d = d - lr * (wd * p)
            p = p + d
            store(pp, offs, n, p, MASKED)
            if COPY:
                store(cp, offs, n, p, MASKED)

    @triton.jit(do_not_specialize=["T", "C"])
    def _lars_kernel(ptrs, geo, noop, gn_ptr, pn_ptr, idx, T, C, lr, tc, eps, wd, momentum, dampening, scale,
                     G_DT: tl.constexpr, P_DT: tl.constexpr, B_DT: tl.constexpr, C_DT: tl.constexpr, L: tl.constexpr,
                     HAS_WD: tl.constexpr, HAS_MOM: tl.constexpr, FIRST: tl.constexpr, NESTEROV: tl.constexpr,
                     WD_AFTER: tl.constexpr, SKIPPED: tl.constexpr, IDX: tl.constexpr, SHIFT: tl.constexpr,
                     CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        if tl.load(noop) == 0:
            t, j, n = chunk_coords(geo, T, C)
            gp = tensor_ptr(ptrs, T, t, 0, G_DT, SHIFT)
            pp = tensor_ptr(ptrs, T, t, 1, P_DT, SHIFT)
            bp = tensor_ptr(ptrs, T, t, 2, B_DT, SHIFT)
            cp = pp
            if L == 4:
                cp = tensor_ptr(ptrs, T, t, 3, C_DT, SHIFT)
            if not SKIPPED:
                pos = t
                if IDX:
                    pos = tl.load(idx + t)
                gn = tl.load(gn_ptr + pos).to(tl.float32)
                pn = tl.load(pn_ptr + pos).to(tl.float32)
                trust = tl.div_rn(tc * pn, gn + pn * wd + eps)
                lr = lr * tl.where((gn > 0.0) & (pn > 0.0), trust, 1.0)
            start = j * CHUNK
            if start + CHUNK <= n:
                _lars_range(gp, pp, bp, cp, start, n, lr, wd, momentum, dampening, scale, HAS_WD, HAS_MOM, FIRST,
                            NESTEROV, WD_AFTER, L == 4, False, CHUNK, BLOCK)
            else:
                _lars_range(gp, pp, bp, cp, start, n, lr, wd, momentum, dampening, scale, HAS_WD, HAS_MOM, FIRST,
                            NESTEROV, WD_AFTER, L == 4, True, CHUNK, BLOCK)


def multi_tensor_lars_ref(chunk_size, noop_flag, tensor_lists, grad_norms, param_norms, lr, trust_coefficient,
                          epsilon, weight_decay, momentum, dampening, nesterov, first_run, wd_after_momentum, scale,
                          is_skipped) -> None:
    """Reference of :func:`multi_tensor_lars` (fp32 math, no host sync on the flag)."""
    copies = tensor_lists[3] if len(tensor_lists) == 4 else [None] * len(tensor_lists[0])
    for i, (g, p, buf, cp) in enumerate(zip(*tensor_lists[:3], copies)):
        dev = p.device
        skip = ref_skip(noop_flag, dev)
        lr_t = torch.tensor(float(lr), dtype=torch.float32, device=dev)
        if not is_skipped:
            gn, pn = grad_norms[i].to(dev).float(), param_norms[i].to(dev).float()
            trust = trust_coefficient * pn / (gn + pn * weight_decay + epsilon)
            lr_t = lr_t * torch.where((gn > 0) & (pn > 0), trust, torch.ones_like(trust))
        gf = g.float() * scale
        pf = p.float()
        if weight_decay != 0 and not wd_after_momentum:
            gf = gf + weight_decay * pf
        step = lr_t * gf
        if momentum != 0:
            bf = -step if first_run else momentum * buf.float() - (1.0 - dampening) * step
            buf.copy_(torch.where(skip, buf, bf.to(buf.dtype)))
            d = momentum * bf - step if nesterov else bf
        else:
            d = -step
        if weight_decay != 0 and wd_after_momentum:
            d = d - lr_t * (weight_decay * pf)
        pf = pf + d
        for dst in (p, cp):
            if dst is not None:
                dst.copy_(torch.where(skip, dst, pf.to(dst.dtype)))


def multi_tensor_lars(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, grad_norms: torch.Tensor,
                      param_norms: torch.Tensor, lr: float, trust_coefficient: float, epsilon: float,
                      weight_decay: float, momentum: float, dampening: float, nesterov: bool, first_run: bool,
                      wd_after_momentum: bool, scale: float, is_skipped: bool) -> None:
    """ROCm Apex ``amp_C.multi_tensor_lars`` (see the module docstring for the update rule)."""
    if torch.compiler.is_compiling():
        from culmen.ops.multi_tensor.library import amp_c_update

        return amp_c_update("multi_tensor_lars", noop_flag, tensor_lists, (
            grad_norms, param_norms, lr, trust_coefficient, epsilon, weight_decay, momentum, dampening, nesterov,
            first_run, wd_after_momentum, scale, is_skipped,
        ))
    op = "multi_tensor_lars"
    flags = (weight_decay != 0, momentum != 0, bool(first_run), bool(nesterov), bool(wd_after_momentum),
             bool(is_skipped))
    try:
        flat, sig = signature(tensor_lists)
        key = (op, chunk_size, flags, noop_flag.device, grad_norms.dtype, param_norms.dtype, grad_norms.numel(),
               param_norms.numel(), sig)
    except (TypeError, AttributeError, IndexError):
        flat, key = None, None
    plan = cached_plan(key, lambda: _LarsPlan(op, chunk_size, noop_flag, tensor_lists, grad_norms, param_norms, flags))
    if not plan.n:
        return
    if not plan.use_kernel:
        return multi_tensor_lars_ref(chunk_size, noop_flag, tensor_lists, grad_norms, param_norms, lr,
                                     trust_coefficient, epsilon, weight_decay, momentum, dampening, nesterov,
                                     first_run, wd_after_momentum, scale, is_skipped)
    tabs, copy_back = plan.pointers(tensor_lists, flat)
    scalars = (float(lr), float(trust_coefficient), float(epsilon), float(weight_decay), float(momentum),
               float(dampening), float(scale))
    for i, g in enumerate(plan.tables.groups):
        if g.C:
            ptab, shift, _ = tabs[i]
            dev = g.device
            flag = noop_flag if noop_flag.device == dev else noop_flag.to(dev)
            gn, pn = (x if x.device == dev and x.is_contiguous() else x.to(dev).contiguous()
                      for x in (grad_norms, param_norms))
            aligned = (flag.data_ptr() | gn.data_ptr() | pn.data_ptr()) & 15 == 0
            plan.launch(i, _lars_kernel, shift)(g.stream(), aligned, ptab, g.geo, flag, gn, pn, g.pos, g.T, g.C,
                                                *scalars)
    finish(copy_back)


class _LarsPlan(ListPlan):
    def __init__(self, op: str, chunk_size, noop_flag, tensor_lists, grad_norms, param_norms, flags) -> None:
        check_chunk(chunk_size, op)
        noop_pointer(noop_flag, op)
        self.flags = flags
        self.chunk, self.num_warps, self.block = TUNING["chunk"], TUNING["num_warps"], TUNING["block"]
        super().__init__(op, tensor_lists, (3, 4), tuple(range(1, len(tensor_lists))))
        for name, x in (("grad_norms", grad_norms), ("param_norms", param_norms)):
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                raise TypeError(f"{op}: {name} must be a floating-point tensor")
            if x.numel() != self.n:
                raise ValueError(f"{op}: {name} has {x.numel()} elements for {self.n} tensors")

    def meta(self, g, kernel, variant) -> dict:
        dts = [TL_DTYPE[d] for d in g.dtypes]
        has_wd, has_mom, first, nesterov, wd_after, skipped = self.flags
        return dict(G_DT=dts[0], P_DT=dts[1], B_DT=dts[2], C_DT=dts[3] if len(dts) == 4 else dts[1], L=len(dts),
                    HAS_WD=has_wd, HAS_MOM=has_mom, FIRST=first, NESTEROV=nesterov, WD_AFTER=wd_after,
                    SKIPPED=skipped, IDX=g.pos is not None, CHUNK=self.chunk, BLOCK=self.block)
