"""``fused_rotary_positional_embedding``: Apex's fused RoPE extension (forward / backward of the sbhd,
cached, thd and 2-D forms); the backward is the transposed rotation. ``transpose_output`` lays the
sbhd result out as bshd in memory, as in Apex."""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.rotary import rotary
from culmen.transformer.functional._ext import check_dims
from culmen.transformer.functional.fused_rope import _cos_sin, _table

__all__ = ["backward", "backward_2d", "backward_cached", "backward_thd", "forward", "forward_2d", "forward_cached",
           "forward_thd"]


def _sbhd(t: Tensor, cos: Tensor, sin: Tensor, transpose_output: bool, conjugate: bool) -> Tensor:
    layout = "swap01" if transpose_output else "contiguous"
    with torch.no_grad():
        return rotary(t, cos, sin, full_table=True, conjugate=conjugate, out_layout=layout, seq_first=True)


def forward(input: Tensor, freqs: Tensor, transpose_output: bool) -> Tensor:
    """``input`` ``[s, b, h, d]``, ``freqs`` ``[s, 1, 1, d2]`` angles."""
    check_dims("input", input, 4)
    return _sbhd(input, *_cos_sin(freqs, _table("freqs", freqs, input.size(0), input, input.size(3))),
                 transpose_output, False)


def backward(output_grads: Tensor, freqs: Tensor, transpose_output: bool) -> Tensor:
    check_dims("output_grads", output_grads, 4)
    tab = _table("freqs", freqs, output_grads.size(0), output_grads, output_grads.size(3))
    return _sbhd(output_grads, *_cos_sin(freqs, tab), transpose_output, True)


def forward_cached(input: Tensor, cos: Tensor, sin: Tensor, transpose_output: bool) -> Tensor:
    """``input`` ``[s, b, h, d]``, ``cos``/``sin`` ``[s, 1, 1, d2]``."""
    check_dims("input", input, 4)
    s, d = input.size(0), input.size(3)
    return _sbhd(input, _table("cos", cos, s, input, d), _table("sin", sin, s, input, d), transpose_output, False)


def backward_cached(output_grads: Tensor, cos: Tensor, sin: Tensor, transpose_output: bool) -> Tensor:
    check_dims("output_grads", output_grads, 4)
    s, d = output_grads.size(0), output_grads.size(3)
    return _sbhd(output_grads, _table("cos", cos, s, output_grads, d), _table("sin", sin, s, output_grads, d),
                 transpose_output, True)


def _thd(t: Tensor, cu_seqlens: Tensor, freqs: Tensor, conjugate: bool) -> Tensor:
    check_dims("input", t, 3)
    cos, sin = _cos_sin(freqs, _table("freqs", freqs, None, t, t.size(2)))
    with torch.no_grad():
        return rotary(t, cos, sin, cu_seqlens=cu_seqlens, max_seqlen=cos.shape[0], full_table=True,
                      conjugate=conjugate)


def forward_thd(input: Tensor, cu_seqlens: Tensor, freqs: Tensor) -> Tensor:
    """Packed ``input`` ``[t, h, d]``, ``cu_seqlens`` ``[b + 1]``, ``freqs`` ``[max_s, 1, 1, d2]``."""
    return _thd(input, cu_seqlens, freqs, False)


def backward_thd(output_grads: Tensor, cu_seqlens: Tensor, freqs: Tensor) -> Tensor:
    return _thd(output_grads, cu_seqlens, freqs, True)


def _two_d(t: Tensor, cos_h: Tensor, sin_h: Tensor, cos_w: Tensor, sin_w: Tensor, conjugate: bool) -> Tensor:
    check_dims("input", t, 5)
    b, ih, iw, h, d = t.shape
    if d % 4:
        raise ValueError(f"the 2-D RoPE needs the head dim divisible by 4, got {d}")
    tabs = [_table(n, f.transpose(0, 1), None, t, d) for n, f in
            (("cos_h", cos_h), ("sin_h", sin_h), ("cos_w", cos_w), ("sin_w", sin_w))]
    with torch.no_grad():
        return rotary(t.reshape(b, ih * iw, h, d), tabs[0], tabs[1], cos2=tabs[2], sin2=tabs[3], full_table=True,
                      img_w=iw, conjugate=conjugate, out_layout="contiguous")


def forward_2d(input: Tensor, cos_h: Tensor, sin_h: Tensor, cos_w: Tensor, sin_w: Tensor) -> Tensor:
    """``input`` ``[b, img_h, img_w, h, d]``; tables ``[1, N, 1, d/2]``. Returns ``[b, img_h * img_w, h, d]``."""
    return _two_d(input, cos_h, sin_h, cos_w, sin_w, False)


def backward_2d(output_grads: Tensor, cos_h: Tensor, sin_h: Tensor, cos_w: Tensor, sin_w: Tensor) -> Tensor:
    return _two_d(output_grads, cos_h, sin_h, cos_w, sin_w, True)
