"""Megatron-compatible norms that mark their parameters for sequence parallelism (Apex's
``apex.transformer.layers``)."""

from culmen.transformer.layers.layer_norm import FastLayerNorm, FusedLayerNorm, MixedFusedLayerNorm

__all__ = ["FastLayerNorm", "FusedLayerNorm", "MixedFusedLayerNorm"]
