"""``apex.contrib.multihead_attn.fast_self_multihead_attn_func``: fast self-attention on culmen's
FlashAttention kernels (see ``culmen.contrib.multihead_attn._core`` for the layouts and mask rules)."""

from __future__ import annotations

from torch import Tensor

from culmen.contrib.multihead_attn._core import self_attention


def fast_self_attn_func(use_time_mask: bool, is_training: bool, heads: int, inputs: Tensor, input_weights: Tensor,
                        output_weights: Tensor, input_biases: Tensor | None = None,
                        output_biases: Tensor | None = None, pad_mask: Tensor | None = None,
                        mask_additive: bool = False, dropout_prob: float = 0.0) -> Tensor:
    """Self-attention of ``inputs (seq, batch, embed)`` (fp16/bf16/fp32; fp64 runs the reference kernels).

    Args:
        use_time_mask: ``pad_mask`` is a time mask ``(seq, seq)`` (nonzero = masked) rather than a key
            padding mask ``(batch, seq)``.
        is_training: apply ``dropout_prob`` to the attention probabilities.
        heads: number of heads (divides ``embed``).
        input_weights: ``(3 * embed, embed)``, per-head ``(q, k, v)`` rows; ``output_weights``
            ``(embed, embed)``; biases ``(3 * embed,)`` / ``(embed,)`` or ``None``.
        pad_mask: the mask or ``None``; with ``mask_additive`` a float key-padding mask added to the scores.

    Returns ``(seq, batch, embed)``, differentiable in ``inputs``, the weights and the biases.
    """
    return self_attention(inputs, heads, input_weights, input_biases, output_weights, output_biases, pad_mask,
                          use_time_mask, mask_additive, dropout_prob if is_training else 0.0)


class FastSelfAttnFunc:
    """Apex's autograd-function name: ``FastSelfAttnFunc.apply(...)`` is ``fast_self_attn_func(...)``."""

    apply = staticmethod(fast_self_attn_func)


__all__ = ["FastSelfAttnFunc", "fast_self_attn_func"]
