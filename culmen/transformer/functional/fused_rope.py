"""Apex's fused RoPE (``apex.transformer.functional.fused_rope``), on culmen's rotary kernel.

The rotation is GPT-NeoX style over the first ``d2`` columns (``d2 = freqs.size(-1) <= d``; the rest
passes through) with *full* tables: one angle / cos / sin per rotated column, so the two members of
a pair may differ, exactly as Apex's kernels index them.

Numerics are Apex's: cos/sin of ``freqs`` are computed in fp32 (cached tables are taken as given), then
rounded to ``t``'s dtype, and for fp16/bf16 ``t`` every product and the sum is rounded to that dtype,
which is what Apex's CUDA kernels and its unfused formula ``t * cos(freqs).to(t.dtype) +
rotate_half(t) * sin(freqs).to(t.dtype)`` compute (the rotary op's ``round_ops``); the backward
likewise (under ``torch.compile`` on CPU the traced reference's casts are Inductor's to fuse, as it
fuses those of the plain formula; GPU kernels keep them). Differences from Apex: fp64 inputs work,
and bad arguments raise ``ValueError`` / ``TypeError`` naming them instead of failing a C++ check.

Host cost: every function keeps its checks and the rotary plan per call signature (``_PLANS``); the
kernel reads Apex's ``[s, 1, 1, d2]`` / ``[1, N, 1, d/2]`` tables and the sbhd layout as they are (no
views), and cos/sin of a ``freqs`` tensor are computed once while it is unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.common.plans import PlanCache
from culmen.ops.rotary import rotary, rotary_planned
from culmen.ops.rotary.launch import RotaryPlan

__all__ = [
    "FusedRoPE2DFunc",
    "FusedRoPECachedFunc",
    "FusedRoPEFunc",
    "FusedRoPETHDFunc",
    "fused_apply_rotary_pos_emb",
    "fused_apply_rotary_pos_emb_2d",
    "fused_apply_rotary_pos_emb_cached",
    "fused_apply_rotary_pos_emb_thd",
]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_APEX = {"full_table": True, "round_ops": True}
"""Apex's tables (one value per rotated column) and numerics (see the module docstring)."""

_PLANS = PlanCache("apex_rope")
"""Call signature of an Apex function -> its ``RotaryPlan`` (the Apex checks passed)."""


def _check_t(t: Tensor, dims: int, layout: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"t must be {dims}-D {layout}, got shape {tuple(t.shape)}")


def _table(name: str, f: Tensor, rows: int | None, t: Tensor, d: int) -> None:
    """Check that ``f`` is a ``(rows, 1, 1, d2)`` table for ``t`` (last dim ``d``)."""
    if not isinstance(f, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(f).__name__}")
    if f.dtype not in _FLOATS:
        raise TypeError(f"{name} must be a floating-point tensor, got {f.dtype}")
    if f.dim() != 4 or f.size(1) != 1 or f.size(2) != 1:
        raise ValueError(f"{name} must have shape (s, 1, 1, d2), got {tuple(f.shape)}")
    if rows is not None and f.size(0) != rows:
        raise ValueError(f"{name} must have t's sequence length {rows} in dim 0, got {f.size(0)}")
    d2 = f.size(3)
    if d2 > d or d2 % 2:
        raise ValueError(f"{name}.size(-1) = {d2} must be even and <= t.size(-1) = {d}")
    if f.device != t.device:
        raise ValueError(f"{name} is on {f.device} but t is on {t.device}")


_LAST: list = [None]
"""The last ``freqs`` seen and its cos/sin: ``(freqs, version, cos, sin)``. Megatron passes one
``freqs`` tensor to every layer's Q and K rotation of a step, so the tables are computed once, not
twice per call. Holding ``freqs`` keeps its identity valid; ``_version`` catches in-place updates
(not writes through ``.data``, which autograd cannot see either)."""


def _cos_sin(freqs: Tensor) -> tuple[Tensor, Tensor]:
    """cos / sin of the angles ``freqs`` in fp32 (fp64 stays fp64), as Apex's ``sincosf``, shaped like
    ``freqs``; reused while ``freqs`` is the last one seen and unchanged (eager calls only)."""
    last = _LAST[0]
    if last is not None and last[0] is freqs and last[1] == freqs._version:
        return last[2], last[3]
    with torch.no_grad():
        a = freqs if freqs.dtype == torch.float64 else freqs.float()
        cos, sin = torch.cos(a), torch.sin(a)
    if not freqs.is_inference():
        _LAST[0] = (freqs, freqs._version, cos, sin)
    return cos, sin


def _fresh_cos_sin(freqs: Tensor) -> tuple[Tensor, Tensor]:
    a = freqs if freqs.dtype == torch.float64 else freqs.float()
    return torch.cos(a), torch.sin(a)


def _put(key, plan: RotaryPlan) -> RotaryPlan:
    if key is not None:
        _PLANS.put(key, plan)
    return plan


# ------------------------------------------------------------------------------------ sbhd


def sbhd_freqs(t: Tensor, freqs: Tensor, transpose_output: bool, conjugate: bool, grad: bool) -> Tensor:
    """The sbhd rotation with angles ``freqs`` (Apex's ``fused_apply_rotary_pos_emb`` and its extension's
    ``forward`` / ``backward``: ``conjugate`` is the backward; ``grad`` whether autograd may record)."""
    layout = "swap01" if transpose_output else "contiguous"
    if torch.compiler.is_compiling():
        _check_t(t, 4, "[s, b, h, d]")
        _table("freqs", freqs, t.size(0), t, t.size(3))
        return rotary(t, *_fresh_cos_sin(freqs), **_APEX, conjugate=conjugate, out_layout=layout,
                      seq_first=True)
    try:
        key = (0, t.shape, t.stride(), t.dtype, t.device, freqs.shape, freqs.stride(), freqs.dtype, freqs.device,
               transpose_output, conjugate)
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors: the checks say why
        key, plan = None, None
    if plan is None:
        _check_t(t, 4, "[s, b, h, d]")
        _table("freqs", freqs, t.size(0), t, t.size(3))
        cos, sin = _cos_sin(freqs)
        plan = _put(key, RotaryPlan(t, cos, sin, **_APEX, conjugate=conjugate, out_layout=layout,
                                    seq_first=True))
    else:
        cos, sin = _cos_sin(freqs)
    return rotary_planned(plan, t, (cos, sin, None, None, None, None), 0, grad)


def _check_cached(t: Tensor, cos_: Tensor, sin_: Tensor) -> None:
    _check_t(t, 4, "[s, b, h, d]")
    if isinstance(cos_, Tensor) and isinstance(sin_, Tensor) and cos_.shape != sin_.shape:
        raise ValueError(f"cos_ and sin_ must have the same shape, got {tuple(cos_.shape)} and {tuple(sin_.shape)}")
    _table("cos_", cos_, t.size(0), t, t.size(3))
    _table("sin_", sin_, t.size(0), t, t.size(3))


def sbhd_cached(t: Tensor, cos_: Tensor, sin_: Tensor, transpose_output: bool, conjugate: bool, grad: bool) -> Tensor:
    """The sbhd rotation with precomputed ``cos_`` / ``sin_`` tables (the ``_cached`` forms)."""
    layout = "swap01" if transpose_output else "contiguous"
    if torch.compiler.is_compiling():
        _check_cached(t, cos_, sin_)
        return rotary(t, cos_, sin_, **_APEX, conjugate=conjugate, out_layout=layout, seq_first=True)
    try:
        key = (1, t.shape, t.stride(), t.dtype, t.device, cos_.shape, cos_.stride(), cos_.dtype, cos_.device,
               sin_.shape, sin_.stride(), sin_.dtype, sin_.device, transpose_output, conjugate)
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):
        key, plan = None, None
    if plan is None:
        _check_cached(t, cos_, sin_)
        plan = _put(key, RotaryPlan(t, cos_, sin_, **_APEX, conjugate=conjugate, out_layout=layout,
                                    seq_first=True))
    return rotary_planned(plan, t, (cos_, sin_, None, None, None, None), 0, grad)


def fused_apply_rotary_pos_emb(t: Tensor, freqs: Tensor, transpose_output_memory: bool = False) -> Tensor:
    """RoPE of ``t`` ``[s, b, h, d]`` (sbhd) with angles ``freqs`` ``[s, 1, 1, d2]`` (fp32), ``d2 <= d``.

    ``transpose_output_memory``: lay the output out as ``[b, s, h, d]`` in memory (its shape stays
    ``[s, b, h, d]``), so ``output.transpose(0, 1)`` is contiguous. Differentiable in ``t``.
    """
    return sbhd_freqs(t, freqs, transpose_output_memory, False, True)


def fused_apply_rotary_pos_emb_cached(t: Tensor, cos_: Tensor, sin_: Tensor,
                                      transpose_output_memory: bool = False) -> Tensor:
    """RoPE of ``t`` ``[s, b, h, d]`` with precomputed ``cos_``/``sin_`` ``[s, 1, 1, d2]`` (fp32 or t's
    dtype). ``transpose_output_memory`` as in ``fused_apply_rotary_pos_emb``."""
    return sbhd_cached(t, cos_, sin_, transpose_output_memory, False, True)


# ------------------------------------------------------------------------------------- thd


def thd_freqs(t: Tensor, cu_seqlens: Tensor, freqs: Tensor, conjugate: bool, grad: bool) -> Tensor:
    """The packed (thd) rotation (``fused_apply_rotary_pos_emb_thd`` and its extension's halves)."""
    if torch.compiler.is_compiling():
        _check_t(t, 3, "[total, h, d]")
        _table("freqs", freqs, None, t, t.size(2))
        return rotary(t, *_fresh_cos_sin(freqs), cu_seqlens=cu_seqlens, max_seqlen=freqs.size(0), **_APEX,
                      conjugate=conjugate)
    try:
        key = (2, t.shape, t.stride(), t.dtype, t.device, cu_seqlens.shape, cu_seqlens.stride(), cu_seqlens.dtype,
               cu_seqlens.device, freqs.shape, freqs.stride(), freqs.dtype, freqs.device, conjugate)
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):
        key, plan = None, None
    if plan is None:
        _check_t(t, 3, "[total, h, d]")
        _table("freqs", freqs, None, t, t.size(2))
        cos, sin = _cos_sin(freqs)
        plan = _put(key, RotaryPlan(t, cos, sin, cu_seqlens=cu_seqlens, max_seqlen=freqs.size(0), **_APEX,
                                    conjugate=conjugate))
    else:
        cos, sin = _cos_sin(freqs)
    return rotary_planned(plan, t, (cos, sin, None, None, None, cu_seqlens), 0, grad)


def fused_apply_rotary_pos_emb_thd(t: Tensor, cu_seqlens: Tensor, freqs: Tensor) -> Tensor:
    """RoPE of packed sequences ``t`` ``[total, h, d]``: sequence ``i`` spans rows
    ``cu_seqlens[i]:cu_seqlens[i+1]`` (``[b + 1]`` int32) and its positions start at 0. ``freqs``
    ``[max_s, 1, 1, d2]`` covers the longest sequence. Differentiable in ``t``."""
    return thd_freqs(t, cu_seqlens, freqs, False, True)


# -------------------------------------------------------------------------------------- 2-D


def _check_2d(t: Tensor, img_h: int, img_w: int, cos_h, sin_h, cos_w, sin_w) -> None:
    _check_t(t, 4, "[b, s, h, d]")
    if img_h <= 0 or img_w <= 0 or t.size(1) != img_h * img_w:
        raise ValueError(f"The sequence length should be equal to img_h * img_w: t.size(1) = {t.size(1)}, "
                         f"img_h = {img_h}, img_w = {img_w}")
    d = t.size(3)
    if d % 4:
        raise ValueError(f"the 2-D RoPE rotates d/2 columns per axis in pairs: d = {d} must be divisible by 4")
    for cname, sname, c, s in (("cos_h", "sin_h", cos_h, sin_h), ("cos_w", "sin_w", cos_w, sin_w)):
        if isinstance(c, Tensor) and isinstance(s, Tensor) and c.size() != s.size():
            raise ValueError(f"The shape of {cname} and {sname} should be the same, got {tuple(c.shape)} and "
                             f"{tuple(s.shape)}")
    for name, f, need in (("cos_h", cos_h, img_h), ("sin_h", sin_h, img_h), ("cos_w", cos_w, img_w),
                          ("sin_w", sin_w, img_w)):
        if not isinstance(f, Tensor) or f.dim() != 4 or f.size(0) != 1 or f.size(2) != 1 or f.size(3) != d // 2:
            raise ValueError(f"{name} must have shape [1, N, 1, d/2 = {d // 2}], got "
                             f"{tuple(f.shape) if isinstance(f, Tensor) else type(f).__name__}")
        if f.size(1) < need:
            raise ValueError(f"{name} covers {f.size(1)} positions, fewer than the image's {need}")
        _table(name, f.transpose(0, 1), None, t, d)


def two_d(t: Tensor, img_h: int, img_w: int, cos_h: Tensor, sin_h: Tensor, cos_w: Tensor, sin_w: Tensor,
          conjugate: bool, grad: bool) -> Tensor:
    """The 2-D rotation of ``t`` ``[b, img_h * img_w, h, d]`` (``fused_apply_rotary_pos_emb_2d`` and its
    extension's halves); the ``[1, N, 1, d/2]`` tables are read in place (positions along dim 1)."""
    img_h, img_w = int(img_h), int(img_w)
    if torch.compiler.is_compiling():
        _check_2d(t, img_h, img_w, cos_h, sin_h, cos_w, sin_w)
        tabs = [f.transpose(0, 1) for f in (cos_h, sin_h, cos_w, sin_w)]
        return rotary(t, tabs[0], tabs[1], cos2=tabs[2], sin2=tabs[3], **_APEX, img_w=img_w,
                      conjugate=conjugate, out_layout="contiguous")
    try:
        key = (3, t.shape, t.stride(), t.dtype, t.device, img_h, img_w, conjugate,
               *((f.shape, f.stride(), f.dtype, f.device) for f in (cos_h, sin_h, cos_w, sin_w)))
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):
        key, plan = None, None
    if plan is None:
        _check_2d(t, img_h, img_w, cos_h, sin_h, cos_w, sin_w)
        plan = _put(key, RotaryPlan(t, cos_h, sin_h, cos_w, sin_w, **_APEX, img_w=img_w, conjugate=conjugate,
                                    out_layout="contiguous", table_dim=1))
    return rotary_planned(plan, t, (cos_h, sin_h, cos_w, sin_w, None, None), 0, grad)


def fused_apply_rotary_pos_emb_2d(t: Tensor, img_h: int, img_w: int, cos_h: Tensor, sin_h: Tensor, cos_w: Tensor,
                                  sin_w: Tensor) -> Tensor:
    """2-D RoPE of image tokens ``t`` ``[b, s, h, d]`` with ``s = img_h * img_w`` (row-major patches).

    Columns ``[0, d/2)`` are rotated at the patch's row with ``cos_h``/``sin_h`` ``[1, H, 1, d/2]``
    (``H >= img_h``), columns ``[d/2, d)`` at its column with ``cos_w``/``sin_w`` ``[1, W, 1, d/2]``
    (``W >= img_w``). ``d`` must be divisible by 4. Returns ``[b, s, h, d]``; differentiable in ``t``.
    """
    return two_d(t, img_h, img_w, cos_h, sin_h, cos_w, sin_w, False, True)


# ------------------------------------------------------------------------------- autograd classes


class FusedRoPEFunc(torch.autograd.Function):
    """Apex's autograd class behind ``fused_apply_rotary_pos_emb``: ``FusedRoPEFunc.apply(t, freqs,
    transpose_output_memory=False)``; the backward rotates the gradient back (the same kernel, angles negated)."""

    @staticmethod
    def forward(ctx, t: Tensor, freqs: Tensor, transpose_output_memory: bool = False) -> Tensor:
        ctx.save_for_backward(freqs)
        ctx.transpose = transpose_output_memory
        return sbhd_freqs(t, freqs, transpose_output_memory, False, False)

    @staticmethod
    def backward(ctx, g: Tensor):
        (freqs,) = ctx.saved_tensors
        return sbhd_freqs(g, freqs, ctx.transpose, True, False), None, None


class FusedRoPECachedFunc(torch.autograd.Function):
    """``FusedRoPECachedFunc.apply(t, cos_, sin_, transpose_output_memory=False)``, behind
    ``fused_apply_rotary_pos_emb_cached``."""

    @staticmethod
    def forward(ctx, t: Tensor, cos_: Tensor, sin_: Tensor, transpose_output_memory: bool = False) -> Tensor:
        ctx.save_for_backward(cos_, sin_)
        ctx.transpose = transpose_output_memory
        return sbhd_cached(t, cos_, sin_, transpose_output_memory, False, False)

    @staticmethod
    def backward(ctx, g: Tensor):
        cos_, sin_ = ctx.saved_tensors
        return sbhd_cached(g, cos_, sin_, ctx.transpose, True, False), None, None, None


class FusedRoPETHDFunc(torch.autograd.Function):
    """``FusedRoPETHDFunc.apply(t, cu_seqlens, freqs)``, behind ``fused_apply_rotary_pos_emb_thd``."""

    @staticmethod
    def forward(ctx, t: Tensor, cu_seqlens: Tensor, freqs: Tensor) -> Tensor:
        ctx.save_for_backward(cu_seqlens, freqs)
        return thd_freqs(t, cu_seqlens, freqs, False, False)

    @staticmethod
    def backward(ctx, g: Tensor):
        cu_seqlens, freqs = ctx.saved_tensors
        return thd_freqs(g, cu_seqlens, freqs, True, False), None, None


class FusedRoPE2DFunc(torch.autograd.Function):
    """``FusedRoPE2DFunc.apply(t, img_h, img_w, cos_h, sin_h, cos_w, sin_w)``, behind
    ``fused_apply_rotary_pos_emb_2d``."""

    @staticmethod
    def forward(ctx, t: Tensor, img_h: int, img_w: int, cos_h: Tensor, sin_h: Tensor, cos_w: Tensor,
                sin_w: Tensor) -> Tensor:
        ctx.save_for_backward(cos_h, sin_h, cos_w, sin_w)
        ctx.img = (img_h, img_w)
        return two_d(t, img_h, img_w, cos_h, sin_h, cos_w, sin_w, False, False)

    @staticmethod
    def backward(ctx, g: Tensor):
        return (two_d(g, *ctx.img, *ctx.saved_tensors, True, False), None, None, None, None, None, None)
