"""L2 norms of tensor lists: ``multi_tensor_l2norm`` and its ``_mp``, ``_scale`` and ``unscale_`` forms.

Two launches per group: one program per chunk writes the chunk's fp32 sum of squares; a second
launch sums them in a fixed order (one program per tensor for the per-tensor norms, one more for
the global norm), so the result is deterministic run to run. A cached call on one device allocates
one buffer (norm, per-tensor norms and the partial sums) and returns views of it.
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
    signature,
    triton,
    with_noop_on,
)
from culmen.ops.multi_tensor.elementwise import _flag_nonfinite

if triton is not None:
    import triton.language as tl

    from culmen.ops.multi_tensor.common import block_offsets, chunk_coords, load_f32, store, tensor_ptr

TUNING = PlanTuning({"chunk": 8192, "block": 2048, "num_warps": 8, "final_block": 1024}, clear_plans)

# MODE of the partial-sum kernel.
_PLAIN, _SKIP_IF_NOOP, _SCALE_OUT, _UNSCALE = 0, 1, 2, 3
_F32 = torch.float32

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

    @triton.jit(do_not_specialize=["T", "C", "poff"])
    def _sumsq_kernel(ptrs, geo, noop, out, inv_scale, T, C, poff, scale, X_DT: tl.constexpr, OUT_DT: tl.constexpr,
                      MODE: tl.constexpr, SHIFT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
        scale = tl.cast(scale, tl.float32)
        # Program c writes the sum of squares of chunk c to out[poff + c].
        c = tl.program_id(0)
        t, j, n = chunk_coords(geo, T, C)
        xp = tensor_ptr(ptrs, T, t, 0, X_DT, SHIFT)
        outp = xp
        if MODE == 2:
            outp = tensor_ptr(ptrs, T, t, 1, OUT_DT, SHIFT)
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
        tl.store(out + poff + c, tl.sum(acc, axis=0))
        if MODE == 2:
            s = tl.sum(bad, axis=0)
            if s != s:
                tl.store(noop, 1)

    @triton.jit(do_not_specialize=["T", "PER_T", "poff"])
    def _finalize_kernel(out, geo, T, PER_T, poff, BLOCK: tl.constexpr):
        # Programs p < PER_T sum the chunks of tensor p into out[1 + p]; the last one sums all T tensors'
        # chunks into out[0]. The partial sums are out[poff:].
        p = tl.program_id(0)
        first = geo + T
        lo = tl.load(first + tl.where(p < PER_T, p, 0))
        hi = tl.load(first + tl.where(p < PER_T, p + 1, T))
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(lo, hi, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            acc += tl.load(out + poff + offs, mask=offs < hi, other=0.0)
        s = tl.sqrt_rn(tl.sum(acc, axis=0))  # tl.sqrt is the approximate one on CUDA
        if p < PER_T:
            tl.store(out + 1 + p, s)
        else:
            tl.store(out, s)


def _norm_ref(noop_flag, tensors, per_tensor: bool, mode: int, scale, outs=None):
    device = noop_flag.device
    if mode == _SKIP_IF_NOOP and bool(noop_flag.reshape(-1)[0] != 0):
        norms = [torch.zeros((), dtype=_F32, device=device) for _ in tensors]
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


class NormPlan(ListPlan):
    """Plan of the l2norm family for one signature, mode and ``per_tensor``."""

    def __init__(self, op: str, chunk_size, noop_flag, tensor_lists, per_tensor: bool, mode: int,
                 static: tuple[int, ...] = ()) -> None:
        check_chunk(chunk_size, op)
        noop_pointer(noop_flag, op)
        self.mode, self.per_tensor = mode, per_tensor
        self.chunk, self.num_warps, self.block = TUNING["chunk"], TUNING["num_warps"], TUNING["block"]
        self.final_block = TUNING["final_block"]
        num_lists = 2 if mode == _SCALE_OUT else 1
        super().__init__(op, tensor_lists, num_lists, (1,) if mode == _SCALE_OUT else (), static)
        self.out_device = noop_flag.device
        self.int_flag = noop_flag.dtype == torch.int32

    def meta(self, g, kernel, variant) -> dict:
        if kernel is _finalize_kernel:
            return dict(BLOCK=self.final_block)
        x_dt = TL_DTYPE[g.dtypes[0]]
        out_dt = TL_DTYPE[g.dtypes[1]] if self.mode == _SCALE_OUT else x_dt
        return dict(X_DT=x_dt, OUT_DT=out_dt, MODE=self.mode, CHUNK=self.chunk, BLOCK=self.block)

    def _group(self, i: int, g, tab, flag, scale):
        """``[norm, per-tensor norms (per_tensor only), partial sums]`` of group ``i`` in one fp32 buffer."""
        ptab, shift, _ = tab
        nper = g.T if self.per_tensor else 0
        poff = 1 + nper
        buf = torch.empty(poff + max(g.C, 1), dtype=_F32, device=g.device)
        if g.C == 0:
            buf.zero_()
            return buf
        inv = scale if self.mode == _UNSCALE else buf
        s = 1.0 if self.mode == _UNSCALE else float(scale)
        aligned = (flag.data_ptr() | inv.data_ptr()) & 15 == 0
        stream = g.stream()
        self.launch(i, _sumsq_kernel, shift)(stream, aligned, ptab, g.geo, flag, buf, inv, g.T, g.C, poff, s)
        self.launch(i, _finalize_kernel, None, grid=(nper + 1,), num_warps=4)(stream, True, buf, g.geo, g.T, nper,
                                                                              poff)
        return buf

    def run(self, tabs, noop_flag, scale) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm (1,), per-tensor norms (n,) or (0,))``, fp32 on the noop flag's device."""
        groups = self.tables.groups
        if len(groups) == 1 and groups[0].device == self.out_device and (self.int_flag or self.mode != _SCALE_OUT) \
                and (self.mode != _UNSCALE or scale.device == self.out_device):
            buf = self._group(0, groups[0], tabs[0], noop_flag, scale)
            n = self.n if self.per_tensor else 0
            return buf[:1], buf[1:1 + n]
        totals, pers = [], []
        for i, (g, tab) in enumerate(zip(groups, tabs)):
            with with_noop_on(noop_flag, g.device) as flag, device_guard(g.device):
                buf = self._group(i, g, tab, flag, scale.to(g.device) if self.mode == _UNSCALE else scale)
            totals.append(buf[:1])
            pers.append((g.indices, buf[1:1 + g.T]))
        device = self.out_device
        if len(groups) == 1:
            return totals[0].to(device), (pers[0][1].to(device) if self.per_tensor else
                                          torch.empty(0, dtype=_F32, device=device))
        total = torch.linalg.vector_norm(torch.cat([t.to(device) for t in totals])).reshape(1)
        per = torch.empty(self.n if self.per_tensor else 0, dtype=_F32, device=device)
        if self.per_tensor:
            for idx, p in pers:
                per[torch.tensor(idx, device=device)] = p.to(device)
        return total, per


def _l2norm(op: str, chunk_size, noop_flag, tensor_lists, per_tensor, mode: int, scale=1.0, num_lists: int = 1):
    if torch.compiler.is_compiling():
        from culmen.ops.multi_tensor.library import l2norm_op

        outs = list(tensor_lists[1]) if mode == _SCALE_OUT else []
        return l2norm_op(list(tensor_lists[0]), outs, noop_flag, bool(per_tensor), mode,
                         1.0 if mode == _UNSCALE else float(scale), scale if mode == _UNSCALE else None)
    per_tensor = bool(per_tensor) if per_tensor is not None else False
    try:
        flat, sig = signature(tensor_lists)
        key = (op, chunk_size, per_tensor, noop_flag.dtype, noop_flag.device, sig)
    except (TypeError, AttributeError, IndexError):
        flat, key = None, None
    plan = cached_plan(key, lambda: NormPlan(op, chunk_size, noop_flag, tensor_lists, per_tensor, mode))
    if plan.n == 0:
        z = torch.zeros(1, dtype=_F32, device=noop_flag.device)
        return z, torch.zeros(0, dtype=_F32, device=noop_flag.device)
    if not plan.use_kernel:
        outs = tensor_lists[1] if mode == _SCALE_OUT else None
        return _norm_ref(noop_flag, tensor_lists[0], per_tensor, mode, scale, outs)
    tabs, copy_back = plan.pointers(tensor_lists, flat)
    out = plan.run(tabs, noop_flag, scale)
    finish(copy_back)
    return out


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
