"""``apex.fused_dense`` on culmen: ``FusedDense``, ``FusedDenseGeluDense`` and their functionals."""

from culmen.fused_dense.fused_dense import (
    DenseNoBiasFunc,
    FusedDense,
    FusedDenseFunc,
    FusedDenseGeluDense,
    FusedDenseGeluDenseFunc,
    dense_no_bias_function,
    fused_dense_function,
    fused_dense_gelu_dense_function,
)

__all__ = [
    "DenseNoBiasFunc",
    "FusedDense",
    "FusedDenseFunc",
    "FusedDenseGeluDense",
    "FusedDenseGeluDenseFunc",
    "dense_no_bias_function",
    "fused_dense_function",
    "fused_dense_gelu_dense_function",
]
