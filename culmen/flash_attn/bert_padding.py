"""Padding helpers of ``flash_attn.bert_padding``: pack the valid tokens of a padded batch for the
varlen attention functions and scatter results back.

``unpad_input(hidden, mask)`` -> ``(packed (total, ...), indices (total,) int64, cu_seqlens (B + 1,)
int32, max_seqlen int, seqused (B,) int32)``; ``pad_input(packed, indices, batch, seqlen)`` inverts it.
The gathers have index-based backward passes (no dense one-hot matmuls).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["IndexFirstAxis", "IndexFirstAxisResidual", "IndexPutFirstAxis", "index_first_axis",
           "index_first_axis_residual", "index_put_first_axis", "pad_input", "unpad_input",
           "unpad_input_for_concatenated_sequences"]


class IndexFirstAxis(torch.autograd.Function):
    """``IndexFirstAxis.apply(input, indices)``: ``input[indices]`` along the first axis (flash_attn's
    autograd function behind ``index_first_axis``)."""

    @staticmethod
    def forward(ctx, x: Tensor, indices: Tensor) -> Tensor:
        ctx.save_for_backward(indices)
        ctx.first_dim = x.shape[0]
        return x.reshape(x.shape[0], -1)[indices].reshape(-1, *x.shape[1:])

    @staticmethod
    def backward(ctx, g: Tensor):
        (indices,) = ctx.saved_tensors
        out = g.new_zeros((ctx.first_dim, *g.shape[1:]))
        out[indices] = g
        return out, None


class IndexPutFirstAxis(torch.autograd.Function):
    """``IndexPutFirstAxis.apply(values, indices, first_axis_dim)``: zeros ``(first_axis_dim, ...)`` with
    ``values`` at rows ``indices`` (flash_attn's autograd function behind ``index_put_first_axis``)."""

    @staticmethod
    def forward(ctx, values: Tensor, indices: Tensor, first_dim: int) -> Tensor:
        ctx.save_for_backward(indices)
        out = values.new_zeros((first_dim, *values.shape[1:]))
        out[indices] = values
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        (indices,) = ctx.saved_tensors
        return g[indices], None, None


class IndexFirstAxisResidual(torch.autograd.Function):
    """``IndexFirstAxisResidual.apply(input, indices)`` -> ``(input[indices], input.detach())``: the gathered
    rows and the whole input as a residual that does not start a second autograd path; the backward adds
    the gathered rows' gradient into the residual's (flash_attn's BERT keeps its last layer's full hidden
    states this way)."""

    @staticmethod
    def forward(ctx, x: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(indices)
        ctx.shape = x.shape
        return x[indices], x.detach()

    @staticmethod
    def backward(ctx, g: Tensor, g_residual: Tensor):
        (indices,) = ctx.saved_tensors
        out = g_residual.clone() if g_residual is not None else g.new_zeros(ctx.shape)
        out.index_add_(0, indices, g.to(out.dtype))
        return out, None


def index_first_axis(input: Tensor, indices: Tensor) -> Tensor:  # noqa: A002 - flash_attn's parameter name
    """``input[indices]`` along the first axis (``input (N, ...)``, ``indices (n,)`` int64), differentiable
    in ``input``."""
    return IndexFirstAxis.apply(input, indices)


def index_first_axis_residual(input: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:  # noqa: A002
    """``(input[indices], input)`` as ``IndexFirstAxisResidual``: the residual carries the gradient of both."""
    return IndexFirstAxisResidual.apply(input, indices)


def index_put_first_axis(values: Tensor, indices: Tensor, first_axis_dim: int) -> Tensor:
    """Zeros ``(first_axis_dim, ...)`` with ``values (n, ...)`` written at rows ``indices``; differentiable."""
    return IndexPutFirstAxis.apply(values, indices, first_axis_dim)


def _check(hidden: Tensor, mask: Tensor, name: str) -> None:
    if not isinstance(hidden, Tensor) or not isinstance(mask, Tensor):
        raise TypeError(f"hidden_states and {name} must be tensors")
    if mask.dim() != 2 or hidden.dim() < 2 or tuple(hidden.shape[:2]) != tuple(mask.shape):
        raise ValueError(f"{name} must be (batch, seqlen) matching hidden_states' first two dims, got "
                         f"{tuple(mask.shape)} for hidden_states {tuple(hidden.shape)}")


def unpad_input(hidden_states: Tensor, attention_mask: Tensor,
                unused_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, int, Tensor]:
    """Pack the tokens where ``attention_mask`` (``(B, s)``, bool/int, 1 = valid) is set.

    ``unused_mask`` (``(B, s)``) marks tokens that are packed but not attended (flash_attn's
    ``seqused``): they count in ``cu_seqlens`` but not in the returned ``seqused``.

    Returns ``(hidden (total, ...), indices (total,) int64 into the flattened ``B * s``, cu_seqlens
    (B + 1,) int32, max_seqlen_in_batch (int), seqused (B,) int32)``.
    """
    _check(hidden_states, attention_mask, "attention_mask")
    valid = attention_mask.bool()
    everything = valid | unused_mask.bool() if unused_mask is not None else valid
    seqlens = everything.sum(dim=-1, dtype=torch.int32)
    used = valid.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(everything.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen, used


def pad_input(hidden_states: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """Scatter packed ``hidden_states (total, ...)`` back to ``(batch, seqlen, ...)`` with zeros elsewhere."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])


def unpad_input_for_concatenated_sequences(hidden_states: Tensor,
                                           attention_mask_in_length: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """Unpad rows that each hold several concatenated sequences.

    ``attention_mask_in_length (B, s)``: row ``b`` lists the lengths of its sequences first (then
    zeros), e.g. ``[2, 3, 0, 0, 0]`` for two sequences of 2 and 3 tokens. Every sequence becomes its
    own varlen sequence. Returns ``(hidden (total, ...), indices, cu_seqlens int32, max_seqlen)``.
    """
    _check(hidden_states, attention_mask_in_length, "attention_mask_in_length")
    lens = attention_mask_in_length
    s = lens.shape[1]
    seqlens = lens[lens > 0].to(torch.int32)
    valid = torch.arange(s, device=lens.device)[None, :] < lens.sum(dim=-1, keepdim=True)
    indices = torch.nonzero(valid.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen
