"""culmen: NVIDIA Apex and FlashAttention in Python and Triton.

Importing culmen has no side effects: nothing is compiled, autotuned or run on the GPU until an op
is called. Subpackages mirror Apex's namespaces (``culmen.normalization``, ``culmen.contrib`` ...)
and flash_attn's (``culmen.flash_attn``).

Through the import alias (``culmen.compat``) this module *is* ``apex``, so it offers what Apex's own
``__init__`` did: every subpackage as an attribute (``apex.amp``, ``apex.optimizers``,
``apex.normalization``, ``apex.parallel``, ``apex.fp16_utils``, ``apex.transformer``, ``apex.mlp``,
``apex.fused_dense``, ``apex.contrib``, ``apex.multi_tensor_apply`` ...) and the helpers
``check_cudnn_version_and_warn``, ``deprecated_warning`` and ``DeprecatedFeatureWarning``.

Apex imported ``amp``, ``fp16_utils``, ``optimizers``, ``normalization``, ``parallel`` and
``transformer`` eagerly; culmen loads every subpackage on first attribute access instead (module
``__getattr__``), because several of them import Triton and the kernels (about a second), and
``import culmen`` must stay light. The difference is invisible to attribute access, ``from apex
import amp`` and ``from apex import *`` (``__all__`` names Apex's eager set).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__version__ = "0.1.0"

# Apex's eagerly imported subpackages (its __init__ across versions); loaded by `from culmen import *`.
_APEX_EAGER = ("amp", "fp16_utils", "normalization", "optimizers", "parallel", "transformer")

__all__ = ["__version__", "check_cudnn_version_and_warn", "deprecated_warning", "deterministic_enabled",
           "set_compile_fusion", "set_deterministic", *_APEX_EAGER]


def set_deterministic(flag: bool) -> None:
    """Make every culmen backward bitwise reproducible; see ``culmen.ops.backend.set_deterministic``."""
    from culmen.ops.backend import set_deterministic as _set  # lazy: ``import culmen`` stays light

    _set(flag)


def set_compile_fusion(flag: bool) -> None:
    """Under ``torch.compile``, let Inductor fuse culmen's norms, rotary and activations with their
    neighbours (``True``, the default); see ``culmen.ops.backend.set_compile_fusion``."""
    from culmen.ops.backend import set_compile_fusion as _set

    _set(flag)


def deterministic_enabled() -> bool:
    """Whether culmen's backward passes must be bitwise reproducible (this switch or torch's)."""
    from culmen.ops.backend import deterministic_enabled as _enabled

    return _enabled()


def check_cudnn_version_and_warn(global_option: str, required_cudnn_version: int) -> bool:
    """Apex's helper: True when cuDNN is available at ``required_cudnn_version`` (an int such as 8500)
    or later; otherwise warn that ``global_option`` needs it and return False."""
    import warnings

    import torch

    available = torch.backends.cudnn.is_available()
    version = torch.backends.cudnn.version() if available else None
    if available and version is not None and version >= required_cudnn_version:
        return True
    found = "cuDNN is not available" if not available else f"cuDNN {version} is installed"
    warnings.warn(f"`{global_option}` depends on cuDNN {required_cudnn_version} or later, but {found}",
                  stacklevel=2)
    return False


def deprecated_warning(msg: str) -> None:
    """Apex's helper: warn ``msg`` as a ``DeprecatedFeatureWarning`` (a ``FutureWarning``), on rank 0 only
    when ``torch.distributed`` is initialized."""
    import warnings

    import torch

    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    from culmen.amp._amp_state import DeprecatedFeatureWarning

    warnings.warn(msg, DeprecatedFeatureWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    # Lazy subpackages (see the module docstring); `DeprecatedFeatureWarning` is amp's class, so
    # `except apex.DeprecatedFeatureWarning` also catches what culmen.amp warns.
    if name == "DeprecatedFeatureWarning":
        from culmen.amp._amp_state import DeprecatedFeatureWarning

        return DeprecatedFeatureWarning
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_APEX_EAGER) | {"DeprecatedFeatureWarning", "contrib", "fused_dense",
                                                        "mlp", "multi_tensor_apply", "flash_attn"})
