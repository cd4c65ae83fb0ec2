"""``apex.contrib.multihead_attn.fast_self_multihead_attn_norm_add_func``: pre-LayerNorm self-attention
with the residual dropout-add, on culmen's LayerNorm and FlashAttention kernels."""

from __future__ import annotations

from torch import Tensor

from culmen.contrib.multihead_attn._core import self_attention


def fast_self_attn_norm_add_func(use_time_mask: bool, is_training: bool, heads: int, inputs: Tensor,
                                 lyr_nrm_gamma_weights: Tensor, lyr_nrm_beta_weights: Tensor,
                                 input_weights: Tensor, output_weights: Tensor, pad_mask: Tensor | None = None,
                                 dropout_prob: float = 0.0, *, input_biases: Tensor | None = None,
                                 output_biases: Tensor | None = None, mask_additive: bool = False) -> Tensor:
    """``inputs + dropout(attn(layer_norm(inputs)))`` for ``inputs (seq, batch, embed)``.

    ``lyr_nrm_gamma_weights`` / ``lyr_nrm_beta_weights``: ``(embed,)`` LayerNorm affine (eps 1e-5). The
    same ``dropout_prob`` drops attention probabilities and the attention output before the residual add,
    both only when ``is_training``. Other arguments as ``fast_self_attn_func``; the keyword-only biases
    and ``mask_additive`` are culmen's additions (Apex's kernel has neither).
    """
    p = dropout_prob if is_training else 0.0
    return self_attention(inputs, heads, input_weights, input_biases, output_weights, output_biases, pad_mask,
                          use_time_mask, mask_additive, p, norm=(lyr_nrm_gamma_weights, lyr_nrm_beta_weights),
                          out_dropout_p=p)


class FastSelfAttnNormAddFunc:
    """Apex's autograd-function name: ``.apply(...)`` is ``fast_self_attn_norm_add_func(...)``."""

    apply = staticmethod(fast_self_attn_norm_add_func)


__all__ = ["FastSelfAttnNormAddFunc", "fast_self_attn_norm_add_func"]
