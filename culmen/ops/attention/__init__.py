"""FlashAttention: the Triton kernels (``kernels.py``; the backward in ``kernels_bwd.py``, the split-KV merge in
``combine.py``) behind cached call plans (``launch.py``), the
op-level entry points and their autograd / ``torch.compile`` ops (``op.py``), the KV-cache form
(``kvcache.py``), the reference (``reference.py``, the oracle and the CPU path) and the replayable
Philox dropout mask (``dropout.py``).
"""

from culmen.ops.attention.dropout import dropout_keep_mask, philox_rand
from culmen.ops.attention.op import attention, attention_varlen, flash_attn, flash_attn_varlen
from culmen.ops.attention.reference import attention_ref

__all__ = ["attention", "attention_ref", "attention_varlen", "dropout_keep_mask", "flash_attn", "flash_attn_varlen",
           "philox_rand"]
