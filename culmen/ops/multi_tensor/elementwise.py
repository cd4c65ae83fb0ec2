"""``multi_tensor_scale`` and ``multi_tensor_axpby``: Apex's ``amp_C`` elementwise list ops.

Both always write their output and raise the noop flag (set ``noop_flag[0] = 1``) when a checked
input holds an inf or NaN; like Apex, they do not skip work when the flag is already set, so
overflow values propagate into the outputs.
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
    launch_group,
    noop_pointer,
    plan,
    triton,
    with_noop_on,
)

if triton is not None:
    import triton.language as tl

    from culmen.ops.multi_tensor.common import block_offsets, chunk_coords, load_f32, store, tensor_ptr

# Elements per program and per block (tuned on H100, bench/notes/multi_tensor.md).
TUNING = {"chunk": 8192, "block": 2048, "num_warps": 8}


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

    @triton.jit
    def _scale_kernel(table, noop, T, C, scale, IN_DT: tl.constexpr, OUT_DT: tl.constexpr, SHIFT: tl.constexpr,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        t, j, n = chunk_coords(table, T, C, 2)
        src = tensor_ptr(table, T, t, 0, IN_DT, SHIFT)
        dst = tensor_ptr(table, T, t, 1, OUT_DT, SHIFT)
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

    @triton.jit
    def _axpby_kernel(table, noop, T, C, a, b, X_DT: tl.constexpr, Y_DT: tl.constexpr, OUT_DT: tl.constexpr,
                      CHECK: tl.constexpr, SHIFT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        t, j, n = chunk_coords(table, T, C, 3)
        xp = tensor_ptr(table, T, t, 0, X_DT, SHIFT)
        yp = tensor_ptr(table, T, t, 1, Y_DT, SHIFT)
        outp = tensor_ptr(table, T, t, 2, OUT_DT, SHIFT)
        start = j * CHUNK
        bad = tl.zeros([BLOCK], dtype=tl.float32)
        if start + CHUNK <= n:
            bad = _axpby_range(xp, yp, outp, start, n, a, b, bad, CHECK, False, CHUNK, BLOCK)
        else:
            bad = _axpby_range(xp, yp, outp, start, n, a, b, bad, CHECK, True, CHUNK, BLOCK)
        s = tl.sum(bad, axis=0)
        if s != s:
            tl.store(noop, 1)

    _SCALE = FastLauncher(_scale_kernel)
    _AXPBY = FastLauncher(_axpby_kernel)


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


def _check_chunk(chunk_size, op: str) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"{op}: chunk_size must be a positive int, got {chunk_size!r}")


def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, scale: float) -> None:
    """``out = in * scale`` for every pair of ``tensor_lists = [inputs, outputs]``.

    Inputs and outputs may have different dtypes (fp16 in, fp32 out); math in fp32. Sets the int32
    ``noop_flag`` to 1 when an input holds inf/NaN. ``chunk_size`` is accepted for Apex compatibility;
    culmen picks its own chunking (results do not depend on it).
    """
    op = "multi_tensor_scale"
    if torch.compiler.is_compiling():
        from culmen.ops.multi_tensor.library import scale_op

        return scale_op(list(tensor_lists[0]), list(tensor_lists[1]), noop_flag, float(scale))
    _check_chunk(chunk_size, op)
    noop_pointer(noop_flag, op)
    if check_lists(tensor_lists, 2, op) == 0:
        return
    check_sizes(tensor_lists, op)
    if choose_backend(tensor_lists[0][0].device) == "reference":
        return multi_tensor_scale_ref(chunk_size, noop_flag, tensor_lists, scale)
    groups, copy_back = plan(tensor_lists, (1,), TUNING["chunk"], op)
    for g in groups:
        with with_noop_on(noop_flag, g.device) as flag:
            meta = dict(IN_DT=TL_DTYPE[g.dtypes[0]], OUT_DT=TL_DTYPE[g.dtypes[1]], SHIFT=g.shift,
                        CHUNK=TUNING["chunk"], BLOCK=TUNING["block"])
            launch_group(_SCALE, g, (g.table, flag, g.num_tensors, g.num_chunks, float(scale)), meta,
                         TUNING["num_warps"])
    finish(copy_back)


def multi_tensor_axpby(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, a: float, b: float,
                       arg_to_check: int) -> None:
    """``out = a * x + b * y`` for ``tensor_lists = [xs, ys, outs]`` (fp32 math, any float dtypes).

    ``arg_to_check`` picks which input is checked for inf/NaN: -1 both, 0 ``x``, 1 ``y``; a hit sets
    ``noop_flag`` to 1.
    """
    op = "multi_tensor_axpby"
    if torch.compiler.is_compiling():
        from culmen.ops.multi_tensor.library import axpby_op

        return axpby_op(list(tensor_lists[0]), list(tensor_lists[1]), list(tensor_lists[2]), noop_flag, float(a),
                        float(b), int(arg_to_check))
    _check_chunk(chunk_size, op)
    noop_pointer(noop_flag, op)
    if arg_to_check not in (-1, 0, 1):
        raise ValueError(f"{op}: arg_to_check must be -1, 0 or 1, got {arg_to_check!r}")
    if check_lists(tensor_lists, 3, op) == 0:
        return
    check_sizes(tensor_lists, op)
    if choose_backend(tensor_lists[0][0].device) == "reference":
        return multi_tensor_axpby_ref(chunk_size, noop_flag, tensor_lists, a, b, arg_to_check)
    groups, copy_back = plan(tensor_lists, (2,), TUNING["chunk"], op)
    for g in groups:
        with with_noop_on(noop_flag, g.device) as flag:
            meta = dict(X_DT=TL_DTYPE[g.dtypes[0]], Y_DT=TL_DTYPE[g.dtypes[1]], OUT_DT=TL_DTYPE[g.dtypes[2]],
                        CHECK=arg_to_check, SHIFT=g.shift, CHUNK=TUNING["chunk"], BLOCK=TUNING["block"])
            launch_group(_AXPBY, g, (g.table, flag, g.num_tensors, g.num_chunks, float(a), float(b)), meta,
                         TUNING["num_warps"])
    finish(copy_back)
