"""``apex.contrib.layer_norm``: ``FastLayerNorm``, LayerNorm over the last dim for any hidden size."""

from culmen.contrib.layer_norm.layer_norm import FastLayerNorm

__all__ = ["FastLayerNorm"]
