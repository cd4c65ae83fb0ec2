"""``apex.contrib.multihead_attn.encdec_multihead_attn_func``: the ``default`` implementation of
encoder-decoder attention, in plain differentiable PyTorch."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from culmen.contrib.multihead_attn.self_multihead_attn_func import default_attention


def encdec_attn_func(use_time_mask: bool, is_training: bool, heads: int, scale: float, inputs_q: Tensor,
                     inputs_kv: Tensor, input_weights_q: Tensor, input_weights_kv: Tensor, output_weights: Tensor,
                     input_biases_q: Tensor | None, input_biases_kv: Tensor | None, output_biases: Tensor | None,
                     mask: Tensor | None, dropout_prob: float, is_additive_mask: bool = False) -> Tensor:
    """Encoder-decoder attention in plain PyTorch: queries from ``inputs_q (sq, batch, embed)`` through
    ``input_weights_q (embed, embed)``, keys and values from ``inputs_kv (sk, batch, embed)`` through
    ``input_weights_kv (2 * embed, embed)`` (per-head ``(k, v)`` pairs). ``mask``: a time mask ``(sq, sk)``
    when ``use_time_mask``, else a key-padding mask ``(batch, sk)``; ``is_additive_mask`` (culmen's
    addition) adds a float key-padding mask. Returns ``(sq, batch, embed)``.
    """
    sq, b, e = inputs_q.shape
    sk = inputs_kv.shape[0]
    d = e // heads
    q = F.linear(inputs_q, input_weights_q, input_biases_q).view(sq, b * heads, d)
    kv = F.linear(inputs_kv, input_weights_kv, input_biases_kv).view(sk, b * heads, 2, d)
    ctx = default_attention(q, kv[:, :, 0], kv[:, :, 1], heads, scale, mask, use_time_mask, is_additive_mask,
                            is_training, dropout_prob)
    return F.linear(ctx.reshape(sq, b, e), output_weights, output_biases)


class EncdecAttnFunc:
    """Apex's autograd-function name: ``EncdecAttnFunc.apply(...)`` is ``encdec_attn_func(...)``."""

    apply = staticmethod(encdec_attn_func)


__all__ = ["EncdecAttnFunc", "encdec_attn_func"]
