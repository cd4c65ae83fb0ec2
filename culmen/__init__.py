"""culmen: NVIDIA Apex and FlashAttention in Python and Triton.

Importing culmen has no side effects: nothing is compiled, autotuned or run on the GPU until an op
is called. Subpackages mirror Apex's namespaces (``culmen.normalization``, ``culmen.contrib`` ...)
and flash_attn's (``culmen.flash_attn``).
"""

__version__ = "0.1.0"

from culmen.ops.backend import deterministic_enabled, set_deterministic  # noqa: E402

__all__ = ["__version__", "deterministic_enabled", "set_deterministic"]
