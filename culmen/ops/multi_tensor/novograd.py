"""NovoGrad over tensor lists: Apex's ``amp_C.multi_tensor_novograd``.

``tensor_lists = [grads, params, exp_avgs]`` and ``grad_norms``, an fp32 device tensor with one
moving gradient norm per tensor (NovoGrad's per-layer second moment, stored as a norm, not squared).
Three launches per group, none of them a loop over tensors:

1. one program per chunk writes the chunk's sum of squares (``norm_type=2``) or max |g|
   (``norm_type=0``) of the gradient;
2. one program per tensor reduces its chunks in a fixed order (deterministic) and blends the norm in
   place: ``gn = sqrt(beta2 gn^2 + (1-beta2) n^2)`` (L2) or ``gn = beta2 gn + (1-beta2) n`` (inf);
3. one program per chunk applies the update with ``v = gn / bc2`` where ``bc2 = sqrt(1 - beta2^step)``
   (1 without bias correction), ``bc1 = 1 - beta1^step``, ``beta3 = 1 - beta1`` with
   ``grad_averaging`` (else 1):

   * mode 0 (decay inside the moment): ``g = g / (v + eps) + wd p; m = beta1 m + beta3 g;
     p -= lr m / bc1``;
   * mode 1 (decoupled): ``m = beta1 m + beta3 g; p -= lr ((m / bc1) / (v + eps) + wd p)``.

All of it, the norm blend included, is skipped while the noop flag is set (Apex's NovoGrad ignores
the flag and lets inf/NaN through; culmen's update ops never apply a flagged step).
"""

from __future__ import annotations

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
    signature,
    triton,
)

if triton is not None:
    import triton.language as tl

    from culmen.ops.multi_tensor.common import block_offsets, chunk_coords, load_f32, store, tensor_ptr

TUNING = PlanTuning({"chunk": 8192, "block": 1024, "num_warps": 4, "final_block": 1024}, clear_plans)

NOVOGRAD_MODE_INSIDE, NOVOGRAD_MODE_DECOUPLED = 0, 1

if triton is not None:

    @triton.jit
    def _ng_norm_range(xp, start, n, acc, NORM: tl.constexpr, MASKED: tl.constexpr, CHUNK: tl.constexpr,
                       BLOCK: tl.constexpr):
        for i in range(0, CHUNK, BLOCK):
            offs = block_offsets(start, i, BLOCK)
            x = load_f32(xp, offs, n, MASKED)
            if NORM == 0:
                acc = tl.maximum(acc, tl.abs(x))
            else:
                acc += x * x
        return acc

    @triton.jit(do_not_specialize=["T", "C"])
    def _ng_partial_kernel(ptrs, geo, noop, partial, T, C, G_DT: tl.constexpr, NORM: tl.constexpr,
                           SHIFT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        c = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        if tl.load(noop) == 0:
            t, j, n = chunk_coords(geo, T, C)
            gp = tensor_ptr(ptrs, T, t, 0, G_DT, SHIFT)
            start = j * CHUNK
            if start + CHUNK <= n:
                acc = _ng_norm_range(gp, start, n, acc, NORM, False, CHUNK, BLOCK)
            else:
                acc = _ng_norm_range(gp, start, n, acc, NORM, True, CHUNK, BLOCK)
        if NORM == 0:
            tl.store(partial + c, tl.max(acc, axis=0))
        else:
            tl.store(partial + c, tl.sum(acc, axis=0))

    @triton.jit(do_not_specialize=["T"])
    def _ng_blend_kernel(partial, geo, norms, idx, noop, T, alpha, beta, NORM: tl.constexpr, IDX: tl.constexpr,
                         BLOCK: tl.constexpr):
        # Program t reduces the chunks of tensor t in order and blends the result into its moving norm.
        t = tl.program_id(0)
        first = geo + T
        if tl.load(noop) == 0:
            lo = tl.load(first + t)
            hi = tl.load(first + t + 1)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for i in range(lo, hi, BLOCK):
                offs = i + tl.arange(0, BLOCK)
                x = tl.load(partial + offs, mask=offs < hi, other=0.0)
                if NORM == 0:
                    acc = tl.maximum(acc, x)
                else:
                    acc += x
            pos = t
            if IDX:
                pos = tl.load(idx + t)
            old = tl.load(norms + pos)
            if NORM == 0:
                new = alpha * old + beta * tl.max(acc, axis=0)
            else:
                new = tl.sqrt_rn(alpha * old * old + beta * tl.sum(acc, axis=0))
            tl.store(norms + pos, new)

    @triton.jit
    def _ng_update_range(gp, pp, mp, start, n, gn, lr, b1, b3, bc1, bc2, eps, wd, MODE: tl.constexpr,
                         HAS_WD: tl.constexpr, MASKED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        denom = tl.div_rn(gn, bc2) + eps
        for i in range(0, CHUNK, BLOCK):
            offs = block_offsets(start, i, BLOCK)
            g = load_f32(gp, offs, n, MASKED)
            p = load_f32(pp, offs, n, MASKED)
            m = load_f32(mp, offs, n, MASKED)
            if MODE == 0:
                g = tl.div_rn(g, denom)
                if HAS_WD:
                    g = g + wd * p
                m = b1 * m + b3 * g
                p = p - lr * tl.div_rn(m, bc1)
            else:
                m = b1 * m + b3 * g
                upd = tl.div_rn(tl.div_rn(m, bc1), denom)
                if HAS_WD:
                    upd = upd + wd * p
                p = p - lr * upd
            store(mp, offs, n, m, MASKED)
            store(pp, offs, n, p, MASKED)

    @triton.jit(do_not_specialize=["T", "C"])
    def _ng_update_kernel(ptrs, geo, noop, norms, idx, T, C, lr, b1, b3, bc1, bc2, eps, wd, G_DT: tl.constexpr,
                          P_DT: tl.constexpr, M_DT: tl.constexpr, MODE: tl.constexpr, HAS_WD: tl.constexpr,
                          IDX: tl.constexpr, SHIFT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        if tl.load(noop) == 0:
            t, j, n = chunk_coords(geo, T, C)
            gp = tensor_ptr(ptrs, T, t, 0, G_DT, SHIFT)
            pp = tensor_ptr(ptrs, T, t, 1, P_DT, SHIFT)
            mp = tensor_ptr(ptrs, T, t, 2, M_DT, SHIFT)
            pos = t
            if IDX:
                pos = tl.load(idx + t)
            gn = tl.load(norms + pos)
            start = j * CHUNK
            if start + CHUNK <= n:
                _ng_update_range(gp, pp, mp, start, n, gn, lr, b1, b3, bc1, bc2, eps, wd, MODE, HAS_WD, False,
                                 CHUNK, BLOCK)
            else:
                _ng_update_range(gp, pp, mp, start, n, gn, lr, b1, b3, bc1, bc2, eps, wd, MODE, HAS_WD, True,
                                 CHUNK, BLOCK)


def _corrections(beta1: float, beta2: float, step: int, bias_correction: int, grad_averaging: int):
    if bias_correction == 1:
        bc1, bc2 = 1.0 - beta1 ** step, (1.0 - beta2 ** step) ** 0.5
    else:
        bc1 = bc2 = 1.0
    beta3 = 1.0 - beta1 if grad_averaging == 1 else 1.0
    return bc1, bc2, beta3


def multi_tensor_novograd_ref(chunk_size, noop_flag, tensor_lists, grad_norms, lr, beta1, beta2, epsilon, step,
                              bias_correction, weight_decay, grad_averaging, mode, norm_type) -> None:
    """Reference of :func:`multi_tensor_novograd` (fp32 math, no host sync on the flag)."""
    bc1, bc2, beta3 = _corrections(beta1, beta2, step, bias_correction, grad_averaging)
    dev = grad_norms.device
    skip = ref_skip(noop_flag, dev)
    new_norms = []
    for i, g in enumerate(tensor_lists[0]):
        gf = g.float()
        old = grad_norms[i]
        if norm_type == 0:
            n = gf.abs().max().to(dev) if gf.numel() else torch.zeros((), device=dev)
            new_norms.append(beta2 * old + (1.0 - beta2) * n)
        else:
            new_norms.append(torch.sqrt(beta2 * old * old + (1.0 - beta2) * (gf * gf).sum().to(dev)))
    if new_norms:
        grad_norms.copy_(torch.where(skip, grad_norms, torch.stack(new_norms)))
    for i, (g, p, m) in enumerate(zip(*tensor_lists)):
        gf, pf, mf = g.float(), p.float(), m.float()
        denom = grad_norms[i].to(p.device) / bc2 + epsilon
        if mode == NOVOGRAD_MODE_INSIDE:
            gf = gf / denom
            if weight_decay != 0:
                gf = gf + weight_decay * pf
            mf = beta1 * mf + beta3 * gf
            pf = pf - lr * (mf / bc1)
        else:
            mf = beta1 * mf + beta3 * gf
            upd = (mf / bc1) / denom
            if weight_decay != 0:
                upd = upd + weight_decay * pf
            pf = pf - lr * upd
        s = skip.to(p.device)
        m.copy_(torch.where(s, m, mf.to(m.dtype)))
        p.copy_(torch.where(s, p, pf.to(p.dtype)))


class _NovoGradPlan(ListPlan):
    def __init__(self, op: str, chunk_size, noop_flag, tensor_lists, grad_norms, mode: int, norm_type: int,
                 has_wd: bool) -> None:
        check_chunk(chunk_size, op)
        noop_pointer(noop_flag, op)
        if mode not in (0, 1):
            raise ValueError(f"{op}: mode must be 0 (decay inside the moment) or 1 (decoupled), got {mode!r}")
        if norm_type not in (0, 2):
            raise ValueError(f"{op}: norm_type must be 2 (L2) or 0 (inf), got {norm_type!r}")
        self.mode, self.norm, self.has_wd = int(mode), int(norm_type), bool(has_wd)
        self.chunk, self.num_warps, self.block = TUNING["chunk"], TUNING["num_warps"], TUNING["block"]
        self.final_block = TUNING["final_block"]
        from culmen.ops.multi_tensor.common import check_lists

        n = check_lists(tensor_lists, 3, op)
        if not isinstance(grad_norms, torch.Tensor) or grad_norms.dtype != torch.float32:
            raise TypeError(f"{op}: grad_norms must be a float32 tensor")
        if grad_norms.numel() != n:
            raise ValueError(f"{op}: grad_norms has {grad_norms.numel()} elements for {n} tensors")
        super().__init__(op, tensor_lists, 3, (1, 2))
        if self.n and grad_norms.device != tensor_lists[0][0].device:
            raise ValueError(f"{op}: grad_norms is on {grad_norms.device} but the tensors are on "
                             f"{tensor_lists[0][0].device}")
        if self.use_kernel:
            if not grad_norms.is_contiguous():
                raise ValueError(f"{op}: grad_norms must be contiguous (it is updated in place)")
            for g in self.tables.groups:
                if g.device != grad_norms.device:
                    raise ValueError(f"{op}: all tensors must be on grad_norms' device {grad_norms.device}")

    def meta(self, g, kernel, variant) -> dict:
        dts = [TL_DTYPE[d] for d in g.dtypes]
        if kernel is _ng_partial_kernel:
            return dict(G_DT=dts[0], NORM=self.norm, CHUNK=self.chunk, BLOCK=self.block)
        if kernel is _ng_blend_kernel:
            return dict(NORM=self.norm, IDX=g.pos is not None, BLOCK=self.final_block)
        return dict(G_DT=dts[0], P_DT=dts[1], M_DT=dts[2], MODE=self.mode, HAS_WD=self.has_wd,
                    IDX=g.pos is not None, CHUNK=self.chunk, BLOCK=self.block)


def multi_tensor_novograd(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, grad_norms: torch.Tensor,
                          lr: float, beta1: float, beta2: float, epsilon: float, step: int, bias_correction: int,
                          weight_decay: float, grad_averaging: int, mode: int, norm_type: int) -> None:
    """Apex ``amp_C.multi_tensor_novograd``: ``tensor_lists = [grads, params, exp_avgs]``.

    ``grad_norms`` (fp32, one per tensor, on the tensors' device) holds the moving gradient norms and
    is updated in place before the parameters. ``norm_type`` 2 (L2) or 0 (max-abs). See the module
    docstring for the math.
    """
    if torch.compiler.is_compiling():
        from culmen.ops.multi_tensor.library import amp_c_update

        return amp_c_update("multi_tensor_novograd", noop_flag, tensor_lists, (
            grad_norms, lr, beta1, beta2, epsilon, step, bias_correction, weight_decay, grad_averaging, mode,
            norm_type,
        ))
    op = "multi_tensor_novograd"
    try:
        flat, sig = signature(tensor_lists)
        key = (op, chunk_size, mode, norm_type, weight_decay != 0, noop_flag.device, grad_norms.device,
               grad_norms.numel(), sig)
    except (TypeError, AttributeError, IndexError):
        flat, key = None, None
    plan = cached_plan(key, lambda: _NovoGradPlan(op, chunk_size, noop_flag, tensor_lists, grad_norms, mode,
                                                  norm_type, weight_decay != 0))
    if not plan.n:
        return
    if not plan.use_kernel:
        return multi_tensor_novograd_ref(chunk_size, noop_flag, tensor_lists, grad_norms, lr, beta1, beta2, epsilon,
                                         step, bias_correction, weight_decay, grad_averaging, mode, norm_type)
    if grad_norms.dtype != torch.float32 or not grad_norms.is_contiguous():
        raise ValueError(f"{op}: grad_norms must be a contiguous float32 tensor (it is updated in place)")
    bc1, bc2, beta3 = _corrections(beta1, beta2, step, bias_correction, grad_averaging)
    tabs, copy_back = plan.pointers(tensor_lists, flat)
    for i, g in enumerate(plan.tables.groups):
        ptab, shift, _ = tabs[i]
        dev = g.device
        flag = noop_flag if noop_flag.device == dev else noop_flag.to(dev)
        aligned = (flag.data_ptr() | grad_norms.data_ptr()) & 15 == 0
        stream = g.stream()
        with device_guard(dev):
            partial = torch.empty(max(g.C, 1), dtype=torch.float32, device=dev)
        if g.C:
            plan.launch(i, _ng_partial_kernel, shift)(stream, aligned, ptab, g.geo, flag, partial, g.T, g.C)
        plan.launch(i, _ng_blend_kernel, None, grid=(g.T,), num_warps=4)(
            stream, aligned, partial, g.geo, grad_norms, g.pos, flag, g.T, float(beta2), 1.0 - float(beta2))
        if g.C:
            plan.launch(i, _ng_update_kernel, shift)(stream, aligned, ptab, g.geo, flag, grad_norms, g.pos, g.T, g.C,
                                                     float(lr), float(beta1), float(beta3), float(bc1), float(bc2),
                                                     float(epsilon), float(weight_decay))
    finish(copy_back)
