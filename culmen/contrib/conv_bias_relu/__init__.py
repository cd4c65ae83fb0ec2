"""``apex.contrib.conv_bias_relu``: convolutions fused with their bias / scale / mask / ReLU epilogue (see
``conv_bias_relu.py`` for what differs from Apex's cuDNN-frontend version)."""

from culmen.contrib.conv_bias_relu.conv_bias_relu import (
    ROUTING,
    ConvBias,
    ConvBiasMaskReLU,
    ConvBiasReLU,
    ConvFrozenScaleBiasReLU,
)

__all__ = ["ConvBias", "ConvBiasMaskReLU", "ConvBiasReLU", "ConvFrozenScaleBiasReLU", "ROUTING"]
