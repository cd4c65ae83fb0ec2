"""``apex.contrib.multihead_attn.fast_encdec_multihead_attn_func``: fast encoder-decoder attention on
culmen's FlashAttention kernels."""

from __future__ import annotations

from torch import Tensor

from culmen.contrib.multihead_attn._core import encdec_attention


def fast_encdec_attn_func(use_time_mask: bool, is_training: bool, heads: int, inputs_q: Tensor, inputs_kv: Tensor,
                          input_weights_q: Tensor, input_weights_kv: Tensor, output_weights: Tensor,
                          pad_mask: Tensor | None = None, dropout_prob: float = 0.0, *,
                          input_biases_q: Tensor | None = None, input_biases_kv: Tensor | None = None,
                          output_biases: Tensor | None = None, mask_additive: bool = False) -> Tensor:
    """Attention of ``inputs_q (sq, batch, embed)`` over ``inputs_kv (sk, batch, embed)``.

    ``input_weights_q (embed, embed)``, ``input_weights_kv (2 * embed, embed)`` (per-head ``(k, v)``
    rows), ``output_weights (embed, embed)``. ``pad_mask``: a time mask ``(sq, sk)`` when
    ``use_time_mask``, else a key-padding mask ``(batch, sk)`` or ``None``. The keyword-only biases and
    ``mask_additive`` are culmen's additions (Apex's fast kernel has neither). Returns ``(sq, batch, embed)``.
    """
    return encdec_attention(inputs_q, inputs_kv, heads, input_weights_q, input_weights_kv, output_weights,
                            input_biases_q, input_biases_kv, output_biases, pad_mask, use_time_mask, mask_additive,
                            dropout_prob if is_training else 0.0)


class FastEncdecAttnFunc:
    """Apex's autograd-function name: ``FastEncdecAttnFunc.apply(...)`` is ``fast_encdec_attn_func(...)``."""

    apply = staticmethod(fast_encdec_attn_func)


__all__ = ["FastEncdecAttnFunc", "fast_encdec_attn_func"]
