"""Adagrad over tensor lists: Apex's ``amp_C.multi_tensor_adagrad``.

``tensor_lists = [grads, params, state_sums]``; one launch per group. Math in fp32:
mode 0 (L2): ``g += wd p; h += g^2; p -= lr g / (sqrt(h) + eps)``;
mode 1 (decoupled): ``h += g^2; p -= lr (g / (sqrt(h) + eps) + wd p)``.
Unlike Apex, whose Adagrad kernel ignores the noop flag, nothing is written while it is set (the
culmen rule for every update op: a flagged overflow never reaches the parameters).
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

TUNING = {"chunk": 8192, "block": 1024, "num_warps": 4}

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

    @triton.jit
    def _adagrad_kernel(table, noop, T, C, lr, eps, wd, G_DT: tl.constexpr, P_DT: tl.constexpr,
                        H_DT: tl.constexpr, MODE: tl.constexpr, HAS_WD: tl.constexpr, SHIFT: tl.constexpr,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        if tl.load(noop) == 0:
            t, j, n = chunk_coords(table, T, C, 3)
            gp = tensor_ptr(table, T, t, 0, G_DT, SHIFT)
            pp = tensor_ptr(table, T, t, 1, P_DT, SHIFT)
            hp = tensor_ptr(table, T, t, 2, H_DT, SHIFT)
            start = j * CHUNK
            if start + CHUNK <= n:
                _adagrad_range(gp, pp, hp, start, n, lr, eps, wd, MODE, HAS_WD, False, CHUNK, BLOCK)
            else:
                _adagrad_range(gp, pp, hp, start, n, lr, eps, wd, MODE, HAS_WD, True, CHUNK, BLOCK)

    _ADAGRAD = FastLauncher(_adagrad_kernel)


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
    _check_chunk(chunk_size, op)
    noop_pointer(noop_flag, op)
    if mode not in (0, 1):
        raise ValueError(f"{op}: mode must be 0 (L2) or 1 (decoupled weight decay), got {mode!r}")
    if check_lists(tensor_lists, 3, op) == 0:
        return
    check_sizes(tensor_lists, op)
    if choose_backend(tensor_lists[0][0].device) == "reference":
        return multi_tensor_adagrad_ref(chunk_size, noop_flag, tensor_lists, lr, epsilon, mode, weight_decay)
    groups, copy_back = plan(tensor_lists, (1, 2), TUNING["chunk"], op)
    for g in groups:
        flag = flag_on(noop_flag, g.device)
        dts = [TL_DTYPE[d] for d in g.dtypes]
        meta = dict(G_DT=dts[0], P_DT=dts[1], H_DT=dts[2], MODE=int(mode), HAS_WD=weight_decay != 0,
                    SHIFT=g.shift, CHUNK=TUNING["chunk"], BLOCK=TUNING["block"])
        launch_group(_ADAGRAD, g, (g.table, flag, g.num_tensors, g.num_chunks, float(lr), float(epsilon),
                                   float(weight_decay)), meta, TUNING["num_warps"])
    finish(copy_back)
