"""``apex.mlp`` on culmen: ``MLP`` (a stack of linear layers with one activation) and ``mlp_function``."""

from culmen.mlp.mlp import MLP, MlpFunction, mlp_function

__all__ = ["MLP", "MlpFunction", "mlp_function"]
