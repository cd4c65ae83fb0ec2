"""``apex.contrib.multihead_attn.self_multihead_attn_func``: the ``default`` implementation of
self-attention, in plain differentiable PyTorch (the oracle the fast path is checked against)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def default_attention(q: Tensor, k: Tensor, v: Tensor, heads: int, scale: float, mask: Tensor | None,
                      use_time_mask: bool, is_additive_mask: bool, is_training: bool, dropout_prob: float) -> Tensor:
    """Softmax attention of ``q (sq, B * heads, d)`` over ``k``/``v`` ``(sk, B * heads, d)``; returns
    ``(sq, B * heads, d)``. Masks as Apex's default path: a time mask ``(sq, sk)`` or a key-padding mask
    ``(B, sk)`` sets masked scores to ``-inf`` (nonzero = masked); an additive key-padding mask is added."""
    scores = torch.bmm(q.transpose(0, 1), k.transpose(0, 1).transpose(1, 2)) * scale  # (B*h, sq, sk)
    if mask is not None:
        if use_time_mask:
            scores = scores.masked_fill(mask.to(torch.bool), float("-inf"))
        else:
            bh, sq, sk = scores.shape
            s4 = scores.view(bh // heads, heads, sq, sk)
            m = mask[:, None, None, :]
            s4 = s4 + m.to(s4.dtype) if is_additive_mask else s4.masked_fill(m.to(torch.bool), float("-inf"))
            scores = s4.view(bh, sq, sk)
    probs = F.softmax(scores, dim=-1)
    if is_training and dropout_prob > 0.0:
        probs = F.dropout(probs, dropout_prob)
    return torch.bmm(probs, v.transpose(0, 1)).transpose(0, 1)


def self_attn_func(use_time_mask: bool, is_training: bool, heads: int, scale: float, inputs: Tensor,
                   input_weights: Tensor, output_weights: Tensor, input_biases: Tensor | None,
                   output_biases: Tensor | None, mask: Tensor | None, is_additive_mask: bool,
                   dropout_prob: float) -> Tensor:
    """Self-attention of ``inputs (seq, batch, embed)`` in plain PyTorch.

    ``input_weights (3 * embed, embed)`` projects to per-head ``(q, k, v)`` triples (feature ``h * 3 *
    head_dim + j * head_dim + i`` is part ``j`` of head ``h``); ``output_weights (embed, embed)``; biases
    ``(3 * embed,)`` / ``(embed,)`` or ``None``. ``mask``: a time mask ``(seq, seq)`` when
    ``use_time_mask``, else a key-padding mask ``(batch, seq)`` (boolean, or additive when
    ``is_additive_mask``). Dropout of the probabilities only when ``is_training``. Returns ``(seq, batch,
    embed)`` in the inputs' dtype.
    """
    s, b, e = inputs.shape
    d = e // heads
    lin = F.linear(inputs, input_weights, input_biases).view(s, b * heads, 3, d)
    ctx = default_attention(lin[:, :, 0], lin[:, :, 1], lin[:, :, 2], heads, scale, mask, use_time_mask,
                            is_additive_mask, is_training, dropout_prob)
    return F.linear(ctx.reshape(s, b, e), output_weights, output_biases)


class SelfAttnFunc:
    """Apex's autograd-function name: ``SelfAttnFunc.apply(...)`` is ``self_attn_func(...)``."""

    apply = staticmethod(self_attn_func)


__all__ = ["SelfAttnFunc", "self_attn_func"]
