"""Apex's ``apex.transformer.functional.fused_softmax``: Megatron's fused scale + mask + softmax.

Same classes, arguments, checks and fallback as Apex, with two differences that only remove limits:

* the fused kernels run for every shape: Apex fuses only ``16 < sk <= 16384`` with ``sq``, ``sk`` and
  ``b * np`` divisible by 4 (and a batch-per-block rule), and otherwise falls back to an unfused
  PyTorch softmax; culmen's kernels take any ``sk >= 1`` (long rows through a chunked online
  softmax), any batch, and fp32 as well as fp16/bf16;
* a fully masked row is all zeros in every path of the kernels (Apex's generic kernel and the
  padding kernel agree on this; its unfused fallback gives a uniform row).

As in Apex, the fused path scores masked elements -10000 and ignores ``mask_func``; the unfused
path (fusion off, fp32 input flags, or a causal call with ``sq != sk``) is Apex's own:
``mask_func(input * scale, mask)`` then ``torch.softmax``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from culmen.ops.softmax import scaled_masked_softmax as scaled_masked_softmax_op
from culmen.ops.softmax import softmax_backward, softmax_forward
from culmen.transformer.enums import AttnMaskType

__all__ = [
    "FusedScaleMaskSoftmax",
    "GenericFusedScaleMaskSoftmax",
    "GenericScaledMaskedSoftmax",
    "ScaledMaskedSoftmax",
    "ScaledSoftmax",
    "ScaledUpperTriangMaskedSoftmax",
    "generic_scaled_masked_softmax",
    "get_batch_per_block",
    "scaled_masked_softmax",
    "scaled_upper_triang_masked_softmax",
]


def _scale_value(scale) -> float:
    return float(scale.item()) if isinstance(scale, Tensor) else float(scale)


class ScaledUpperTriangMaskedSoftmax(torch.autograd.Function):
    """Scale, causal (upper-triangular) mask, softmax: ``inputs`` ``(attn_batches, sq, sk)``."""

    @staticmethod
    def forward(ctx, inputs: Tensor, scale: float) -> Tensor:
        if not isinstance(inputs, Tensor) or inputs.dim() != 3:
            raise ValueError(f"inputs must be a 3-D tensor (attn_batches, sq, sk), got "
                             f"{tuple(inputs.shape) if isinstance(inputs, Tensor) else type(inputs).__name__}")
        ctx.scale = _scale_value(scale)
        y = softmax_forward(inputs, None, ctx.scale, causal=True)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, output_grads: Tensor):
        (y,) = ctx.saved_tensors
        return softmax_backward(output_grads, y, ctx.scale, causal=True), None


class ScaledMaskedSoftmax(torch.autograd.Function):
    """Scale, padding mask (nonzero = masked, -10000), softmax: ``inputs`` ``(b, np, sq, sk)``, ``mask``
    broadcastable (Apex: ``(b or 1, 1, sq, sk)``)."""

    @staticmethod
    def forward(ctx, inputs: Tensor, mask: Tensor | None, scale: float) -> Tensor:
        ctx.scale = _scale_value(scale)
        y = softmax_forward(inputs, mask, ctx.scale)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, output_grads: Tensor):
        (y,) = ctx.saved_tensors
        return softmax_backward(output_grads, y, ctx.scale), None, None


class GenericScaledMaskedSoftmax(ScaledMaskedSoftmax):
    """Apex's shape-unrestricted variant of ``ScaledMaskedSoftmax``; in culmen the same kernels."""


class ScaledSoftmax(torch.autograd.Function):
    """Scale then softmax, no mask: ``inputs`` ``(b, np, sq, sk)``."""

    @staticmethod
    def forward(ctx, inputs: Tensor, scale: float) -> Tensor:
        ctx.scale = _scale_value(scale)
        y = softmax_forward(inputs, None, ctx.scale)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, output_grads: Tensor):
        (y,) = ctx.saved_tensors
        return softmax_backward(output_grads, y, ctx.scale), None


# The functionals below call the op directly (one autograd node, a cached plan); the Functions above
# are kept for callers that use them by name. As in Apex, under autocast the scores are cast to the
# autocast dtype first (and the op then sees the dtypes it was given).


def _autocast_scores(inputs: Tensor) -> Tensor:
    if not isinstance(inputs, Tensor):
        return inputs  # the op names the problem
    dev = inputs.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        if inputs.is_floating_point() and inputs.dtype != dtype:
            return inputs.to(dtype)
    return inputs


def scaled_upper_triang_masked_softmax(inputs: Tensor, _: Tensor | None, scale: float) -> Tensor:
    """Causal fused softmax of ``inputs`` ``(b, np, sq, sk)`` (the mask argument is ignored); ``sq == sk``."""
    if not isinstance(inputs, Tensor) or inputs.dim() != 4:
        raise ValueError("inputs must be a 4-D tensor (b, np, sq, sk)")
    shape = inputs.shape
    if shape[2] != shape[3]:
        raise ValueError(f"the causal mask is only for self attention: sq must equal sk, got sq={shape[2]}, "
                         f"sk={shape[3]}")
    return scaled_masked_softmax_op(_autocast_scores(inputs), None, scale, True)


def scaled_masked_softmax(inputs: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """Padding-masked fused softmax of ``inputs`` ``(b, np, sq, sk)``; ``mask=None`` means no mask."""
    return scaled_masked_softmax_op(_autocast_scores(inputs), mask, scale)


def generic_scaled_masked_softmax(inputs: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """``scaled_masked_softmax`` under Apex's generic name (no shape limits in either)."""
    return scaled_masked_softmax_op(_autocast_scores(inputs), mask, scale)


def get_batch_per_block(sq: int, sk: int, b: int, np: int) -> int:
    """Rows per 128-thread block of Apex's warp-per-row kernels (kept for callers that size batches
    by it; culmen's kernels need no such divisibility)."""
    del sq, b, np  # Apex's rule depends on sk only
    log2 = max(int(sk) - 1, 0).bit_length()
    pow2 = 1 << log2
    warp_size = min(pow2, 32)
    batches_per_warp = 2 if pow2 <= 128 else 1
    return (128 // warp_size) * batches_per_warp


class FusedScaleMaskSoftmax(torch.nn.Module):
    """Fused ``softmax(mask(input * scale))`` for attention scores ``input`` ``(b, np, sq, sk)``.

    Args:
        input_in_fp16, input_in_bf16: the input dtype flags (not both).
        attn_mask_type: ``AttnMaskType.padding`` (explicit mask) or ``AttnMaskType.causal``.
        scaled_masked_softmax_fusion: use the fused kernels.
        mask_func: ``mask_func(scores, mask) -> scores`` of the unfused path.
        softmax_in_fp32: the unfused path upcasts fp16/bf16 input to fp32 (the fused path always
            computes in fp32).
        scale: multiplies the scores; needs ``softmax_in_fp32``; ``None`` means 1.

    ``forward(input, mask)`` returns probabilities in the input's dtype. The fused path is taken when
    fusion is on and the input flags say fp16/bf16, for every shape (causal needs ``sq == sk``).
    """

    def __init__(self, input_in_fp16: bool, input_in_bf16: bool, attn_mask_type: AttnMaskType,
                 scaled_masked_softmax_fusion: bool, mask_func: Callable[[Tensor, Tensor], Tensor] | None,
                 softmax_in_fp32: bool, scale: float | None) -> None:
        super().__init__()
        self.input_in_fp16 = input_in_fp16
        self.input_in_bf16 = input_in_bf16
        if self.input_in_fp16 and self.input_in_bf16:
            raise RuntimeError("both fp16 and bf16 flags cannot be active at the same time.")
        self.input_in_float16 = self.input_in_fp16 or self.input_in_bf16
        self.attn_mask_type = attn_mask_type
        self.scaled_masked_softmax_fusion = scaled_masked_softmax_fusion
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        self.scale = scale
        if not (self.scale is None or softmax_in_fp32):
            raise RuntimeError("softmax should be in fp32 when scaled")
        if self.scaled_masked_softmax_fusion:
            if self.attn_mask_type == AttnMaskType.causal:
                self.fused_softmax_func = scaled_upper_triang_masked_softmax
            elif self.attn_mask_type == AttnMaskType.padding:
                self.fused_softmax_func = scaled_masked_softmax
            else:
                raise ValueError(f"Invalid attn_mask_type: {attn_mask_type!r} (expected AttnMaskType.padding or "
                                 f"AttnMaskType.causal)")

    def forward(self, input: Tensor, mask: Tensor | None) -> Tensor:
        if not isinstance(input, Tensor) or input.dim() != 4:
            raise ValueError(f"input must be a 4-D tensor (b, np, sq, sk), got "
                             f"{tuple(input.shape) if isinstance(input, Tensor) else type(input).__name__}")
        if self.is_kernel_available(mask, *input.size()):
            return self.forward_fused_softmax(input, mask)
        return self.forward_torch_softmax(input, mask)

    def is_kernel_available(self, mask: Tensor | None, b: int, np: int, sq: int, sk: int) -> bool:
        """Whether ``forward`` takes the fused kernels for this shape (no size limits in culmen)."""
        if not (self.scaled_masked_softmax_fusion and self.input_in_float16 and sk > 0):
            return False
        if self.attn_mask_type == AttnMaskType.causal:
            return sq == sk
        return self.attn_mask_type == AttnMaskType.padding

    def forward_fused_softmax(self, input: Tensor, mask: Tensor | None) -> Tensor:
        scale = self.scale if self.scale is not None else 1.0
        return self.fused_softmax_func(input, mask, scale)

    def forward_torch_softmax(self, input: Tensor, mask: Tensor | None) -> Tensor:
        if self.input_in_float16 and self.softmax_in_fp32:
            input = input.float()
        if self.scale is not None:
            input = input * self.scale
        if mask is not None:
            if self.mask_func is None:
                raise ValueError("mask_func is None: the unfused path needs it to apply the mask")
            input = self.mask_func(input, mask)
        probs = torch.nn.Softmax(dim=-1)(input)
        if self.input_in_float16 and self.softmax_in_fp32:
            probs = probs.half() if self.input_in_fp16 else probs.bfloat16()
        return probs

    @staticmethod
    def get_batch_per_block(sq: int, sk: int, b: int, np: int) -> int:
        """Apex's batch-per-block of its warp kernels (see ``get_batch_per_block``)."""
        return get_batch_per_block(sq, sk, b, np)


class GenericFusedScaleMaskSoftmax(FusedScaleMaskSoftmax):
    """``FusedScaleMaskSoftmax`` with a padding mask and no shape limits (Apex's generic kernels).

    Arguments as ``FusedScaleMaskSoftmax`` without ``attn_mask_type``. Fused whenever fusion is on
    and ``sk >= 1``, for any input dtype (as Apex decides it).
    """

    def __init__(self, input_in_fp16: bool, input_in_bf16: bool, scaled_masked_softmax_fusion: bool,
                 mask_func: Callable[[Tensor, Tensor], Tensor] | None, softmax_in_fp32: bool,
                 scale: float | None) -> None:
        super().__init__(input_in_fp16, input_in_bf16, AttnMaskType.padding, scaled_masked_softmax_fusion,
                         mask_func, softmax_in_fp32, scale)
        # Apex assigns the generic function to the fusion flag by mistake and so still runs the
        # padding kernel; here the generic function is the one called (the kernels are the same).
        self.fused_softmax_func = generic_scaled_masked_softmax

    def is_kernel_available(self, mask: Tensor | None, b: int, np: int, sq: int, sk: int) -> bool:
        return bool(self.scaled_masked_softmax_fusion) and sk > 0
