"""Adagrad over tensor lists: Apex's ``amp_C.multi_tensor_adagrad``.

``tensor_lists = [grads, params, state_sums]``; one launch per group. Math in fp32:
mode 0 (L2): ``g += wd p; h += g^2; p -= lr g / (sqrt(h) + eps)``;
mode 1 (decoupled): ``h += g^2; p -= lr (g / (sqrt(h) + eps) + wd p)``.
Unlike Apex, whose Adagrad kernel ignores the noop flag, nothing is written while it is set (the
culmen rule for every update op: a flagged overflow never reaches the parameters).
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

ADAGRAD_MODE_L2, ADAGRAD_MODE_DECOUPLED = 0, 1

if triton is not None:

    @triton.jit
    def _adagrad_range(gp, pp, hp, start, n, lr, eps, wd, MODE: tl.constexpr, HAS_WD: tl.constexpr,
                       MASKED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        for i in range(0, CHUNK, BLOCK):
            offs = block_offsets(start, i, BLOCK)
            g = load_f32(gp, offs, n, MASKED)
            p = load_f32(pp, offs, n, MASKED)
            h = load_f32(hp, offs, n, MASKED)
            if MODE == 0:
                if HAS_WD:
                    g = g + wd * p
            h = h + g * g
            upd = tl.div_rn(g, tl.sqrt_rn(h) + eps)
            if MODE == 1:
                if HAS_WD:
                    upd = upd + wd * p
            p = p - lr * upd
            store(hp, offs, n, h, MASKED)
            store(pp, offs, n, p, MASKED)

    @triton.jit(do_not_specialize=["T", "C"])
    def _adagrad_kernel(ptrs, geo, noop, T, C, lr, eps, wd, G_DT: tl.constexpr, P_DT: tl.constexpr,
                        H_DT: tl.constexpr, MODE: tl.constexpr, HAS_WD: tl.constexpr, SHIFT: tl.constexpr,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        if tl.load(noop) == 0:
            t, j, n = chunk_coords(geo, T, C)
            gp = tensor_ptr(ptrs, T, t, 0, G_DT, SHIFT)
            pp = tensor_ptr(ptrs, T, t, 1, P_DT, SHIFT)
            hp = tensor_ptr(ptrs, T, t, 2, H_DT, SHIFT)
            start = j * CHUNK
            if start + CHUNK <= n:
                _adagrad_range(gp, pp, hp, start, n, lr, eps, wd, MODE, HAS_WD, False, CHUNK, BLOCK)
            else:
                _adagrad_range(gp, pp, hp, start, n, lr, eps, wd, MODE, HAS_WD, True, CHUNK, BLOCK)


def multi_tensor_adagrad_ref(chunk_size, noop_flag, tensor_lists, lr, epsilon, mode, weight_decay) -> None:
    """Reference of :func:`multi_tensor_adagrad` (fp32 math, no host sync on the flag)."""
    for g, p, h in zip(*tensor_lists):
        skip = ref_skip(noop_flag, p.device)
        gf, pf, hf = g.float(), p.float(), h.float()
        if mode == ADAGRAD_MODE_L2 and weight_decay != 0:
            gf = gf + weight_decay * pf
        hf = hf + gf * gf
        upd = gf / (torch.sqrt(hf) + epsilon)
        if mode == ADAGRAD_MODE_DECOUPLED and weight_decay != 0:
            upd = upd + weight_decay * pf
        pf = pf - lr * upd
        h.copy_(torch.where(skip, h, hf.to(h.dtype)))
        p.copy_(torch.where(skip, p, pf.to(p.dtype)))


class _AdagradPlan(ListPlan):
    def __init__(self, op: str, chunk_size, noop_flag, tensor_lists, mode: int, has_wd: bool) -> None:
        check_chunk(chunk_size, op)
        noop_pointer(noop_flag, op)
        if mode not in (0, 1):
            raise ValueError(f"{op}: mode must be 0 (L2) or 1 (decoupled weight decay), got {mode!r}")
        self.mode, self.has_wd = int(mode), bool(has_wd)
        self.chunk, self.num_warps, self.block = TUNING["chunk"], TUNING["num_warps"], TUNING["block"]
        super().__init__(op, tensor_lists, 3, (1, 2))

    def meta(self, g, kernel, variant) -> dict:
        dts = [TL_DTYPE[d] for d in g.dtypes]
        return dict(G_DT=dts[0], P_DT=dts[1], H_DT=dts[2], MODE=self.mode, HAS_WD=self.has_wd, CHUNK=self.chunk,
                    BLOCK=self.block)


def multi_tensor_adagrad(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float, epsilon: float,
                         mode: int, weight_decay: float) -> None:
    """Apex ``amp_C.multi_tensor_adagrad``: ``tensor_lists = [grads, params, state_sums]``.

    ``mode`` 0 adds ``weight_decay * p`` to the gradient (L2), 1 decays the parameter directly
    (``adagrad_w_mode``). Dtypes may differ between lists; math in fp32.
    """
    if torch.compiler.is_compiling():
        from culmen.ops.multi_tensor.library import amp_c_update

        return amp_c_update("multi_tensor_adagrad", noop_flag, tensor_lists, (lr, epsilon, mode, weight_decay,))
    op = "multi_tensor_adagrad"
    has_wd = weight_decay != 0
    try:
        flat, sig = signature(tensor_lists)
        key = (op, chunk_size, mode, has_wd, noop_flag.device, sig)
    except (TypeError, AttributeError, IndexError):
        flat, key = None, None
    plan = cached_plan(key, lambda: _AdagradPlan(op, chunk_size, noop_flag, tensor_lists, mode, has_wd))
    if not plan.n:
        return
    if not plan.use_kernel:
        return multi_tensor_adagrad_ref(chunk_size, noop_flag, tensor_lists, lr, epsilon, mode, weight_decay)
    tabs, copy_back = plan.pointers(tensor_lists, flat)
    for i, g in enumerate(plan.tables.groups):
        if g.C:
            ptab, shift, _ = tabs[i]
            flag = noop_flag if noop_flag.device == g.device else noop_flag.to(g.device)
            plan.launch(i, _adagrad_kernel, shift)(g.stream(), flag.data_ptr() & 15 == 0, ptab, g.geo, flag, g.T,
                                                   g.C, float(lr), float(epsilon), float(weight_decay))
    finish(copy_back)
