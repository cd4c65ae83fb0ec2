"""``apex.normalization``: fused LayerNorm / RMSNorm modules and functionals.

``FusedLayerNorm`` and ``FusedRMSNorm`` return the input dtype; ``MixedFusedLayerNorm`` and
``MixedFusedRMSNorm`` return the parameter dtype. The functionals live in
:mod:`culmen.normalization.fused_layer_norm`, as in Apex.
"""

from culmen.normalization.fused_layer_norm import (
    FusedLayerNorm,
    FusedRMSNorm,
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
)

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm"]
