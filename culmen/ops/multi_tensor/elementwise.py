"""``multi_tensor_scale`` and ``multi_tensor_axpby``: Apex's ``amp_C`` elementwise list ops.

Both always write their output and raise the noop flag (set ``noop_flag[0] = 1``) when a checked
input holds an inf or NaN; like Apex, they do not skip work when the flag is already set, so
overflow values propagate into the outputs.
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
    signature,
    triton,
    with_noop_on,
)

if triton is not None:
    import triton.language as tl

    from culmen.ops.multi_tensor.common import block_offsets, chunk_coords, load_f32, store, tensor_ptr

# Elements per program and per block (tuned on H100, bench/notes/multi_tensor.md).
TUNING = PlanTuning({"chunk": 8192, "block": 2048, "num_warps": 8}, clear_plans)

# Kept for callers of the old private name.
_check_chunk = check_chunk


if triton is not None:

    @triton.jit
    def _scale_range(src, dst, start, n, scale, bad, MASKED: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCK: tl.constexpr):
        for i in range(0, CHUNK, BLOCK):
            offs = block_offsets(start, i, BLOCK)
            x = load_f32(src, offs, n, MASKED)
            store(dst, offs, n, x * scale, MASKED)
            bad += x * 0.0  # NaN iff x is inf/NaN: the sum over the chunk flags any
        return bad

    @triton.jit(do_not_specialize=["T", "C"])
    def _scale_kernel(ptrs, geo, noop, T, C, scale, IN_DT: tl.constexpr, OUT_DT: tl.constexpr, SHIFT: tl.constexpr,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
        scale = tl.cast(scale, tl.float32)
        t, j, n = chunk_coords(geo, T, C)
        src = tensor_ptr(ptrs, T, t, 0, IN_DT, SHIFT)
        dst = tensor_ptr(ptrs, T, t, 1, OUT_DT, SHIFT)
        start = j * CHUNK
        bad = tl.zeros([BLOCK], dtype=tl.float32)
        if start + CHUNK <= n:
            bad = _scale_range(src, dst, start, n, scale, bad, False, CHUNK, BLOCK)
        else:
            bad = _scale_range(src, dst, start, n, scale, bad, True, CHUNK, BLOCK)
        s = tl.sum(bad, axis=0)
        if s != s:
            tl.store(noop, 1)

    @triton.jit
    def _axpby_range(xp, yp, outp, start, n, a, b, bad, CHECK: tl.constexpr, MASKED: tl.constexpr,
                     CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        for i in range(0, CHUNK, BLOCK):
            offs = block_offsets(start, i, BLOCK)
            x = load_f32(xp, offs, n, MASKED)
            y = load_f32(yp, offs, n, MASKED)
            store(outp, offs, n, a * x + b * y, MASKED)
            if CHECK == 0:
                bad += x * 0.0
            elif CHECK == 1:
                bad += y * 0.0
            else:
                bad += x * 0.0 + y * 0.0
        return bad

    @triton.jit(do_not_specialize=["T", "C"])
    def _axpby_kernel(ptrs, geo, noop, T, C, a, b, X_DT: tl.constexpr, Y_DT: tl.constexpr, OUT_DT: tl.constexpr,
                      CHECK: tl.constexpr, SHIFT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
        a = tl.cast(a, tl.float32)
        b = tl.cast(b, tl.float32)
        t, j, n = chunk_coords(geo, T, C)
        xp = tensor_ptr(ptrs, T, t, 0, X_DT, SHIFT)
        yp = tensor_ptr(ptrs, T, t, 1, Y_DT, SHIFT)
        outp = tensor_ptr(ptrs, T, t, 2, OUT_DT, SHIFT)
        start = j * CHUNK
        bad = tl.zeros([BLOCK], dtype=tl.float32)
        if start + CHUNK <= n:
            bad = _axpby_range(xp, yp, outp, start, n, a, b, bad, CHECK, False, CHUNK, BLOCK)
        else:
            bad = _axpby_range(xp, yp, outp, start, n, a, b, bad, CHECK, True, CHUNK, BLOCK)
        s = tl.sum(bad, axis=0)
        if s != s:
            tl.store(noop, 1)


def _flag_nonfinite(noop_flag: torch.Tensor, *xs: torch.Tensor) -> None:
    for x in xs:
        noop_flag.masked_fill_(~torch.isfinite(x).all(), 1)


def multi_tensor_scale_ref(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, scale: float) -> None:
    """Reference of :func:`multi_tensor_scale` (fp32 math, one tensor at a time)."""
    for x, out in zip(*tensor_lists):
        xf = x.float()
        _flag_nonfinite(noop_flag, xf)
        out.copy_(xf * scale)


def multi_tensor_axpby_ref(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, a: float, b: float,
                           arg_to_check: int) -> None:
    """Reference of :func:`multi_tensor_axpby`."""
    for x, y, out in zip(*tensor_lists):
        xf, yf = x.float(), y.float()
        if arg_to_check in (-1, 0):
            _flag_nonfinite(noop_flag, xf)
        if arg_to_check in (-1, 1):
            _flag_nonfinite(noop_flag, yf)
        out.copy_(a * xf + b * yf)


class _ElementwisePlan(ListPlan):
    """Plan of ``multi_tensor_scale`` (``[ins, outs]``) / ``multi_tensor_axpby`` (``[xs, ys, outs]``)."""

    def __init__(self, op: str, chunk_size, noop_flag, tensor_lists, arg_to_check: int | None = None) -> None:
        check_chunk(chunk_size, op)
        noop_pointer(noop_flag, op)
        self.axpby = arg_to_check is not None
        if self.axpby and arg_to_check not in (-1, 0, 1):
            raise ValueError(f"{op}: arg_to_check must be -1, 0 or 1, got {arg_to_check!r}")
        self.check = arg_to_check
        self.chunk, self.num_warps, self.block = TUNING["chunk"], TUNING["num_warps"], TUNING["block"]
        super().__init__(op, tensor_lists, 3 if self.axpby else 2, (2,) if self.axpby else (1,))
        self.kernel = _axpby_kernel if self.axpby else _scale_kernel
        # The flag is written in place when it is an int32 tensor on the (only) group's device.
        self.int_flag = noop_flag.dtype == torch.int32

    def meta(self, g, kernel, variant) -> dict:
        dt = [TL_DTYPE[d] for d in g.dtypes]
        if self.axpby:
            return dict(X_DT=dt[0], Y_DT=dt[1], OUT_DT=dt[2], CHECK=self.check, CHUNK=self.chunk, BLOCK=self.block)
        return dict(IN_DT=dt[0], OUT_DT=dt[1], CHUNK=self.chunk, BLOCK=self.block)

    def __call__(self, noop_flag, tensor_lists, flat, scalars: tuple) -> None:
        tabs, copy_back = self.pointers(tensor_lists, flat)
        if self.int_flag and self.single_group(noop_flag.device):
            g = self.tables.groups[0]
            if g.C:
                ptab, shift, _ = tabs[0]
                self.launch(0, self.kernel, shift)(g.stream(), noop_flag.data_ptr() & 15 == 0, ptab, g.geo,
                                                   noop_flag, g.T, g.C, *scalars)
        else:
            for i, (g, (ptab, shift, _)) in enumerate(zip(self.tables.groups, tabs)):
                if g.C:
                    with with_noop_on(noop_flag, g.device) as flag:
                        self.launch(i, self.kernel, shift)(g.stream(), flag.data_ptr() & 15 == 0, ptab, g.geo, flag,
                                                           g.T, g.C, *scalars)
        finish(copy_back)


def _plan(op: str, chunk_size, noop_flag, tensor_lists, arg_to_check=None):
    try:
        flat, sig = signature(tensor_lists)
        key = (op, chunk_size, arg_to_check, noop_flag.dtype, noop_flag.device, sig)
    except (TypeError, AttributeError, IndexError):
        flat, key = None, None
    return flat, cached_plan(key, lambda: _ElementwisePlan(op, chunk_size, noop_flag, tensor_lists, arg_to_check))


def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, scale: float) -> None:
    """``out = in * scale`` for every pair of ``tensor_lists = [inputs, outputs]``.

    Inputs and outputs may have different dtypes (fp16 in, fp32 out); math in fp32. Sets the int32
    ``noop_flag`` to 1 when an input holds inf/NaN. ``chunk_size`` is accepted for Apex compatibility;
    culmen picks its own chunking (results do not depend on it).
    """
    if torch.compiler.is_compiling():
        from culmen.ops.multi_tensor.library import scale_op

        return scale_op(list(tensor_lists[0]), list(tensor_lists[1]), noop_flag, float(scale))
    flat, plan = _plan("multi_tensor_scale", chunk_size, noop_flag, tensor_lists)
    if plan.use_kernel:
        plan(noop_flag, tensor_lists, flat, (float(scale),))
    elif plan.n:
        multi_tensor_scale_ref(chunk_size, noop_flag, tensor_lists, scale)


def multi_tensor_axpby(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, a: float, b: float,
                       arg_to_check: int) -> None:
    """``out = a * x + b * y`` for ``tensor_lists = [xs, ys, outs]`` (fp32 math, any float dtypes).

    ``arg_to_check`` picks which input is checked for inf/NaN: -1 both, 0 ``x``, 1 ``y``; a hit sets
    ``noop_flag`` to 1.
    """
    if torch.compiler.is_compiling():
        from culmen.ops.multi_tensor.library import axpby_op

        return axpby_op(list(tensor_lists[0]), list(tensor_lists[1]), list(tensor_lists[2]), noop_flag, float(a),
                        float(b), int(arg_to_check))
    flat, plan = _plan("multi_tensor_axpby", chunk_size, noop_flag, tensor_lists, arg_to_check)
    if plan.use_kernel:
        plan(noop_flag, tensor_lists, flat, (float(a), float(b)))
    elif plan.n:
        multi_tensor_axpby_ref(chunk_size, noop_flag, tensor_lists, a, b, arg_to_check)

