"""``rotary``, the op-level entry point of the rotary embedding (Apex's fused RoPE and flash_attn's rotary
layers call it), its eager autograd, and the ``torch.library`` ops ``culmen::rotary`` (out of place) /
``culmen::rotary_`` (in place) that ``torch.compile`` traces.

The call path (DESIGN.md): an eager call builds a key from its signature and looks up a cached
``RotaryPlan`` (validation ran when the plan was built); with autograd recording it goes through
``_RotaryFn`` (a plain ``autograd.Function``), otherwise straight to the plan. Under ``torch.compile``
a dense rotation traces as its PyTorch formula (``reference.rotary_dense_ref``), which Inductor fuses, unless
``culmen.set_compile_fusion(False)``; the other forms (packed sequences, the 2-D form, separate K tables, Apex's
rounded products, other output layouts) are ``triton_op``s whose bodies launch through ``wrap_triton``, so
Inductor launches the kernel itself.

The backward of a rotation is the transposed rotation (``conjugate``), the same kernel. It always
writes a fresh gradient tensor, also for in-place forwards: flash_attn rotates the incoming gradient
in place, which corrupts it when autograd shares it with another consumer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import compile_fusion_enabled, register_op
from culmen.ops.common.launch import traceable_kernels
from culmen.ops.rotary.launch import LAYOUTS, PLANS, RotaryPlan, check_offset_rows, rotary_dim_of
from culmen.ops.rotary.reference import rotary_dense_ref

register_op("rotary", "position", "rotary embedding (NeoX/GPT-J, partial, offsets, packed, 2-D, Q+K), out of place")
register_op("rotary_", "position", "rotary embedding in place (no-grad / inference form of culmen::rotary)")

__all__ = ["LAYOUTS", "rotary", "rotary_planned"]

_bump_version = torch._C._increment_version


# ------------------------------------------------------------------------------------- eager


def _dirty_ok(x: Tensor) -> bool:
    """Whether autograd lets ``x`` be marked as modified in place: not a leaf that requires grad, nor a
    view of one."""
    base = x._base if x._base is not None else x
    return not ((x.is_leaf and x.requires_grad) or (base.is_leaf and base.requires_grad))


class _RotaryFn(torch.autograd.Function):
    """Eager autograd: the plan's kernel called directly. Few arguments: ``apply`` costs host time per
    argument (the tables travel in one tuple: they get no gradient).

    In place, ``x`` is marked dirty where autograd allows it (a true in-place op: later uses of ``x`` or
    of its base see the rotation in their gradients too). A leaf that requires grad, or a view of one,
    cannot be: there the rotation happens in ``x``'s memory and the returned tensor carries the gradient
    back to ``x``, as flash_attn's functions do; ``x``'s version is bumped, so an op that saved ``x``
    earlier raises instead of computing a wrong gradient."""

    @staticmethod
    def forward(ctx, plan, x, tabs, offset):
        out = plan.forward(x, tabs, offset)
        if plan.inplace:
            base = x._base if x._base is not None else x  # (inline _dirty_ok: this is the per-call path)
            # x requires grad here; a leaf view of a tensor that does not (unpad_input's output) is a leaf too
            if x.is_leaf or (base.is_leaf and base.requires_grad):
                _bump_version((x,))
            else:
                ctx.mark_dirty(x)
        ctx.plan, ctx.offset = plan, offset
        ctx.save_for_backward(*tabs)
        return out

    @staticmethod
    def backward(ctx, dy):
        return None, ctx.plan.backward(dy, ctx.saved_tensors, ctx.offset), None, None


def rotary_planned(plan: RotaryPlan, x: Tensor, tabs: tuple, offset: int, grad: bool = True) -> Tensor:
    """Run a cached ``plan`` on ``x`` (the API layers that keep their own plan cache call this).

    ``tabs`` = ``(cos, sin, cos2, sin2, offsets tensor or None, cu_seqlens or None)`` with the plan's
    signature; ``offset`` the int position offset (checked here when the plan asks for it). ``grad=False``
    never records autograd (Apex's extension functions, which are the two halves of a Function)."""
    if plan.fix:
        tabs = plan.fixed(tabs)
    if plan.cast_offset:
        offset = int(offset)
    if plan.check_rows and (offset < 0 or offset + plan.S > plan.rows):
        plan.check_offset(offset)
    if grad and x.requires_grad and torch.is_grad_enabled():
        return _RotaryFn.apply(plan, x, tabs, offset)
    out = plan.forward(x, tabs, offset)
    if plan.inplace:
        _bump_version((x,))  # as an in-place PyTorch op would: autograd catches later misuse of saved x
    return out


def rotary(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    cos2: Tensor | None = None,
    sin2: Tensor | None = None,
    cos_k: Tensor | None = None,
    sin_k: Tensor | None = None,
    nheads_q: int | None = None,
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
    round_ops: bool = False,
) -> Tensor:
    """Rotary position embedding of the first ``rotary_dim`` columns of ``x``; differentiable in ``x``.

    Args:
        x: ``(B, S, H, D)`` (any strides); ``(T, H, D)`` packed when ``cu_seqlens`` is given; or
            ``(B, S, 2, H, D)``: Q and K of a packed qkv (``qkv[:, :, :2]``), rotated by one launch.
            fp16/bf16/fp32/fp64.
        cos, sin: ``(rows, W)`` tables, any float dtype, one row per position. ``W = rotary_dim / 2``
            (one angle per pair, flash_attn) or with ``full_table`` ``W = rotary_dim`` (one value per
            rotated column, Apex). ``rotary_dim <= D``; the other columns pass through.
        cos2, sin2: the column tables of the 2-D form (``img_w > 0``): columns ``[0, D/2)`` are
            rotated at position ``s // img_w`` with ``cos``/``sin`` and ``[D/2, D)`` at ``s % img_w``.
        cos_k, sin_k: separate tables of the K heads (XPos): group 1 of a 5-D ``x``, or the heads from
            ``nheads_q`` on of a 4-D ``x`` (GQA-packed Q and K).
        seqlen_offsets: int or ``(B,)`` int tensor added to every position of a sequence.
        cu_seqlens: ``(B + 1,)`` int32/int64 sequence starts of packed ``x``; needs ``max_seqlen``.
        interleaved: GPT-J pairs ``(2i, 2i+1)`` instead of GPT-NeoX halves ``(i, i + rotary_dim/2)``.
        inplace: rotate ``x`` itself and return it (columns past ``rotary_dim`` untouched).
        conjugate: apply the inverse (transposed) rotation.
        out_layout: memory layout of a new output, one of ``LAYOUTS`` (in ``x``'s own dim order).
        seq_first: ``x`` is ``(S, B, H, D)`` (Apex's sbhd) instead of ``(B, S, H, D)``.
        round_ops: for fp16/bf16 ``x``, round the table values, each product and the sum to x's dtype,
            as Apex's fused RoPE (and its PyTorch formula) computes; the default is flash_attn's fp32 math.

    Math in fp32 (fp64 for fp64 input) unless ``round_ops``; the result has ``x``'s dtype and shape. The
    tables get no gradient (as in flash_attn and Apex).

    Host cost: the checks and the launch geometry are computed once per call signature (shapes,
    strides, dtypes, devices, flags) and cached; a repeated call only allocates and launches.
    """
    if cos_k is not None or sin_k is not None:
        if cos2 is not None or img_w:
            raise ValueError("cos_k/sin_k (XPos keys) and cos2/sin2 (the 2-D form) cannot be combined")
        cos2, sin2 = cos_k, sin_k
    if torch.compiler.is_compiling():
        return _rotary_compiled(x, cos, sin, cos2, sin2, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace,
                                conjugate, full_table, img_w, out_layout, seq_first, nheads_q, round_ops)
    offs_t = seqlen_offsets if type(seqlen_offsets) is not int else None
    try:
        key = (x.shape, x.stride(), x.dtype, x.device, cos.shape, cos.stride(), cos.dtype, cos.device,
               sin.shape, sin.stride(), sin.dtype, sin.device,
               None if cos2 is None else (cos2.shape, cos2.stride(), cos2.dtype, cos2.device),
               None if sin2 is None else (sin2.shape, sin2.stride(), sin2.dtype, sin2.device),
               None if offs_t is None else (type(offs_t), offs_t.shape, offs_t.stride(), offs_t.dtype, offs_t.device),
               None if cu_seqlens is None else (cu_seqlens.shape, cu_seqlens.stride(), cu_seqlens.dtype,
                                                cu_seqlens.device),
               max_seqlen, interleaved, inplace, conjugate, full_table, img_w, out_layout, seq_first, nheads_q,
               round_ops)
        plan = PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors / unhashable arguments: the plan names the problem
        key, plan = None, None
    if plan is None:
        plan = RotaryPlan(x, cos, sin, cos2, sin2, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace,
                          conjugate, full_table, img_w, out_layout, seq_first, nheads_q, round_ops=round_ops)
        if key is not None:
            PLANS.put(key, plan)
    if plan.has_offsets:
        return rotary_planned(plan, x, (cos, sin, cos2, sin2, seqlen_offsets, cu_seqlens), 0)
    return rotary_planned(plan, x, (cos, sin, cos2, sin2, None, cu_seqlens), seqlen_offsets)


# -------------------------------------------------------------------------- torch.compile


def _plan_from(x, cos, sin, cos2, sin2, offsets, cu_seqlens, offset, max_seqlen, interleaved, inplace, conjugate,
               full_table, round_ops, img_w, out_layout, seq_first, nheads_q) -> RotaryPlan:
    """An uncached plan for traced code (sizes may be symbolic). Triton's CPU interpreter cannot be
    traced, so there the compiled graph takes the (traceable) reference path."""
    plan = RotaryPlan(x, cos, sin, cos2, sin2, offsets if offsets is not None else offset,
                      cu_seqlens, max_seqlen if cu_seqlens is not None else None, interleaved, inplace, conjugate,
                      full_table, img_w, out_layout, seq_first, nheads_q if nheads_q > 0 else None,
                      round_ops=round_ops)
    plan.use_kernel = plan.use_kernel and traceable_kernels()
    return plan


@torch.library.triton_op("culmen::rotary", mutates_args=())
def rotary_op(
    x: Tensor, cos: Tensor, sin: Tensor, cos2: Tensor | None, sin2: Tensor | None, offsets: Tensor | None,
    cu_seqlens: Tensor | None, offset: int, max_seqlen: int, interleaved: bool, conjugate: bool, full_table: bool,
    round_ops: bool, img_w: int, out_layout: str, seq_first: bool, nheads_q: int,
) -> Tensor:
    """Out-of-place rotation for ``torch.compile`` (arguments as ``rotary``; ``offsets`` is the tensor form
    of ``seqlen_offsets``, else ``offset``; ``nheads_q`` 0 for none). Returns a new tensor like ``x``."""
    plan = _plan_from(x, cos, sin, cos2, sin2, offsets, cu_seqlens, offset, max_seqlen, interleaved, False,
                      conjugate, full_table, round_ops, img_w, out_layout, seq_first, nheads_q)
    if plan.check_rows:
        plan.check_offset(offset)
    return plan.forward(x, (cos, sin, cos2, sin2, offsets, cu_seqlens), offset, traced=True)


@torch.library.triton_op("culmen::rotary_", mutates_args=("x",))
def rotary_inplace_op(
    x: Tensor, cos: Tensor, sin: Tensor, cos2: Tensor | None, sin2: Tensor | None, offsets: Tensor | None,
    cu_seqlens: Tensor | None, offset: int, max_seqlen: int, interleaved: bool, conjugate: bool, full_table: bool,
    round_ops: bool, img_w: int, seq_first: bool, nheads_q: int,
) -> None:
    """In-place rotation of ``x``'s rotary columns (the others are untouched), for ``torch.compile``."""
    plan = _plan_from(x, cos, sin, cos2, sin2, offsets, cu_seqlens, offset, max_seqlen, interleaved, True,
                      conjugate, full_table, round_ops, img_w, "like", seq_first, nheads_q)
    if plan.check_rows:
        plan.check_offset(offset)
    plan.forward(x, (cos, sin, cos2, sin2, offsets, cu_seqlens), offset, traced=True)


def _setup_context(ctx, inputs, output):
    # Runs while torch.compile traces (never in eager calls): the backward is the same op, conjugated.
    ctx.save_for_backward(*inputs[1:7])
    ctx.args = inputs[7:]


def _compiled_backward(ctx, dy):
    cos, sin, cos2, sin2, offsets, cu = ctx.saved_tensors
    offset, max_seqlen, interleaved, conjugate, full_table, round_ops, img_w, _, seq_first, nheads_q = ctx.args
    dx = rotary_op(dy, cos, sin, cos2, sin2, offsets, cu, offset, max_seqlen, interleaved, not conjugate, full_table,
                   round_ops, img_w, "like", seq_first, nheads_q)
    return (dx,) + (None,) * 16


torch.library.register_autograd("culmen::rotary", _compiled_backward, setup_context=_setup_context)


def _rotary_compiled(x, cos, sin, cos2, sin2, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace,
                     conjugate, full_table, img_w, out_layout, seq_first, nheads_q, round_ops):
    """``rotary`` while ``torch.compile`` traces: a dense rotation as its PyTorch formula when the fusion
    switch is on (``culmen.set_compile_fusion``), else the ``triton_op``s (checked when they are traced)."""
    if isinstance(seqlen_offsets, Tensor):
        offsets, offset = seqlen_offsets, 0
    else:
        offsets, offset = None, seqlen_offsets
    if (compile_fusion_enabled() and cu_seqlens is None and cos2 is None and not img_w and not round_ops
            and out_layout == "like"):
        return _rotary_formula(x, cos, sin, offsets, offset, interleaved, inplace, conjugate, full_table, seq_first)
    args = (cos, sin, cos2, sin2, offsets, cu_seqlens, offset, 0 if max_seqlen is None else max_seqlen,
            bool(interleaved), bool(conjugate), bool(full_table), bool(round_ops), int(img_w))
    nq = 0 if nheads_q is None else nheads_q
    if not inplace:
        return rotary_op(x, *args, out_layout, bool(seq_first), nq)
    if torch.is_grad_enabled() and x.requires_grad:
        # Autograd cannot differentiate a mutating custom op: rotate out of place and copy back (the
        # copy is tracked; Inductor may re-inplace it). A leaf that requires grad (or a view of one) takes
        # the untracked copy and returns the rotation itself, as in eager mode (see ``_RotaryFn``).
        out = rotary_op(x, *args, "like", bool(seq_first), nq)
        if _dirty_ok(x):
            x.copy_(out)
            return x
        with torch.no_grad():
            x.copy_(out)
        return out
    rotary_inplace_op(x, *args, bool(seq_first), nq)
    return x


def _rotary_formula(x, cos, sin, offsets, offset, interleaved, inplace, conjugate, full_table, seq_first):
    """A dense ``rotary`` traced as plain PyTorch (``reference.rotary_dense_ref``), which Inductor fuses with
    the ops around it: for a packed qkv it writes the rotated Q and K with the projection's output instead of
    copying the whole qkv around an opaque in-place op. The shape checks are the plan's own (``rotary_dim_of``,
    ``check_offset_rows``: plain comparisons Dynamo traces without a graph break)."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError("x must be a floating-point tensor (float16/bfloat16/float32/float64)")
    if x.dim() != 4 and not (x.dim() == 5 and x.shape[2] == 2 and not seq_first):
        dims = "seqlen, batch" if seq_first else "batch, seqlen"
        raise ValueError(f"x must be ({dims}, nheads, headdim) or (batch, seqlen, 2, nheads, headdim), got shape "
                         f"{tuple(x.shape)}")
    if cos.dim() != 2 or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be 2-D (positions, columns) of one shape, got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    rotary_dim_of(cos.shape[1], full_table, x.shape[-1])
    if offsets is None:
        check_offset_rows(offset, x.shape[0 if seq_first else 1], cos.shape[0])
    y = rotary_dense_ref(x, cos, sin, offsets, offset, interleaved, conjugate, full_table, seq_first)
    if not inplace:
        return y
    if torch.is_grad_enabled() and x.requires_grad and not _dirty_ok(x):
        with torch.no_grad():  # a leaf (or a view of one): rotated in its memory, the gradient flows through y
            x.copy_(y)
        return y
    return x.copy_(y)
