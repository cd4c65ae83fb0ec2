"""``flash_attn.ops``: fused building blocks (norms today; more arrive with later issues)."""
