"""``apex.contrib.layer_norm``: ``FastLayerNorm`` / ``FastRMSNorm`` over the last dim for any hidden size."""

from culmen.contrib.layer_norm.layer_norm import FastLayerNorm, FastRMSNorm

__all__ = ["FastLayerNorm", "FastRMSNorm"]
