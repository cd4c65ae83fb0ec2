"""The ``flash_attn`` API on culmen (``import culmen.flash_attn as flash_attn``).

Today it holds the normalization ops (``culmen.flash_attn.ops.triton.layer_norm`` and the legacy
``culmen.flash_attn.ops.layer_norm`` / ``ops.rms_norm``); the attention interface
(``flash_attn_func`` ...) arrives in a later issue. ``__version__`` is the flash_attn release whose
API this package follows.
"""

__version__ = "2.8.3"
