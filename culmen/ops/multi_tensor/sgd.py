"""SGD with momentum over tensor lists: Apex's ``amp_C.multi_tensor_sgd``.

``tensor_lists = [grads, params, momentum_buffers]`` or ``[..., model_param_copies]`` (the copies, e.g.
fp16 model weights of fp32 master params, are written in the same pass, as amp O2 does). The update
follows torch.optim.SGD: ``g = scale g (+ wd p)``; ``buf = g`` on the first run, else
``buf = momentum buf + (1 - dampening) g``; ``g = g + momentum buf`` (nesterov) or ``buf``;
``(+ wd p`` when ``wd_after_momentum)``; ``p -= lr g``. Nothing happens when the noop flag is set.

Rounding, as Apex's kernel: the math is fp32 (the new momentum buffer feeds the update unrounded and is
stored in its own dtype); for 16-bit params the step ``-lr g`` is rounded to the param's dtype before it
is added (Apex's ``weight += -lr * g`` on a ``Half`` weight converts the step to ``Half`` first), then the
sum is rounded. With a power-of-two ``lr`` this is exactly torch.optim.SGD's fp16 result (``-lr * buf``
of the rounded buffer); adding the fp32 step to the fp16 param instead drifts by a few ulps in a handful
of steps.
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

_LOW = (torch.float16, torch.bfloat16)

TUNING = PlanTuning({"chunk": 16384, "block": 4096, "num_warps": 8}, clear_plans)

if triton is not None:

    @triton.jit
    def _sgd_range(gp, pp, bp, cp, start, n, wd, momentum, dampening, lr, scale, HAS_WD: tl.constexpr,
                   HAS_MOM: tl.constexpr, FIRST: tl.constexpr, NESTEROV: tl.constexpr, WD_AFTER: tl.constexpr,
                   ROUND_STEP: tl.constexpr, COPY: tl.constexpr, MASKED: tl.constexpr, CHUNK: tl.constexpr,
                   BLOCK: tl.constexpr):
        for i in range(0, CHUNK, BLOCK):
            offs = block_offsets(start, i, BLOCK)
            g = load_f32(gp, offs, n, MASKED) * scale
            p = load_f32(pp, offs, n, MASKED)
            if HAS_WD and not WD_AFTER:
                g = g + wd * p
            if HAS_MOM:
                if FIRST:
                    buf = g
                else:
                    buf = momentum * load_f32(bp, offs, n, MASKED) + (1.0 - dampening) * g
                store(bp, offs, n, buf, MASKED)
                if NESTEROV:
                    g = g + momentum * buf
                else:
                    g = buf
            if HAS_WD and WD_AFTER:
                g = g + wd * p
            upd = -lr * g
            if ROUND_STEP:  # a 16-bit param: the step is rounded to its dtype before the add (Apex)
                upd = upd.to(pp.dtype.element_ty).to(tl.float32)
            p = p + upd
            store(pp, offs, n, p, MASKED)
            if COPY:
                store(cp, offs, n, p, MASKED)

    @triton.jit(do_not_specialize=["T", "C"])
    def _sgd_kernel(ptrs, geo, noop, T, C, wd, momentum, dampening, lr, scale, G_DT: tl.constexpr, P_DT: tl.constexpr,
                    B_DT: tl.constexpr, C_DT: tl.constexpr, L: tl.constexpr, HAS_WD: tl.constexpr,
                    HAS_MOM: tl.constexpr, FIRST: tl.constexpr, NESTEROV: tl.constexpr, WD_AFTER: tl.constexpr,
                    ROUND_STEP: tl.constexpr, SHIFT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
        dampening = tl.cast(dampening, tl.float32)
        lr = tl.cast(lr, tl.float32)
        momentum = tl.cast(momentum, tl.float32)
        scale = tl.cast(scale, tl.float32)
        wd = tl.cast(wd, tl.float32)
        if tl.load(noop) == 0:
            t, j, n = chunk_coords(geo, T, C)
            gp = tensor_ptr(ptrs, T, t, 0, G_DT, SHIFT)
            pp = tensor_ptr(ptrs, T, t, 1, P_DT, SHIFT)
            bp = tensor_ptr(ptrs, T, t, 2, B_DT, SHIFT)
            cp = pp
            if L == 4:
                cp = tensor_ptr(ptrs, T, t, 3, C_DT, SHIFT)
            start = j * CHUNK
            if start + CHUNK <= n:
                _sgd_range(gp, pp, bp, cp, start, n, wd, momentum, dampening, lr, scale, HAS_WD, HAS_MOM, FIRST,
                           NESTEROV, WD_AFTER, ROUND_STEP, L == 4, False, CHUNK, BLOCK)
            else:
                _sgd_range(gp, pp, bp, cp, start, n, wd, momentum, dampening, lr, scale, HAS_WD, HAS_MOM, FIRST,
                           NESTEROV, WD_AFTER, ROUND_STEP, L == 4, True, CHUNK, BLOCK)


def multi_tensor_sgd_ref(chunk_size, noop_flag, tensor_lists, wd, momentum, dampening, lr, nesterov, first_run,
                         wd_after_momentum, scale) -> None:
    """Reference of :func:`multi_tensor_sgd`."""
    copies = tensor_lists[3] if len(tensor_lists) == 4 else [None] * len(tensor_lists[0])
    for g, p, buf, cp in zip(*tensor_lists[:3], copies):
        skip = ref_skip(noop_flag, p.device)
        gf = g.float() * scale
        pf = p.float()
        if wd != 0 and not wd_after_momentum:
            gf = gf + wd * pf
        if momentum != 0:
            bf = gf if first_run else momentum * buf.float() + (1.0 - dampening) * gf
            buf.copy_(torch.where(skip, buf, bf.to(buf.dtype)))
            gf = gf + momentum * bf if nesterov else bf
        if wd != 0 and wd_after_momentum:
            gf = gf + wd * pf
        upd = -lr * gf
        if p.dtype in _LOW:  # the step is rounded to the 16-bit param's dtype before the add (Apex)
            upd = upd.to(p.dtype).float()
        pf = pf + upd
        for dst in (p, cp):
            if dst is not None:
                dst.copy_(torch.where(skip, dst, pf.to(dst.dtype)))


class SGDPlan(ListPlan):
    """``multi_tensor_sgd``'s plan: ``[grads, params, momentum_buffers(, copies)]`` and the update's flags
    (``momentum == 0`` never touches the buffers, which may then stand for anything of the right size)."""

    def __init__(self, op: str, tensor_lists, noop_flag, *, has_wd: bool, has_mom: bool, first_run: bool,
                 nesterov: bool, wd_after: bool, static: tuple[int, ...] = ()) -> None:
        noop_pointer(noop_flag, op)
        self.flags = dict(HAS_WD=bool(has_wd), HAS_MOM=bool(has_mom), FIRST=bool(first_run),
                          NESTEROV=bool(nesterov), WD_AFTER=bool(wd_after))
        self.chunk, self.num_warps, self.block = TUNING["chunk"], TUNING["num_warps"], TUNING["block"]
        super().__init__(op, tensor_lists, (3, 4), tuple(range(1, len(tensor_lists))), static)

    def meta(self, g, kernel, variant) -> dict:
        dts = [TL_DTYPE[d] for d in g.dtypes]
        return dict(G_DT=dts[0], P_DT=dts[1], B_DT=dts[2], C_DT=dts[3] if len(dts) == 4 else dts[1], L=len(dts),
                    **self.flags, ROUND_STEP=g.dtypes[1] in _LOW, CHUNK=self.chunk, BLOCK=self.block)

    def run(self, tabs, noop, wd: float, momentum: float, dampening: float, lr: float, scale: float) -> None:
        """Launch every group; ``noop`` is moved to a group's device when it lives elsewhere."""
        for i, g in enumerate(self.tables.groups):
            if g.C:
                ptab, shift, _ = tabs[i]
                flag = noop if noop.device == g.device else noop.to(g.device)
                self.launch(i, _sgd_kernel, shift)(g.stream(), flag.data_ptr() & 15 == 0, ptab, g.geo, flag, g.T,
                                                   g.C, wd, momentum, dampening, lr, scale)


def multi_tensor_sgd(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, wd: float, momentum: float,
                     dampening: float, lr: float, nesterov: bool, first_run: bool, wd_after_momentum: bool,
                     scale: float) -> None:
    """Apex ``amp_C.multi_tensor_sgd`` (see the module docstring for the update rule)."""
    op = "multi_tensor_sgd"
    if torch.compiler.is_compiling():
        from culmen.ops.multi_tensor.library import sgd_op

        copies = list(tensor_lists[3]) if len(tensor_lists) == 4 else []
        return sgd_op(list(tensor_lists[0]), list(tensor_lists[1]), list(tensor_lists[2]), copies, noop_flag,
                      float(wd), float(momentum), float(dampening), float(lr), bool(nesterov), bool(first_run),
                      bool(wd_after_momentum), float(scale))
    flags = (wd != 0, momentum != 0, bool(first_run), bool(nesterov), bool(wd_after_momentum))
    try:
        flat, sig = signature(tensor_lists)
        key = (op, chunk_size, flags, noop_flag.device, sig)
    except (TypeError, AttributeError, IndexError):
        flat, key = None, None

    def build():
        check_chunk(chunk_size, op)
        return SGDPlan(op, tensor_lists, noop_flag, has_wd=flags[0], has_mom=flags[1], first_run=flags[2],
                       nesterov=flags[3], wd_after=flags[4])

    plan = cached_plan(key, build)
    if not plan.n:
        return
    if not plan.use_kernel:
        return multi_tensor_sgd_ref(chunk_size, noop_flag, tensor_lists, wd, momentum, dampening, lr, nesterov,
                                    first_run, wd_after_momentum, scale)
    tabs, copy_back = plan.pointers(tensor_lists, flat)
    plan.run(tabs, noop_flag, float(wd), float(momentum), float(dampening), float(lr), float(scale))
    finish(copy_back)
