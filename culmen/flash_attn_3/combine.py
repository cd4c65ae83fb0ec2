"""``flash_attn_combine`` (FA3's name): merge split-KV partial results by their log-sum-exp. The kernel and its
reference live in ``culmen.ops.attention.combine`` (the split-KV decoding path of the KV-cache op uses them too)."""

from culmen.ops.attention.combine import combine_ref, flash_attn_combine

__all__ = ["flash_attn_combine", "combine_ref"]
