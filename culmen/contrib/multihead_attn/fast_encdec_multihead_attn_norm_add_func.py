"""``apex.contrib.multihead_attn.fast_encdec_multihead_attn_norm_add_func``: encoder-decoder attention
with a pre-LayerNorm on the queries' input and the residual dropout-add."""

from __future__ import annotations

from torch import Tensor

from culmen.contrib.multihead_attn._core import encdec_attention


def fast_encdec_attn_norm_add_func(use_time_mask: bool, is_training: bool, heads: int, inputs_q: Tensor,
                                   inputs_kv: Tensor, lyr_nrm_gamma_weights: Tensor, lyr_nrm_beta_weights: Tensor,
                                   input_weights_q: Tensor, input_weights_kv: Tensor, output_weights: Tensor,
                                   pad_mask: Tensor | None = None, dropout_prob: float = 0.0, *,
                                   input_biases_q: Tensor | None = None, input_biases_kv: Tensor | None = None,
                                   output_biases: Tensor | None = None, mask_additive: bool = False) -> Tensor:
    """``inputs_q + dropout(attn(layer_norm(inputs_q), inputs_kv))``: the LayerNorm (``(embed,)`` gamma and
    beta, eps 1e-5) normalizes the queries' input only; ``dropout_prob`` drops probabilities and the output
    (when ``is_training``). Other arguments as ``fast_encdec_attn_func``."""
    p = dropout_prob if is_training else 0.0
    return encdec_attention(inputs_q, inputs_kv, heads, input_weights_q, input_weights_kv, output_weights,
                            input_biases_q, input_biases_kv, output_biases, pad_mask, use_time_mask, mask_additive, p,
                            norm=(lyr_nrm_gamma_weights, lyr_nrm_beta_weights), out_dropout_p=p)


class FastEncdecAttnNormAddFunc:
    """Apex's autograd-function name: ``.apply(...)`` is ``fast_encdec_attn_norm_add_func(...)``."""

    apply = staticmethod(fast_encdec_attn_norm_add_func)


__all__ = ["FastEncdecAttnNormAddFunc", "fast_encdec_attn_norm_add_func"]
