"""``apex.contrib.torchsched.ops``: the layer-norm operator functions of Apex's torchsched (see ``layer_norm``)."""

from culmen.contrib.torchsched.ops import layer_norm  # noqa: F401 (Apex imports the module for its ops)

__all__: list[str] = []
