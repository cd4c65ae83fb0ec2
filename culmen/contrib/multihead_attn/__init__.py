"""``apex.contrib.multihead_attn``: multi-head attention on sequence-first ``(seq, batch, embed)``
activations (``SelfMultiheadAttn``, ``EncdecMultiheadAttn``) and the fused masked softmax + dropout
(``fast_mask_softmax_dropout_func``).

``impl="fast"`` runs culmen's FlashAttention (dense, causal for the future time mask, varlen for key
padding), fused softmax and LayerNorm kernels; ``impl="default"`` is plain PyTorch. The functional forms
live in Apex's modules: ``self_multihead_attn_func.self_attn_func``, ``encdec_multihead_attn_func.
encdec_attn_func``, ``fast_self_multihead_attn_func.fast_self_attn_func``,
``fast_self_multihead_attn_norm_add_func.fast_self_attn_norm_add_func``,
``fast_encdec_multihead_attn_func.fast_encdec_attn_func`` and
``fast_encdec_multihead_attn_norm_add_func.fast_encdec_attn_norm_add_func``.
"""

from culmen.contrib.multihead_attn.encdec_multihead_attn import EncdecMultiheadAttn
from culmen.contrib.multihead_attn.mask_softmax_dropout_func import fast_mask_softmax_dropout_func
from culmen.contrib.multihead_attn.self_multihead_attn import SelfMultiheadAttn

__all__ = ["EncdecMultiheadAttn", "SelfMultiheadAttn", "fast_mask_softmax_dropout_func"]
