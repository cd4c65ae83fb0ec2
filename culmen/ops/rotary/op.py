"""Custom ops ``culmen::rotary`` (out of place) / ``culmen::rotary_`` (in place), their autograd, and
``rotary``, the op-level entry point that Apex's fused RoPE and flash_attn's rotary layers call.

The backward of a rotation is the transposed rotation (``conjugate``), the same kernel. It always
writes a fresh gradient tensor, also for in-place forwards: flash_attn rotates the incoming gradient
in place, which corrupts it when autograd shares it with another consumer.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.graph import increment_version

from culmen.ops.backend import choose_backend, register_op
from culmen.ops.rotary.reference import rotary_fwd_ref

register_op("rotary", "position", "rotary embedding (NeoX/GPT-J, partial, offsets, packed, 2-D), out of place")
register_op("rotary_", "position", "rotary embedding in place (no-grad / inference form of culmen::rotary)")

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTS = (torch.int32, torch.int64)
LAYOUTS = ("like", "contiguous", "swap01")
"""Output layouts: ``like`` = ``empty_like(x)``; ``contiguous`` in x's dim order; ``swap01``
contiguous with dims 0 and 1 swapped (Apex's sbhd output seen through a bshd view)."""


def _like(x: Tensor, layout: str) -> Tensor:
    """An empty tensor of x's shape and dtype in ``layout`` (one of ``LAYOUTS``)."""
    if layout == "contiguous":
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if layout == "swap01":
        return torch.empty((x.shape[1], x.shape[0], *x.shape[2:]), dtype=x.dtype, device=x.device).transpose(0, 1)
    return torch.empty_like(x)


def _alloc(x: Tensor, layout: str) -> Tensor:
    """Every new output of the real ops comes from here (tests poison it to catch forgotten elements)."""
    return _like(x, layout)


def _impl(x, out, cos, sin, cos2, sin2, seqlen_offsets, cu_seqlens, offset, max_seqlen, interleaved, conjugate,
          full_table, img_w, copy_rest) -> None:
    """Rotate ``x`` into ``out`` on the chosen backend (see ``launch.rotary_fwd`` for the contract)."""
    if x.numel() == 0:
        return
    args = (x, out, cos, sin, cos2, sin2, seqlen_offsets, cu_seqlens, offset, max_seqlen, interleaved, conjugate,
            full_table, img_w, copy_rest)
    # fp64 takes the reference, which computes in fp64 (the kernel computes in fp32).
    if choose_backend(x.device) == "triton" and x.dtype != torch.float64:
        from culmen.ops.rotary.launch import rotary_fwd

        rotary_fwd(*args)
    else:
        rotary_fwd_ref(*args)


@torch.library.custom_op("culmen::rotary", mutates_args=())
def rotary_op(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    cos2: Tensor | None,
    sin2: Tensor | None,
    seqlen_offsets: Tensor | None,
    cu_seqlens: Tensor | None,
    offset: int,
    max_seqlen: int,
    interleaved: bool,
    conjugate: bool,
    full_table: bool,
    img_w: int,
    out_layout: str,
) -> Tensor:
    """Out-of-place rotation; columns past the rotary ones are copied. Returns a new tensor like ``x``."""
    out = _alloc(x, out_layout)
    _impl(x, out, cos, sin, cos2, sin2, seqlen_offsets, cu_seqlens, offset, max_seqlen, interleaved, conjugate,
          full_table, img_w, True)
    return out


@rotary_op.register_fake
def _(x, cos, sin, cos2, sin2, seqlen_offsets, cu_seqlens, offset, max_seqlen, interleaved, conjugate, full_table,
      img_w, out_layout):
    return _like(x, out_layout)


@torch.library.custom_op("culmen::rotary_", mutates_args=("x",))
def rotary_inplace_op(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    cos2: Tensor | None,
    sin2: Tensor | None,
    seqlen_offsets: Tensor | None,
    cu_seqlens: Tensor | None,
    offset: int,
    max_seqlen: int,
    interleaved: bool,
    conjugate: bool,
    full_table: bool,
    img_w: int,
) -> None:
    """In-place rotation of ``x``'s rotary columns (the others are untouched)."""
    _impl(x, x, cos, sin, cos2, sin2, seqlen_offsets, cu_seqlens, offset, max_seqlen, interleaved, conjugate,
          full_table, img_w, False)


@rotary_inplace_op.register_fake
def _(x, cos, sin, cos2, sin2, seqlen_offsets, cu_seqlens, offset, max_seqlen, interleaved, conjugate, full_table,
      img_w):
    return None


_ARGS = ("x", "cos", "sin", "cos2", "sin2", "seqlen_offsets", "cu_seqlens", "offset", "max_seqlen", "interleaved",
         "conjugate", "full_table", "img_w", "out_layout")


def _setup_context(ctx, inputs, output):
    a = dict(zip(_ARGS, inputs))
    ctx.save_for_backward(a["cos"], a["sin"], a["cos2"], a["sin2"], a["seqlen_offsets"], a["cu_seqlens"])
    ctx.meta = (a["offset"], a["max_seqlen"], a["interleaved"], a["conjugate"], a["full_table"], a["img_w"])


def _backward(ctx, dy):
    cos, sin, cos2, sin2, offs, cu = ctx.saved_tensors
    offset, max_seqlen, interleaved, conjugate, full_table, img_w = ctx.meta
    dx = rotary_op(dy, cos, sin, cos2, sin2, offs, cu, offset, max_seqlen, interleaved, not conjugate, full_table,
                   img_w, "like")
    return (dx,) + (None,) * (len(_ARGS) - 1)


torch.library.register_autograd("culmen::rotary", _backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# The eager path: a per-metadata plan, then the kernel (no torch.library dispatch)
# ---------------------------------------------------------------------------------------------


class _Plan:
    """What ``rotary`` derived from one call's metadata (types, shapes, strides, dtypes and devices of
    the tensors, the flags): the checks passed, the normalized arguments and the launch geometries.
    Calls with the same metadata reuse it and skip the checks; it holds no tensors."""

    __slots__ = ("S", "interleaved", "conjugate", "full_table", "img_w", "inplace", "layout", "seq_first", "rows",
                 "check_rows", "fix_tables", "fp64", "empty", "device", "launches")

    def __init__(self, x: Tensor, cos: Tensor, S: int, interleaved: bool, conjugate: bool, full_table: bool,
                 img_w: int, inplace: bool, layout: str, seq_first: bool, check_rows: bool, fix_tables: bool) -> None:
        self.S, self.interleaved, self.conjugate, self.full_table = S, interleaved, conjugate, full_table
        self.seq_first = seq_first
        self.img_w, self.inplace, self.layout = img_w, inplace, layout
        self.rows, self.check_rows, self.fix_tables = cos.shape[0], check_rows, fix_tables
        self.fp64 = x.dtype == torch.float64
        self.empty = x.numel() == 0
        self.device = x.device
        self.launches: dict = {}


_PLANS: dict = {}
_MAX_PLANS = 512


def _run(plan: _Plan, x: Tensor, out: Tensor, tabs: tuple, offset: int, conjugate: bool, copy_rest: bool) -> None:
    """Rotate ``x`` into ``out`` for ``plan`` on the chosen backend; ``tabs`` = (cos, sin, cos2, sin2,
    seqlen_offsets tensor, cu_seqlens) as normalized by ``_normalize``."""
    if plan.empty:
        return
    # fp64 takes the reference, which computes in fp64 (the kernel computes in fp32).
    if plan.fp64 or choose_backend(plan.device) != "triton":
        if plan.seq_first:
            x, out = x.transpose(0, 1), out.transpose(0, 1)
        rotary_fwd_ref(x, out, *tabs, offset, plan.S, plan.interleaved, conjugate, plan.full_table, plan.img_w,
                       copy_rest)
        return
    key = (conjugate, copy_rest, x.stride(), out.stride(), x.dtype, out.dtype)
    launch = plan.launches.get(key)
    if launch is None:
        from culmen.ops.rotary.launch import Launch

        launch = plan.launches[key] = Launch(x, out, tabs[0], tabs[2], tabs[5], plan.S, plan.interleaved, conjugate,
                                             plan.full_table, plan.img_w, copy_rest, tabs[4] is not None,
                                             plan.seq_first)
    launch(x, out, *tabs, offset)


class _RotaryFn(torch.autograd.Function):
    """Eager autograd: the plan's kernel called directly, with a true in-place forward (``mark_dirty``)
    that the functional custom op cannot express. Few arguments: ``apply`` costs host time per argument."""

    @staticmethod
    def forward(ctx, x, plan, tabs, offset):
        if plan.inplace:
            _run(plan, x, x, tabs, offset, plan.conjugate, False)
            ctx.mark_dirty(x)
            out = x
        else:
            out = _alloc(x, plan.layout)
            _run(plan, x, out, tabs, offset, plan.conjugate, True)
        ctx.save_for_backward(*tabs)
        ctx.plan, ctx.offset = plan, offset
        return out

    @staticmethod
    def backward(ctx, dy):
        plan = ctx.plan
        dx = _alloc(dy, "like")
        _run(plan, dy, dx, ctx.saved_tensors, ctx.offset, not plan.conjugate, True)
        return dx, None, None, None


# ---------------------------------------------------------------------------------------------
# The op-level entry point
# ---------------------------------------------------------------------------------------------


def _check_table(name: str, t: Tensor, x: Tensor) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D (positions, columns), got shape {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    return _unit_columns(t)


def _unit_columns(t: Tensor | None) -> Tensor | None:
    return t if t is None or t.stride(1) == 1 or t.shape[1] <= 1 else t.contiguous()


def _check_pair(cname: str, sname: str, c: Tensor, s: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    c, s = _check_table(cname, c, x), _check_table(sname, s, x)
    if c.shape != s.shape:
        raise ValueError(f"{cname} and {sname} must have the same shape, got {tuple(c.shape)} and {tuple(s.shape)}")
    return c, s


def _normalize(x, cos, sin, cos2, sin2, seqlen_offsets, cu_seqlens, max_seqlen, full_table, img_w, out_layout,
               seq_first):
    """Check the arguments of ``rotary``; return ``(cos, sin, cos2, sin2, offsets tensor or None,
    cu_seqlens, offset, S)`` with the tables' columns unit-stride and the index tensors contiguous."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"x must be a floating-point tensor (float16/bfloat16/float32/float64), got {x.dtype}")
    if out_layout not in LAYOUTS:
        raise ValueError(f"out_layout must be one of {LAYOUTS}, got {out_layout!r}")
    cos, sin = _check_pair("cos", "sin", cos, sin, x)
    varlen = cu_seqlens is not None
    if varlen:
        if seq_first:
            raise ValueError("seq_first does not apply to packed sequences (cu_seqlens)")
        if x.dim() != 3:
            raise ValueError(f"with cu_seqlens, x must be (total_seqlen, nheads, headdim), got shape {tuple(x.shape)}")
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype not in _INTS or cu_seqlens.dim() != 1:
            raise TypeError(f"cu_seqlens must be a 1-D int32/int64 tensor, got "
                            f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}")
        if cu_seqlens.numel() < 1 or cu_seqlens.device != x.device:
            raise ValueError(f"cu_seqlens must hold batch + 1 >= 1 entries on {x.device}, got "
                             f"{cu_seqlens.numel()} on {cu_seqlens.device}")
        if max_seqlen is None or int(max_seqlen) < 0:
            raise ValueError(f"cu_seqlens needs max_seqlen (a non-negative int), got {max_seqlen!r}")
        B, S = cu_seqlens.numel() - 1, int(max_seqlen)
        cu_seqlens = cu_seqlens.contiguous()
    else:
        if x.dim() != 4:
            dims = "seqlen, batch" if seq_first else "batch, seqlen"
            raise ValueError(f"x must be ({dims}, nheads, headdim), got shape {tuple(x.shape)}")
        B, S = (x.shape[1], x.shape[0]) if seq_first else (x.shape[0], x.shape[1])
    D = x.shape[-1]
    W = cos.shape[1]
    if full_table and W % 2:
        raise ValueError(f"the rotary dim (cos.shape[1] = {W}) must be even")
    rotary_dim = W if full_table else 2 * W
    if rotary_dim > D:
        raise ValueError(f"rotary_dim ({rotary_dim}) must be <= headdim ({D})")
    offs_t, offset = None, 0
    if isinstance(seqlen_offsets, Tensor):
        if seqlen_offsets.dtype not in _INTS:
            raise TypeError(f"seqlen_offsets must be an int or an int32/int64 tensor, got {seqlen_offsets.dtype}")
        if tuple(seqlen_offsets.shape) != (B,):
            raise ValueError(f"seqlen_offsets must have shape (batch,) = ({B},), got {tuple(seqlen_offsets.shape)}")
        if seqlen_offsets.device != x.device:
            raise ValueError(f"seqlen_offsets is on {seqlen_offsets.device} but x is on {x.device}")
        offs_t = seqlen_offsets.contiguous()
    else:
        offset = int(seqlen_offsets)
    if img_w > 0:
        if cos2 is None or sin2 is None:
            raise ValueError("the 2-D form (img_w > 0) needs cos2 and sin2")
        cos2, sin2 = _check_pair("cos2", "sin2", cos2, sin2, x)
        if cos2.shape[1] != W or 2 * rotary_dim != D:
            raise ValueError(f"the 2-D form rotates headdim/2 columns per axis: need cos/cos2 widths equal to "
                             f"{D // 2 if full_table else D // 4}, got {W} and {cos2.shape[1]}")
    else:
        cos2 = sin2 = None
        if offs_t is None:
            _check_offset(offset, S, cos.shape[0])
    return cos, sin, cos2, sin2, offs_t, cu_seqlens, offset, S


def _check_offset(offset: int, S: int, rows: int) -> None:
    if offset < 0 or offset + S > rows:
        raise ValueError(f"positions seqlen_offsets + seqlen ({offset} + {S}) must lie within the "
                         f"{rows} rows of cos/sin")


def _tkey(t):
    return (type(t), t.shape, t.stride(), t.dtype, t.device)


def rotary(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    cos2: Tensor | None = None,
    sin2: Tensor | None = None,
    seqlen_offsets: int | Tensor = 0,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    interleaved: bool = False,
    inplace: bool = False,
    conjugate: bool = False,
    full_table: bool = False,
    img_w: int = 0,
    out_layout: str = "like",
    seq_first: bool = False,
) -> Tensor:
    """Rotary position embedding of the first ``rotary_dim`` columns of ``x``; differentiable in ``x``.

    Args:
        x: ``(B, S, H, D)`` (any strides), or ``(T, H, D)`` packed when ``cu_seqlens`` is given;
            fp16/bf16/fp32/fp64.
        cos, sin: ``(rows, W)`` tables, any float dtype, one row per position. ``W = rotary_dim / 2``
            (one angle per pair, flash_attn) or with ``full_table`` ``W = rotary_dim`` (one value per
            rotated column, Apex). ``rotary_dim <= D``; the other columns pass through.
        cos2, sin2: the column tables of the 2-D form (``img_w > 0``): columns ``[0, D/2)`` are
            rotated at position ``s // img_w`` with ``cos``/``sin`` and ``[D/2, D)`` at ``s % img_w``.
        seqlen_offsets: int or ``(B,)`` int tensor added to every position of a sequence.
        cu_seqlens: ``(B + 1,)`` int32/int64 sequence starts of packed ``x``; needs ``max_seqlen``.
        interleaved: GPT-J pairs ``(2i, 2i+1)`` instead of GPT-NeoX halves ``(i, i + rotary_dim/2)``.
        inplace: rotate ``x`` itself and return it (columns past ``rotary_dim`` untouched).
        conjugate: apply the inverse (transposed) rotation.
        out_layout: memory layout of a new output, one of ``LAYOUTS`` (in ``x``'s own dim order).
        seq_first: ``x`` is ``(S, B, H, D)`` (Apex's sbhd) instead of ``(B, S, H, D)``.

    Math in fp32 (fp64 for fp64 input); the result has ``x``'s dtype and shape. The tables get no
    gradient (as in flash_attn and Apex).

    Host cost: the checks and the launch geometry are computed once per call signature (types,
    shapes, strides, dtypes, devices, flags) and cached; a repeated call only allocates and launches.
    """
    if torch.compiler.is_compiling():
        if seq_first:  # the custom ops take (B, S, H, D): the same memory through a transposed view
            layout = {"contiguous": "swap01", "swap01": "contiguous"}.get(out_layout, out_layout)
            return _rotary_traced(x.transpose(0, 1), cos, sin, cos2, sin2, seqlen_offsets, cu_seqlens, max_seqlen,
                                  interleaved, inplace, conjugate, full_table, img_w, layout, False).transpose(0, 1)
        return _rotary_traced(x, cos, sin, cos2, sin2, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace,
                              conjugate, full_table, img_w, out_layout, False)
    offs_is_tensor = isinstance(seqlen_offsets, Tensor)
    try:
        key = (_tkey(x), _tkey(cos), _tkey(sin), None if cos2 is None else _tkey(cos2),
               None if sin2 is None else _tkey(sin2), _tkey(seqlen_offsets) if offs_is_tensor else None,
               None if cu_seqlens is None else _tkey(cu_seqlens), max_seqlen, interleaved, inplace, conjugate,
               full_table, img_w, out_layout, seq_first)
        plan = _PLANS.get(key)
    except Exception:  # not tensors, unhashable arguments: the checks below name the problem
        key = plan = None
    if plan is None:
        given = (cos, sin, cos2, sin2)
        cos, sin, cos2, sin2, offs_t, cu_seqlens, offset, S = _normalize(
            x, cos, sin, cos2, sin2, seqlen_offsets, cu_seqlens, max_seqlen, full_table, img_w, out_layout,
            seq_first)
        fixed = any(a is not b for a, b in zip(given, (cos, sin, cos2, sin2)) if b is not None)
        plan = _Plan(x, cos, S, bool(interleaved), bool(conjugate), bool(full_table), int(img_w), bool(inplace),
                     out_layout, bool(seq_first), check_rows=img_w <= 0 and offs_t is None, fix_tables=fixed)
        if key is not None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    else:
        if offs_is_tensor:
            offs_t, offset = seqlen_offsets.contiguous(), 0
        else:
            offs_t, offset = None, int(seqlen_offsets)
            if plan.check_rows:
                _check_offset(offset, plan.S, plan.rows)
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.contiguous()
        if plan.img_w <= 0:
            cos2 = sin2 = None
        if plan.fix_tables:
            cos, sin, cos2, sin2 = _unit_columns(cos), _unit_columns(sin), _unit_columns(cos2), _unit_columns(sin2)
    tabs = (cos, sin, cos2, sin2, offs_t, cu_seqlens)
    if x.requires_grad and torch.is_grad_enabled():
        return _RotaryFn.apply(x, plan, tabs, offset)
    if plan.inplace:
        _run(plan, x, x, tabs, offset, plan.conjugate, False)
        increment_version(x)  # as an in-place PyTorch op would: autograd catches later misuse of saved x
        return x
    out = _alloc(x, plan.layout)
    _run(plan, x, out, tabs, offset, plan.conjugate, True)
    return out


def _rotary_traced(x, cos, sin, cos2, sin2, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace, conjugate,
                   full_table, img_w, out_layout, seq_first):
    """``rotary`` under ``torch.compile``: the ``torch.library`` custom ops, which inductor can trace."""
    cos, sin, cos2, sin2, offs_t, cu_seqlens, offset, S = _normalize(
        x, cos, sin, cos2, sin2, seqlen_offsets, cu_seqlens, max_seqlen, full_table, img_w, out_layout, seq_first)
    args = (cos, sin, cos2, sin2, offs_t, cu_seqlens, offset, S, bool(interleaved), bool(conjugate),
            bool(full_table), int(img_w))
    if not inplace:
        return rotary_op(x, *args, out_layout)
    if torch.is_grad_enabled() and x.requires_grad:
        # Autograd cannot differentiate a mutating custom op: rotate out of place and copy back (the
        # copy is tracked; inductor may re-inplace it).
        x.copy_(rotary_op(x, *args, "like"))
        return x
    rotary_inplace_op(x, *args)
    return x
