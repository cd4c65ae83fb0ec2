"""SGD with momentum over tensor lists: Apex's ``amp_C.multi_tensor_sgd``.

``tensor_lists = [grads, params, momentum_buffers]`` or ``[..., model_param_copies]`` (the copies, e.g.
fp16 model weights of fp32 master params, are written in the same pass, as amp O2 does). The update
follows torch.optim.SGD: ``g = scale g (+ wd p)``; ``buf = g`` on the first run, else
``buf = momentum buf + (1 - dampening) g``; ``g = g + momentum buf`` (nesterov) or ``buf``;
``(+ wd p`` when ``wd_after_momentum)``; ``p -= lr g``. Nothing happens when the noop flag is set.
"""

from __future__ import annotations

import torch

from culmen.ops.backend import choose_backend
from culmen.ops.common.launch import FastLauncher
from culmen.ops.multi_tensor.common import (
    TL_DTYPE,
    check_lists,
    check_sizes,
    finish,
    flag_on,
    launch_group,
    noop_pointer,
    plan,
    ref_skip,
    triton,
)
from culmen.ops.multi_tensor.elementwise import _check_chunk

if triton is not None:
    import triton.language as tl

    from culmen.ops.multi_tensor.common import block_offsets, chunk_coords, load_f32, store, tensor_ptr

TUNING = {"chunk": 16384, "block": 4096, "num_warps": 8}

if triton is not None:

    @triton.jit
    def _sgd_range(gp, pp, bp, cp, start, n, wd, momentum, dampening, lr, scale, HAS_WD: tl.constexpr,
                   HAS_MOM: tl.constexpr, FIRST: tl.constexpr, NESTEROV: tl.constexpr, WD_AFTER: tl.constexpr,
                   COPY: tl.constexpr, MASKED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
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
            p = p - lr * g
            store(pp, offs, n, p, MASKED)
            if COPY:
                store(cp, offs, n, p, MASKED)

    @triton.jit
    def _sgd_kernel(table, noop, T, C, wd, momentum, dampening, lr, scale, G_DT: tl.constexpr, P_DT: tl.constexpr,
                    B_DT: tl.constexpr, C_DT: tl.constexpr, L: tl.constexpr, HAS_WD: tl.constexpr,
                    HAS_MOM: tl.constexpr, FIRST: tl.constexpr, NESTEROV: tl.constexpr, WD_AFTER: tl.constexpr,
                    SHIFT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        if tl.load(noop) == 0:
            t, j, n = chunk_coords(table, T, C, L)
            gp = tensor_ptr(table, T, t, 0, G_DT, SHIFT)
            pp = tensor_ptr(table, T, t, 1, P_DT, SHIFT)
            bp = tensor_ptr(table, T, t, 2, B_DT, SHIFT)
            cp = pp
            if L == 4:
                cp = tensor_ptr(table, T, t, 3, C_DT, SHIFT)
            start = j * CHUNK
            if start + CHUNK <= n:
                _sgd_range(gp, pp, bp, cp, start, n, wd, momentum, dampening, lr, scale, HAS_WD, HAS_MOM, FIRST,
                           NESTEROV, WD_AFTER, L == 4, False, CHUNK, BLOCK)
            else:
                _sgd_range(gp, pp, bp, cp, start, n, wd, momentum, dampening, lr, scale, HAS_WD, HAS_MOM, FIRST,
                           NESTEROV, WD_AFTER, L == 4, True, CHUNK, BLOCK)

    _SGD = FastLauncher(_sgd_kernel)


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
        pf = pf - lr * gf
        for dst in (p, cp):
            if dst is not None:
                dst.copy_(torch.where(skip, dst, pf.to(dst.dtype)))


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
    _check_chunk(chunk_size, op)
    noop_pointer(noop_flag, op)
    if check_lists(tensor_lists, (3, 4), op) == 0:
        return
    check_sizes(tensor_lists, op)
    args = (chunk_size, noop_flag, tensor_lists, wd, momentum, dampening, lr, nesterov, first_run,
            wd_after_momentum, scale)
    if choose_backend(tensor_lists[0][0].device) == "reference":
        return multi_tensor_sgd_ref(*args)
    groups, copy_back = plan(tensor_lists, tuple(range(1, len(tensor_lists))), TUNING["chunk"], op)
    for g in groups:
        flag = flag_on(noop_flag, g.device)
        dts = [TL_DTYPE[d] for d in g.dtypes]
        meta = dict(G_DT=dts[0], P_DT=dts[1], B_DT=dts[2], C_DT=dts[3] if len(dts) == 4 else dts[1], L=len(dts),
                    HAS_WD=wd != 0, HAS_MOM=momentum != 0, FIRST=bool(first_run), NESTEROV=bool(nesterov),
                    WD_AFTER=bool(wd_after_momentum), SHIFT=g.shift, CHUNK=TUNING["chunk"], BLOCK=TUNING["block"])
        launch_group(_SGD, g, (g.table, flag, g.num_tensors, g.num_chunks, float(wd), float(momentum),
                               float(dampening), float(lr), float(scale)), meta, TUNING["num_warps"])
    finish(copy_back)
