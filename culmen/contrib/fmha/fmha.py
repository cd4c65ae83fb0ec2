"""``apex.contrib.fmha.fmha``: ``FMHAFun`` and ``FMHA``, fused attention over packed variable-length
sequences (BERT's unpadded batches) on culmen's varlen FlashAttention kernels.

Apex's FMHA kernels took fp16 only, head dim 64 and sequences up to 512 tokens; culmen's take
fp16/bf16/fp32 (fp64 on the reference), head dims up to 512 and any length. Packed rows past
``cu_seqlens[-1]`` belong to no sequence: with ``zero_tensors`` their output and gradient are 0, otherwise
they are left unspecified (as in Apex).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.contrib.multihead_attn._core import attn_plan, check_dropout, rng_state
from culmen.ops.common.function import raw_apply


def _check(qkv, cu_seqlens, p_dropout, max_s) -> None:
    if not isinstance(qkv, Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must be (total, 3, heads, head_dim), got shape {tuple(qkv.shape)}")
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D (batch + 1,), got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if isinstance(max_s, bool) or not isinstance(max_s, int) or max_s <= 0:
        raise ValueError(f"max_s must be a positive int, got {max_s!r}")
    check_dropout(p_dropout)


def _outside(cu: Tensor, total: int) -> Tensor:
    """Bool ``(total,)``: rows in no sequence (from ``cu[-1]`` on)."""
    return torch.arange(total, device=cu.device) >= cu[-1]


class FMHAFun(torch.autograd.Function):
    """``FMHAFun.apply(qkv, cu_seqlens, p_dropout, max_s, is_training, zero_tensors)``.

    Args:
        qkv: ``(total, 3, heads, head_dim)`` packed tokens of every sequence (fp16/bf16/fp32).
        cu_seqlens: int32 ``(batch + 1,)`` sequence starts (``cu_seqlens[0] == 0``).
        p_dropout: attention-probability dropout in ``[0, 1)``, applied when ``is_training``.
        max_s: the longest sequence (an upper bound is fine).
        zero_tensors: zero the output and gradient rows past ``cu_seqlens[-1]``.

    Returns the context ``(total, heads, head_dim)``; the backward gives ``dqkv`` like ``qkv``.
    """

    @staticmethod
    def forward(ctx, qkv, cu_seqlens, p_dropout, max_s, is_training, zero_tensors):
        _check(qkv, cu_seqlens, p_dropout, max_s)
        p = float(p_dropout) if is_training else 0.0
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        plan = attn_plan("varlen", q, k, v, cu_seqlens, cu_seqlens, max_s, max_s, p, qkv.shape[-1] ** -0.5, False)
        rng = rng_state(p, qkv.device)
        out, lse, _ = plan.forward(q, k, v, None, rng, cu_seqlens, cu_seqlens, True)
        if zero_tensors:
            out.masked_fill_(_outside(cu_seqlens, out.shape[0])[:, None, None], 0.0)
        ctx.plan, ctx.zero_tensors = plan, bool(zero_tensors)
        ctx.save_for_backward(qkv, out, lse, rng, cu_seqlens)
        return out

    @staticmethod
    def backward(ctx, dout):
        qkv, out, lse, rng, cu = ctx.saved_tensors
        dq, dk, dv = ctx.plan.backward(dout, qkv[:, 0], qkv[:, 1], qkv[:, 2], out, lse, None, rng, cu, cu)
        dqkv = torch.stack((dq, dk, dv), dim=1)
        if ctx.zero_tensors:
            dqkv.masked_fill_(_outside(cu, dqkv.shape[0])[:, None, None, None], 0.0)
        return dqkv, None, None, None, None, None


_fmha = raw_apply(FMHAFun)


class FMHA(torch.nn.Module):
    """Apex's ``FMHA`` module, configured from a BERT-style ``config`` with ``attention_probs_dropout_prob``,
    ``num_attention_heads`` and ``hidden_size`` (divisible by the heads)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.p_dropout = check_dropout(config.attention_probs_dropout_prob)
        self.h = config.num_attention_heads
        self.hidden_size = config.hidden_size
        if isinstance(self.h, bool) or not isinstance(self.h, int) or self.h <= 0 or self.hidden_size % self.h:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                             f"({self.h!r})")
        self.d = self.hidden_size // self.h

    def forward(self, qkv: Tensor, cu_seqlens: Tensor, max_s: int, is_training: bool = True,
                zero_tensors: bool = False) -> Tensor:
        """``qkv (total, 3 * hidden)`` (or any shape viewable as ``(total, 3, heads, head_dim)``) ->
        context ``(total, hidden)``."""
        if not isinstance(qkv, Tensor) or qkv.numel() % (3 * self.hidden_size):
            raise ValueError(f"qkv must hold (total, 3 * {self.hidden_size}) elements, got "
                             f"{tuple(qkv.shape) if isinstance(qkv, Tensor) else type(qkv).__name__}")
        ctx = _fmha(qkv.view(-1, 3, self.h, self.d), cu_seqlens, self.p_dropout, max_s, is_training, zero_tensors)
        return ctx.view(-1, self.hidden_size)


__all__ = ["FMHA", "FMHAFun"]
