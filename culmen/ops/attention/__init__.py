"""FlashAttention: the reference (``reference.py``, the oracle and today's path on every device),
the replayable Philox dropout mask (``dropout.py``), and the custom ops ``culmen::flash_attn_fwd`` /
``_bwd`` / ``_varlen_fwd`` / ``_varlen_bwd`` with the entry points ``flash_attn`` /
``flash_attn_varlen`` (``op.py``). The Triton kernels plug into the same ops in a later phase.
"""

from culmen.ops.attention.dropout import dropout_keep_mask, philox_rand
from culmen.ops.attention.op import flash_attn, flash_attn_varlen
from culmen.ops.attention.reference import attention_ref

__all__ = ["attention_ref", "dropout_keep_mask", "flash_attn", "flash_attn_varlen", "philox_rand"]
