"""Adam / AdamW over tensor lists: ``multi_tensor_adam`` and its capturable and master-weight forms.

One kernel serves every variant (constexpr switches): ``lr`` and ``step`` as host numbers or device
tensors (CUDA-graph capturable, no host sync), gradient unscaling by a host number or a device tensor
(GradScaler's inverse scale), and fp32 master weights for 16-bit params. Every update skips its work
when the noop flag (int32 overflow flag, or the grad scaler's float ``found_inf``) is non-zero.
"""

from __future__ import annotations

import torch

from culmen.ops.backend import choose_backend
from culmen.ops.common.launch import FastLauncher
from culmen.ops.multi_tensor.common import (
    TL_DTYPE,
    bias_corrections,
    check_lists,
    check_sizes,
    finish,
    flag_on,
    launch_group,
    noop_pointer,
    plan,
    ref_skip,
    scalar_f32,
    triton,
)
from culmen.ops.multi_tensor.elementwise import _check_chunk

if triton is not None:
    import triton.language as tl

    from culmen.ops.multi_tensor.common import block_offsets, chunk_coords, load_f32, store, tensor_ptr

TUNING = {"chunk": 8192, "block": 2048, "num_warps": 8}

ADAM_MODE_L2, ADAM_MODE_ADAMW = 0, 1

if triton is not None:

    @triton.jit
    def _adam_range(gp, pp, mp, vp, qp, start, n, lr, b1, b2, eps, bc1, bc2, wd, inv,
                    MODE: tl.constexpr, MASTER: tl.constexpr, HAS_INV: tl.constexpr, MASKED: tl.constexpr,
                    CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        for i in range(0, CHUNK, BLOCK):
            offs = block_offsets(start, i, BLOCK)
            g = load_f32(gp, offs, n, MASKED)
            if HAS_INV:
                g = g * inv
            if MASTER:
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
            if MASTER:
                store(qp, offs, n, p, MASKED)
            store(pp, offs, n, p, MASKED)

    @triton.jit
    def _adam_kernel(table, noop, lr_ptr, step_ptr, inv_ptr, T, C, lr, b1, b2, eps, bc1, bc2, wd, inv,
                     G_DT: tl.constexpr, P_DT: tl.constexpr, M_DT: tl.constexpr, V_DT: tl.constexpr,
                     Q_DT: tl.constexpr, L: tl.constexpr, MODE: tl.constexpr, LR_T: tl.constexpr,
                     STEP_T: tl.constexpr, INV: tl.constexpr, BIAS_CORR: tl.constexpr, SHIFT: tl.constexpr,
                     CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        if tl.load(noop) == 0:
            t, j, n = chunk_coords(table, T, C, L)
            gp = tensor_ptr(table, T, t, 0, G_DT, SHIFT)
            pp = tensor_ptr(table, T, t, 1, P_DT, SHIFT)
            mp = tensor_ptr(table, T, t, 2, M_DT, SHIFT)
            vp = tensor_ptr(table, T, t, 3, V_DT, SHIFT)
            qp = pp
            if L == 5:
                qp = tensor_ptr(table, T, t, 4, Q_DT, SHIFT)
            if LR_T:
                lr = tl.load(lr_ptr).to(tl.float32)
            if STEP_T:
                if BIAS_CORR:
                    s = tl.load(step_ptr).to(tl.float32)
                    bc1 = 1.0 - tl.exp2(s * tl.log2(b1))
                    bc2 = 1.0 - tl.exp2(s * tl.log2(b2))
            if INV == 2:
                inv = tl.load(inv_ptr).to(tl.float32)
            start = j * CHUNK
            if start + CHUNK <= n:
                _adam_range(gp, pp, mp, vp, qp, start, n, lr, b1, b2, eps, bc1, bc2, wd, inv, MODE, L == 5,
                            INV != 0, False, CHUNK, BLOCK)
            else:
                _adam_range(gp, pp, mp, vp, qp, start, n, lr, b1, b2, eps, bc1, bc2, wd, inv, MODE, L == 5,
                            INV != 0, True, CHUNK, BLOCK)

    _ADAM = FastLauncher(_adam_kernel)


def adam_ref(tensor_lists, *, lr, beta1: float, beta2: float, eps: float, step, mode: int, bias_correction: bool,
             weight_decay: float, noop_flag: torch.Tensor, inv_scale=None) -> None:
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
            gf = gf * scalar_f32(inv_scale, dev)
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
        for dst, val in ((m, mf), (v, vf), (p, pf), (q, pf)):
            if dst is not None:
                dst.copy_(torch.where(skip, dst, val.to(dst.dtype)))


def adam_update(tensor_lists, *, lr, beta1: float, beta2: float, eps: float, step, mode: int,
                bias_correction: bool, weight_decay: float, noop_flag: torch.Tensor, inv_scale=None,
                op: str = "adam_update") -> None:
    """One Adam (``mode=0``, L2) or AdamW (``mode=1``, decoupled) step over ``[g, p, m, v(, p_master)]``.

    ``lr`` and ``step`` are numbers or 1-element device tensors (capturable: no host sync), ``inv_scale``
    ``None``, a number or a device tensor multiplying the gradients. With five lists the fp32 masters
    are updated and copied into the (16-bit) params. Nothing happens where ``noop_flag`` is non-zero.
    Math in fp32: ``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g^2``;
    ``p -= lr * ((m / bc1) / (sqrt(v / bc2) + eps) + [AdamW] wd p)``.
    """
    if torch.compiler.is_compiling():
        from culmen.ops.multi_tensor.library import adam_via_op

        return adam_via_op(tensor_lists, lr=lr, beta1=beta1, beta2=beta2, eps=eps, step=step, mode=mode,
                           bias_correction=bias_correction, weight_decay=weight_decay, noop_flag=noop_flag,
                           inv_scale=inv_scale)
    n = check_lists(tensor_lists, (4, 5), op)
    noop_pointer(noop_flag, op)
    if mode not in (0, 1):
        raise ValueError(f"{op}: mode must be 0 (Adam, L2) or 1 (AdamW), got {mode!r}")
    if n == 0:
        return
    check_sizes(tensor_lists, op)
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, step=step, mode=mode, bias_correction=bias_correction,
              weight_decay=weight_decay, noop_flag=noop_flag, inv_scale=inv_scale)
    if choose_backend(tensor_lists[0][0].device) == "reference":
        return adam_ref(tensor_lists, **kw)
    groups, copy_back = plan(tensor_lists, tuple(range(1, len(tensor_lists))), TUNING["chunk"], op)
    lr_t = isinstance(lr, torch.Tensor)
    step_t = isinstance(step, torch.Tensor)
    inv_mode = 0 if inv_scale is None else (2 if isinstance(inv_scale, torch.Tensor) else 1)
    if bias_correction and not step_t:
        bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    else:
        bc1 = bc2 = 1.0
    for g in groups:
        dev = g.device
        flag = flag_on(noop_flag, dev)
        lr_p = lr.to(dev) if lr_t else flag
        step_p = step.to(dev) if step_t else flag
        inv_p = inv_scale.to(dev) if inv_mode == 2 else flag
        dts = [TL_DTYPE[d] for d in g.dtypes]
        meta = dict(G_DT=dts[0], P_DT=dts[1], M_DT=dts[2], V_DT=dts[3], Q_DT=dts[4] if len(dts) == 5 else dts[1],
                    L=len(dts), MODE=mode, LR_T=lr_t, STEP_T=step_t, INV=inv_mode, BIAS_CORR=bool(bias_correction),
                    SHIFT=g.shift, CHUNK=TUNING["chunk"], BLOCK=TUNING["block"])
        args = (g.table, flag, lr_p, step_p, inv_p, g.num_tensors, g.num_chunks,
                0.0 if lr_t else float(lr), float(beta1), float(beta2), float(eps), float(bc1), float(bc2),
                float(weight_decay), float(inv_scale) if inv_mode == 1 else 1.0)
        launch_group(_ADAM, g, args, meta, TUNING["num_warps"])
    finish(copy_back)


def multi_tensor_adam(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float, beta1: float, beta2: float,
                      epsilon: float, step: int, mode: int, bias_correction: int, weight_decay: float) -> None:
    """Apex ``amp_C.multi_tensor_adam``: ``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]``."""
    _check_chunk(chunk_size, "multi_tensor_adam")
    adam_update(tensor_lists, lr=lr, beta1=beta1, beta2=beta2, eps=epsilon, step=step, mode=mode,
                bias_correction=bool(bias_correction), weight_decay=weight_decay, noop_flag=noop_flag,
                op="multi_tensor_adam")


def multi_tensor_adam_capturable(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: torch.Tensor,
                                 beta1: float, beta2: float, epsilon: float, step: torch.Tensor, mode: int,
                                 bias_correction: int, weight_decay: float, inv_scale: torch.Tensor) -> None:
    """Apex ``amp_C.multi_tensor_adam_capturable``: ``lr``, ``step`` and ``inv_scale`` are device tensors."""
    _check_chunk(chunk_size, "multi_tensor_adam_capturable")
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


