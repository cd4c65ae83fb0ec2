"""culmen: NVIDIA Apex and FlashAttention in Python and Triton.

Importing culmen has no side effects: nothing is compiled, autotuned or run on the GPU until an op
is called. Subpackages mirror Apex's namespaces (``culmen.normalization``, ``culmen.contrib`` ...)
and flash_attn's (``culmen.flash_attn``).
"""

__version__ = "0.1.0"

__all__ = ["__version__", "deterministic_enabled", "set_deterministic"]


def set_deterministic(flag: bool) -> None:
    """Make every culmen backward bitwise reproducible; see ``culmen.ops.backend.set_deterministic``."""
    from culmen.ops.backend import set_deterministic as _set  # lazy: ``import culmen`` stays light

    _set(flag)


def deterministic_enabled() -> bool:
    """Whether culmen's backward passes must be bitwise reproducible (this switch or torch's)."""
    from culmen.ops.backend import deterministic_enabled as _enabled

    return _enabled()
