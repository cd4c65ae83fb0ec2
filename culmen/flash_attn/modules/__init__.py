"""flash_attn's ``modules`` (``mha`` with ``FlashSelfAttention`` / ``FlashCrossAttention``)."""
