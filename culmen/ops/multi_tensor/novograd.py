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

from culmen.ops.backend import choose_backend, device_guard
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

TUNING = {"chunk": 8192, "block": 1024, "num_warps": 4, "final_block": 1024}

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

    @triton.jit
    def _ng_partial_kernel(table, noop, partial, T, C, G_DT: tl.constexpr, NORM: tl.constexpr,
                           SHIFT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        c = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        if tl.load(noop) == 0:
            t, j, n = chunk_coords(table, T, C, 3)
            gp = tensor_ptr(table, T, t, 0, G_DT, SHIFT)
            start = j * CHUNK
            if start + CHUNK <= n:
                acc = _ng_norm_range(gp, start, n, acc, NORM, False, CHUNK, BLOCK)
            else:
                acc = _ng_norm_range(gp, start, n, acc, NORM, True, CHUNK, BLOCK)
        if NORM == 0:
            tl.store(partial + c, tl.max(acc, axis=0))
        else:
            tl.store(partial + c, tl.sum(acc, axis=0))

    @triton.jit
    def _ng_blend_kernel(partial, first, norms, idx, noop, alpha, beta, NORM: tl.constexpr, IDX: tl.constexpr,
                         BLOCK: tl.constexpr):
        # Program t reduces the chunks of tensor t in order and blends the result into its moving norm.
        t = tl.program_id(0)
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

    @triton.jit
    def _ng_update_kernel(table, noop, norms, idx, T, C, lr, b1, b3, bc1, bc2, eps, wd, G_DT: tl.constexpr,
                          P_DT: tl.constexpr, M_DT: tl.constexpr, MODE: tl.constexpr, HAS_WD: tl.constexpr,
                          IDX: tl.constexpr, SHIFT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        if tl.load(noop) == 0:
            t, j, n = chunk_coords(table, T, C, 3)
            gp = tensor_ptr(table, T, t, 0, G_DT, SHIFT)
            pp = tensor_ptr(table, T, t, 1, P_DT, SHIFT)
            mp = tensor_ptr(table, T, t, 2, M_DT, SHIFT)
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

    _NG_PARTIAL = FastLauncher(_ng_partial_kernel)
    _NG_BLEND = FastLauncher(_ng_blend_kernel)
    _NG_UPDATE = FastLauncher(_ng_update_kernel)


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


def group_index(indices: list[int], n: int, device: torch.device) -> tuple[torch.Tensor | None, bool]:
    """Device positions of a group's tensors in the caller's per-tensor arrays (None when 0..n-1)."""
    if indices == list(range(n)):
        return None, False
    return torch.tensor(indices, dtype=torch.int64, device=device), True


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
    _check_chunk(chunk_size, op)
    noop_pointer(noop_flag, op)
    if mode not in (0, 1):
        raise ValueError(f"{op}: mode must be 0 (decay inside the moment) or 1 (decoupled), got {mode!r}")
    if norm_type not in (0, 2):
        raise ValueError(f"{op}: norm_type must be 2 (L2) or 0 (inf), got {norm_type!r}")
    n = check_lists(tensor_lists, 3, op)
    if not isinstance(grad_norms, torch.Tensor) or grad_norms.dtype != torch.float32:
        raise TypeError(f"{op}: grad_norms must be a float32 tensor")
    if grad_norms.numel() != n:
        raise ValueError(f"{op}: grad_norms has {grad_norms.numel()} elements for {n} tensors")
    if n == 0:
        return
    check_sizes(tensor_lists, op)
    if grad_norms.device != tensor_lists[0][0].device:
        raise ValueError(f"{op}: grad_norms is on {grad_norms.device} but the tensors are on "
                         f"{tensor_lists[0][0].device}")
    args = (chunk_size, noop_flag, tensor_lists, grad_norms, lr, beta1, beta2, epsilon, step, bias_correction,
            weight_decay, grad_averaging, mode, norm_type)
    if choose_backend(tensor_lists[0][0].device) == "reference":
        return multi_tensor_novograd_ref(*args)
    if not grad_norms.is_contiguous():
        raise ValueError(f"{op}: grad_norms must be contiguous (it is updated in place)")
    bc1, bc2, beta3 = _corrections(beta1, beta2, step, bias_correction, grad_averaging)
    groups, copy_back = plan(tensor_lists, (1, 2), TUNING["chunk"], op)
    for g in groups:
        if g.device != grad_norms.device:
            raise ValueError(f"{op}: all tensors must be on grad_norms' device {grad_norms.device}")
        flag = flag_on(noop_flag, g.device)
        dts = [TL_DTYPE[d] for d in g.dtypes]
        idx, has_idx = group_index(g.indices, n, g.device)
        idx_p = idx if has_idx else grad_norms
        with device_guard(g.device):
            partial = torch.empty(max(g.num_chunks, 1), dtype=torch.float32, device=g.device)
            launch_group(_NG_PARTIAL, g, (g.table, flag, partial, g.num_tensors, g.num_chunks),
                         dict(G_DT=dts[0], NORM=int(norm_type), SHIFT=g.shift, CHUNK=TUNING["chunk"],
                              BLOCK=TUNING["block"]), TUNING["num_warps"])
            first = g.table[3 * g.num_tensors + g.num_tensors:]
            _NG_BLEND((g.num_tensors,), (partial, first, grad_norms, idx_p, flag, float(beta2), 1.0 - float(beta2)),
                      dict(NORM=int(norm_type), IDX=has_idx, BLOCK=TUNING["final_block"]), num_warps=4)
            meta = dict(G_DT=dts[0], P_DT=dts[1], M_DT=dts[2], MODE=int(mode), HAS_WD=weight_decay != 0,
                        IDX=has_idx, SHIFT=g.shift, CHUNK=TUNING["chunk"], BLOCK=TUNING["block"])
            launch_group(_NG_UPDATE, g, (g.table, flag, grad_norms, idx_p, g.num_tensors, g.num_chunks, float(lr),
                                         float(beta1), float(beta3), float(bc1), float(bc2), float(epsilon),
                                         float(weight_decay)), meta, TUNING["num_warps"])
    finish(copy_back)
