"""``apex.contrib.multihead_attn.encdec_multihead_attn``: ``EncdecMultiheadAttn``."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import Parameter

from culmen.contrib.multihead_attn._core import encdec_attention
from culmen.contrib.multihead_attn.encdec_multihead_attn_func import encdec_attn_func
from culmen.contrib.multihead_attn.self_multihead_attn import (
    add_norm_params,
    default_norm_input,
    jit_dropout_add,
    pick_mask,
    reset_norm_params,
    residual_dropout_add,
    set_attn_settings,
)


class EncdecMultiheadAttn(nn.Module):
    """Multi-head encoder-decoder attention on sequence-first activations, Apex's ``EncdecMultiheadAttn``:
    queries from ``query``, keys and values both from ``key``.

    Args as ``SelfMultiheadAttn`` (Apex's ``EncdecMultiheadAttn`` has no ``separate_qkv_params`` /
    ``mask_additive``; culmen also accepts ``mask_additive``). Parameters: ``in_proj_weight_q (E, E)``,
    ``in_proj_weight_kv (2E, E)`` (per-head ``(k, v)`` rows), ``out_proj_weight``, with ``bias``
    ``in_proj_bias_q`` / ``in_proj_bias_kv`` / ``out_proj_bias`` (Apex's fast path refuses biases; culmen
    runs them), and the LayerNorm parameters as ``SelfMultiheadAttn``.
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = False,
                 include_norm_add: bool = False, impl: str = "fast", mask_additive: bool = False) -> None:
        super().__init__()
        set_attn_settings(self, embed_dim, num_heads, dropout, bias, include_norm_add, impl, mask_additive)
        e = embed_dim
        self.in_proj_weight_q = Parameter(torch.empty(e, e))
        self.in_proj_weight_kv = Parameter(torch.empty(2 * e, e))
        self.out_proj_weight = Parameter(torch.empty(e, e))
        for name, n in (("in_proj_bias_q", e), ("in_proj_bias_kv", 2 * e), ("out_proj_bias", e)):
            self.register_parameter(name, Parameter(torch.empty(n)) if bias else None)
        add_norm_params(self, e, include_norm_add, impl)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projections, zero biases, LayerNorm ``(1, 0)``."""
        nn.init.xavier_uniform_(self.in_proj_weight_q)
        nn.init.xavier_uniform_(self.in_proj_weight_kv)
        nn.init.xavier_uniform_(self.out_proj_weight)
        if self.bias:
            for b in (self.in_proj_bias_q, self.in_proj_bias_kv, self.out_proj_bias):
                nn.init.zeros_(b)
        reset_norm_params(self)

    def forward(self, query: Tensor, key: Tensor, value: Tensor | None,
                key_padding_mask: Tensor | None = None, need_weights: bool = False,
                attn_mask: Tensor | None = None, is_training: bool = True) -> tuple[Tensor, None]:
        """Attention of ``query (sq, batch, embed)`` over ``key (sk, batch, embed)`` (``value`` is ignored:
        keys and values are both projected from ``key``, as in Apex).

        Masks: ``key_padding_mask (batch, sk)`` or ``attn_mask (sq, sk)``, as ``SelfMultiheadAttn``.
        Returns ``(output (sq, batch, embed), None)``.
        """
        mask, time = pick_mask(key_padding_mask, attn_mask)
        p = self.dropout if is_training else 0.0
        if self.impl == "fast":
            norm = (self.lyr_nrm_gamma_weights, self.lyr_nrm_beta_weights) if self.include_norm_add else None
            out = encdec_attention(query, key, self.num_heads, self.in_proj_weight_q, self.in_proj_weight_kv,
                                   self.out_proj_weight, self.in_proj_bias_q, self.in_proj_bias_kv,
                                   self.out_proj_bias, mask, time, self.mask_additive, p, norm=norm,
                                   out_dropout_p=p)
            return out, None
        x = default_norm_input(self, query, time)
        out = encdec_attn_func(time, is_training, self.num_heads, self.scaling, x, key, self.in_proj_weight_q,
                               self.in_proj_weight_kv, self.out_proj_weight, self.in_proj_bias_q,
                               self.in_proj_bias_kv, self.out_proj_bias, mask, self.dropout, self.mask_additive)
        if self.include_norm_add:
            out = residual_dropout_add(out, query, self.dropout, is_training)
        return out, None


__all__ = ["EncdecMultiheadAttn", "jit_dropout_add"]
