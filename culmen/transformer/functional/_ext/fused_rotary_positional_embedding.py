"""``fused_rotary_positional_embedding``: Apex's fused RoPE extension (forward / backward of the sbhd,
cached, thd and 2-D forms); the backward is the transposed rotation. ``transpose_output`` lays the
sbhd result out as bshd in memory, as in Apex. No autograd is recorded (these are the two halves of
Apex's autograd Functions); the plans are cached per call signature as in ``fused_rope``."""

from __future__ import annotations

from torch import Tensor

from culmen.transformer.functional._ext import check_dims
from culmen.transformer.functional.fused_rope import sbhd_cached, sbhd_freqs, thd_freqs, two_d

__all__ = ["backward", "backward_2d", "backward_cached", "backward_thd", "forward", "forward_2d", "forward_cached",
           "forward_thd"]


def forward(input: Tensor, freqs: Tensor, transpose_output: bool) -> Tensor:
    """``input`` ``[s, b, h, d]``, ``freqs`` ``[s, 1, 1, d2]`` angles."""
    return sbhd_freqs(input, freqs, transpose_output, False, False)


def backward(output_grads: Tensor, freqs: Tensor, transpose_output: bool) -> Tensor:
    return sbhd_freqs(output_grads, freqs, transpose_output, True, False)


def forward_cached(input: Tensor, cos: Tensor, sin: Tensor, transpose_output: bool) -> Tensor:
    """``input`` ``[s, b, h, d]``, ``cos``/``sin`` ``[s, 1, 1, d2]``."""
    return sbhd_cached(input, cos, sin, transpose_output, False, False)


def backward_cached(output_grads: Tensor, cos: Tensor, sin: Tensor, transpose_output: bool) -> Tensor:
    return sbhd_cached(output_grads, cos, sin, transpose_output, True, False)


def forward_thd(input: Tensor, cu_seqlens: Tensor, freqs: Tensor) -> Tensor:
    """Packed ``input`` ``[t, h, d]``, ``cu_seqlens`` ``[b + 1]``, ``freqs`` ``[max_s, 1, 1, d2]``."""
    return thd_freqs(input, cu_seqlens, freqs, False, False)


def backward_thd(output_grads: Tensor, cu_seqlens: Tensor, freqs: Tensor) -> Tensor:
    return thd_freqs(output_grads, cu_seqlens, freqs, True, False)


def _two_d(t: Tensor, cos_h: Tensor, sin_h: Tensor, cos_w: Tensor, sin_w: Tensor, conjugate: bool) -> Tensor:
    check_dims("input", t, 5)
    b, ih, iw, h, d = t.shape
    return two_d(t.reshape(b, ih * iw, h, d), ih, iw, cos_h, sin_h, cos_w, sin_w, conjugate, False)


def forward_2d(input: Tensor, cos_h: Tensor, sin_h: Tensor, cos_w: Tensor, sin_w: Tensor) -> Tensor:
    """``input`` ``[b, img_h, img_w, h, d]``; tables ``[1, N, 1, d/2]``. Returns ``[b, img_h * img_w, h, d]``."""
    return _two_d(input, cos_h, sin_h, cos_w, sin_w, False)


def backward_2d(output_grads: Tensor, cos_h: Tensor, sin_h: Tensor, cos_w: Tensor, sin_w: Tensor) -> Tensor:
    return _two_d(output_grads, cos_h, sin_h, cos_w, sin_w, True)
