"""L2 norms of tensor lists: ``multi_tensor_l2norm`` and its ``_mp``, ``_scale`` and ``unscale_`` forms.

Two launches per group: one program per chunk writes the chunk's fp32 sum of squares; a second
launch sums them in a fixed order (one program per tensor for the per-tensor norms, one more for
the global norm), so the result is deterministic run to run.
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
    launch_group,
    noop_pointer,
    plan,
    triton,
    with_noop_on,
)
from culmen.ops.multi_tensor.elementwise import _check_chunk, _flag_nonfinite

if triton is not None:
    import triton.language as tl

    from culmen.ops.multi_tensor.common import block_offsets, chunk_coords, load_f32, store, tensor_ptr

TUNING = {"chunk": 8192, "block": 2048, "num_warps": 8, "final_block": 1024}

# MODE of the partial-sum kernel.
_PLAIN, _SKIP_IF_NOOP, _SCALE_OUT, _UNSCALE = 0, 1, 2, 3

if triton is not None:

    @triton.jit
    def _sumsq_range(xp, outp, start, n, scale, acc, bad, MODE: tl.constexpr, MASKED: tl.constexpr,
                     CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        for i in range(0, CHUNK, BLOCK):
            offs = block_offsets(start, i, BLOCK)
            x = load_f32(xp, offs, n, MASKED)
            if MODE == 2:
                store(outp, offs, n, x * scale, MASKED)
                bad += x * 0.0
            if MODE == 3:
                x = x * scale
            acc += x * x
        return acc, bad

    @triton.jit
    def _sumsq_kernel(table, noop, partial, inv_scale, T, C, scale, X_DT: tl.constexpr, OUT_DT: tl.constexpr,
                      MODE: tl.constexpr, L: tl.constexpr, SHIFT: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK: tl.constexpr):
        c = tl.program_id(0)
        t, j, n = chunk_coords(table, T, C, L)
        xp = tensor_ptr(table, T, t, 0, X_DT, SHIFT)
        outp = xp
        if MODE == 2:
            outp = tensor_ptr(table, T, t, 1, OUT_DT, SHIFT)
        if MODE == 3:
            scale = tl.load(inv_scale).to(tl.float32)
        start = j * CHUNK
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        bad = tl.zeros([BLOCK], dtype=tl.float32)
        go = True
        if MODE == 1:
            go = tl.load(noop) == 0
        if go:
            if start + CHUNK <= n:
                acc, bad = _sumsq_range(xp, outp, start, n, scale, acc, bad, MODE, False, CHUNK, BLOCK)
            else:
                acc, bad = _sumsq_range(xp, outp, start, n, scale, acc, bad, MODE, True, CHUNK, BLOCK)
        tl.store(partial + c, tl.sum(acc, axis=0))
        if MODE == 2:
            s = tl.sum(bad, axis=0)
            if s != s:
                tl.store(noop, 1)

    @triton.jit
    def _finalize_kernel(partial, first, per_tensor, total, NT, PER_T, BLOCK: tl.constexpr):
        # Programs p < PER_T sum the chunks of tensor p; the last one sums all NT tensors' chunks.
        p = tl.program_id(0)
        lo = tl.load(first + tl.where(p < PER_T, p, 0))
        hi = tl.load(first + tl.where(p < PER_T, p + 1, NT))
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(lo, hi, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            acc += tl.load(partial + offs, mask=offs < hi, other=0.0)
        s = tl.sqrt(tl.sum(acc, axis=0))
        if p < PER_T:
            tl.store(per_tensor + p, s)
        else:
            tl.store(total, s)

    _SUMSQ = FastLauncher(_sumsq_kernel)
    _FINAL = FastLauncher(_finalize_kernel)


def _norm_ref(noop_flag, tensors, per_tensor: bool, mode: int, scale, outs=None):
    device = noop_flag.device
    if mode == _SKIP_IF_NOOP and bool(noop_flag.reshape(-1)[0] != 0):
        norms = [torch.zeros((), dtype=torch.float32, device=device) for _ in tensors]
    else:
        norms = []
        for i, x in enumerate(tensors):
            xf = x.float()
            if mode == _SCALE_OUT:
                _flag_nonfinite(noop_flag, xf)
                outs[i].copy_(xf * scale)
            if mode == _UNSCALE:
                xf = xf * scale.to(xf.device).float()
            norms.append(torch.linalg.vector_norm(xf).to(device))
    per = torch.stack(norms) if norms else torch.zeros(0, device=device)
    total = torch.linalg.vector_norm(per).reshape(1)
    return total, (per if per_tensor else torch.empty(0, device=device))


def _l2norm(op: str, chunk_size, noop_flag, tensor_lists, per_tensor, mode: int, scale=1.0, num_lists: int = 1):
    if torch.compiler.is_compiling():
        from culmen.ops.multi_tensor.library import l2norm_op

        outs = list(tensor_lists[1]) if mode == _SCALE_OUT else []
        return l2norm_op(list(tensor_lists[0]), outs, noop_flag, bool(per_tensor), mode,
                         1.0 if mode == _UNSCALE else float(scale), scale if mode == _UNSCALE else None)
    _check_chunk(chunk_size, op)
    noop_pointer(noop_flag, op)
    per_tensor = bool(per_tensor) if per_tensor is not None else False
    n = check_lists(tensor_lists, num_lists, op)
    if n == 0:
        z = torch.zeros(1, dtype=torch.float32, device=noop_flag.device)
        return z, torch.zeros(0, dtype=torch.float32, device=noop_flag.device)
    check_sizes(tensor_lists, op)
    outs = tensor_lists[1] if mode == _SCALE_OUT else None
    if choose_backend(tensor_lists[0][0].device) == "reference":
        return _norm_ref(noop_flag, tensor_lists[0], per_tensor, mode, scale, outs)
    groups, copy_back = plan(tensor_lists, (1,) if mode == _SCALE_OUT else (), TUNING["chunk"], op)
    totals, pers = [], []
    for g in groups:
        with with_noop_on(noop_flag, g.device) as flag, device_guard(g.device):
            partial = torch.empty(max(g.num_chunks, 1), dtype=torch.float32, device=g.device)
            per = torch.empty(g.num_tensors, dtype=torch.float32, device=g.device)
            total = torch.empty(1, dtype=torch.float32, device=g.device)
            inv = scale if mode == _UNSCALE else partial
            s = 1.0 if mode == _UNSCALE else float(scale)
            out_dt = TL_DTYPE[g.dtypes[1]] if mode == _SCALE_OUT else TL_DTYPE[g.dtypes[0]]
            meta = dict(X_DT=TL_DTYPE[g.dtypes[0]], OUT_DT=out_dt, MODE=mode, L=num_lists, SHIFT=g.shift,
                        CHUNK=TUNING["chunk"], BLOCK=TUNING["block"])
            launch_group(_SUMSQ, g, (g.table, flag, partial, inv, g.num_tensors, g.num_chunks, s), meta,
                         TUNING["num_warps"])
            first = g.table[num_lists * g.num_tensors + g.num_tensors:]
            nprog = g.num_tensors + 1 if per_tensor else 1
            if g.num_chunks == 0:
                per.zero_()
                total.zero_()
            else:
                _FINAL((nprog,), (partial, first, per, total, g.num_tensors, g.num_tensors if per_tensor else 0),
                       dict(BLOCK=TUNING["final_block"]), num_warps=4)
            totals.append(total)
            pers.append((g.indices, per))
    finish(copy_back)
    device = noop_flag.device
    if len(groups) == 1:
        total = totals[0].to(device)
        per = pers[0][1].to(device) if per_tensor else torch.empty(0, device=device)
        return total, per
    total = torch.linalg.vector_norm(torch.cat([t.to(device) for t in totals])).reshape(1)
    per = torch.empty(n if per_tensor else 0, dtype=torch.float32, device=device)
    if per_tensor:
        for idx, p in pers:
            per[torch.tensor(idx, device=device)] = p.to(device)
    return total, per


def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, per_tensor: bool | None = False):
    """L2 norm of all tensors of ``tensor_lists = [tensors]`` together, and optionally of each.

    Returns ``(norm, per_tensor_norms)``: a 1-element fp32 tensor, and an fp32 tensor of one norm per
    tensor when ``per_tensor`` (else an empty tensor). Math in fp32 whatever the input dtype.
    """
    return _l2norm("multi_tensor_l2norm", chunk_size, noop_flag, tensor_lists, per_tensor, _PLAIN)


def multi_tensor_l2norm_mp(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, per_tensor: bool | None = False):
    """As :func:`multi_tensor_l2norm`, but does nothing (norms are 0) when ``noop_flag`` is set.

    Used by mixed-precision LAMB, whose noop flag is the grad scaler's ``found_inf``.
    """
    return _l2norm("multi_tensor_l2norm_mp", chunk_size, noop_flag, tensor_lists, per_tensor, _SKIP_IF_NOOP)


def multi_tensor_l2norm_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, scale: float,
                              per_tensor: bool | None = False):
    """``out = in * scale`` for ``tensor_lists = [ins, outs]`` and the L2 norms of the inputs (unscaled).

    Sets ``noop_flag`` when an input holds inf/NaN.
    """
    return _l2norm("multi_tensor_l2norm_scale", chunk_size, noop_flag, tensor_lists, per_tensor, _SCALE_OUT,
                   scale, num_lists=2)


def multi_tensor_unscale_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, inv_scale: torch.Tensor,
                                per_tensor: bool | None = False):
    """L2 norms of ``x * inv_scale`` for ``tensor_lists = [xs]`` (``inv_scale``: a 1-element device tensor).

    The tensors are not modified.
    """
    if not isinstance(inv_scale, torch.Tensor):
        raise TypeError(f"multi_tensor_unscale_l2norm: inv_scale must be a tensor, got {type(inv_scale).__name__}")
    return _l2norm("multi_tensor_unscale_l2norm", chunk_size, noop_flag, tensor_lists, per_tensor, _UNSCALE,
                   inv_scale)
