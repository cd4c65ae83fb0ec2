"""``flash_attn.ops.triton``: the Triton-kernel ops of flash_attn (``layer_norm`` today)."""
