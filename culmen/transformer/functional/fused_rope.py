"""Apex's fused RoPE (``apex.transformer.functional.fused_rope``), on culmen's rotary kernel.

The rotation is GPT-NeoX style over the first ``d2`` columns (``d2 = freqs.size(-1) <= d``; the rest
passes through) with *full* tables: one angle / cos / sin per rotated column, so the two members of
a pair may differ, exactly as Apex's kernels index them. Differences from Apex: the math is fp32 for
every input dtype (Apex's cached form computes in the input dtype), fp64 inputs work, and bad
arguments raise ``ValueError`` / ``TypeError`` naming them instead of failing a C++ check.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.rotary import rotary

__all__ = [
    "fused_apply_rotary_pos_emb",
    "fused_apply_rotary_pos_emb_2d",
    "fused_apply_rotary_pos_emb_cached",
    "fused_apply_rotary_pos_emb_thd",
]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_t(t: Tensor, dims: int, layout: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"t must be {dims}-D {layout}, got shape {tuple(t.shape)}")


def _table(name: str, f: Tensor, rows: int | None, t: Tensor, d: int) -> Tensor:
    """A ``(rows, 1, 1, d2)`` tensor as a ``(rows, d2)`` table, checked against ``t`` (last dim ``d``)."""
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
    return f.reshape(f.size(0), d2)


_LAST: list = [None]
"""The last ``freqs`` seen and its cos/sin: ``(freqs, version, cos, sin)``. Megatron passes one
``freqs`` tensor to every layer's Q and K rotation of a step, so the tables are computed once, not
twice per call. Holding ``freqs`` keeps its identity valid; ``_version`` catches in-place updates
(not writes through ``.data``, which autograd cannot see either)."""


def _cos_sin(freqs: Tensor, table: Tensor) -> tuple[Tensor, Tensor]:
    """cos / sin of the angles ``table`` (``freqs`` as ``(rows, d2)``) in fp32 (fp64 stays fp64), as
    Apex's ``sincosf``; reused while ``freqs`` is the last one seen and unchanged."""
    cacheable = not freqs.is_inference() and not torch.compiler.is_compiling()
    if cacheable:
        last = _LAST[0]
        if last is not None and last[0] is freqs and last[1] == freqs._version:
            return last[2], last[3]
    with torch.no_grad():
        a = table if table.dtype == torch.float64 else table.float()
        cos, sin = torch.cos(a), torch.sin(a)
    if cacheable:
        _LAST[0] = (freqs, freqs._version, cos, sin)
    return cos, sin


def fused_apply_rotary_pos_emb(t: Tensor, freqs: Tensor, transpose_output_memory: bool = False) -> Tensor:
    """RoPE of ``t`` ``[s, b, h, d]`` (sbhd) with angles ``freqs`` ``[s, 1, 1, d2]`` (fp32), ``d2 <= d``.

    ``transpose_output_memory``: lay the output out as ``[b, s, h, d]`` in memory (its shape stays
    ``[s, b, h, d]``), so ``output.transpose(0, 1)`` is contiguous. Differentiable in ``t``.
    """
    _check_t(t, 4, "[s, b, h, d]")
    cos, sin = _cos_sin(freqs, _table("freqs", freqs, t.size(0), t, t.size(3)))
    return _sbhd(t, cos, sin, transpose_output_memory)


def fused_apply_rotary_pos_emb_cached(t: Tensor, cos_: Tensor, sin_: Tensor,
                                      transpose_output_memory: bool = False) -> Tensor:
    """RoPE of ``t`` ``[s, b, h, d]`` with precomputed ``cos_``/``sin_`` ``[s, 1, 1, d2]`` (fp32 or t's
    dtype). ``transpose_output_memory`` as in ``fused_apply_rotary_pos_emb``."""
    _check_t(t, 4, "[s, b, h, d]")
    if isinstance(cos_, Tensor) and isinstance(sin_, Tensor) and cos_.shape != sin_.shape:
        raise ValueError(f"cos_ and sin_ must have the same shape, got {tuple(cos_.shape)} and {tuple(sin_.shape)}")
    cos = _table("cos_", cos_, t.size(0), t, t.size(3))
    sin = _table("sin_", sin_, t.size(0), t, t.size(3))
    return _sbhd(t, cos, sin, transpose_output_memory)


def _sbhd(t: Tensor, cos: Tensor, sin: Tensor, transpose_output_memory: bool) -> Tensor:
    # The op reads sbhd directly (seq_first); the output is sbhd-contiguous (Apex's default) or
    # bshd-contiguous (transpose_output_memory), whatever t's strides.
    layout = "swap01" if transpose_output_memory else "contiguous"
    return rotary(t, cos, sin, full_table=True, out_layout=layout, seq_first=True)


def fused_apply_rotary_pos_emb_thd(t: Tensor, cu_seqlens: Tensor, freqs: Tensor) -> Tensor:
    """RoPE of packed sequences ``t`` ``[total, h, d]``: sequence ``i`` spans rows
    ``cu_seqlens[i]:cu_seqlens[i+1]`` (``[b + 1]`` int32) and its positions start at 0. ``freqs``
    ``[max_s, 1, 1, d2]`` covers the longest sequence. Differentiable in ``t``."""
    _check_t(t, 3, "[total, h, d]")
    cos, sin = _cos_sin(freqs, _table("freqs", freqs, None, t, t.size(2)))
    return rotary(t, cos, sin, cu_seqlens=cu_seqlens, max_seqlen=cos.shape[0], full_table=True)


def fused_apply_rotary_pos_emb_2d(t: Tensor, img_h: int, img_w: int, cos_h: Tensor, sin_h: Tensor, cos_w: Tensor,
                                  sin_w: Tensor) -> Tensor:
    """2-D RoPE of image tokens ``t`` ``[b, s, h, d]`` with ``s = img_h * img_w`` (row-major patches).

    Columns ``[0, d/2)`` are rotated at the patch's row with ``cos_h``/``sin_h`` ``[1, H, 1, d/2]``
    (``H >= img_h``), columns ``[d/2, d)`` at its column with ``cos_w``/``sin_w`` ``[1, W, 1, d/2]``
    (``W >= img_w``). ``d`` must be divisible by 4. Returns ``[b, s, h, d]``; differentiable in ``t``.
    """
    _check_t(t, 4, "[b, s, h, d]")
    img_h, img_w = int(img_h), int(img_w)
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
    tabs = []
    for name, f, need in (("cos_h", cos_h, img_h), ("sin_h", sin_h, img_h), ("cos_w", cos_w, img_w),
                          ("sin_w", sin_w, img_w)):
        if not isinstance(f, Tensor) or f.dim() != 4 or f.size(0) != 1 or f.size(2) != 1 or f.size(3) != d // 2:
            raise ValueError(f"{name} must have shape [1, N, 1, d/2 = {d // 2}], got "
                             f"{tuple(f.shape) if isinstance(f, Tensor) else type(f).__name__}")
        if f.size(1) < need:
            raise ValueError(f"{name} covers {f.size(1)} positions, fewer than the image's {need}")
        tabs.append(_table(name, f.transpose(0, 1), None, t, d))
    return rotary(t, tabs[0], tabs[1], cos2=tabs[2], sin2=tabs[3], full_table=True, img_w=img_w,
                  out_layout="contiguous")
