"""Apex's ``apex.transformer`` (Megatron-core's predecessor) on culmen.

Kept light: importing ``culmen.transformer`` imports only the enums; the submodules
(``functional``, ``parallel_state``, ``tensor_parallel``, ``pipeline_parallel``, ``amp``, ``utils``,
``layers``, ``microbatches``, ``log_util``, ``_data``) load on first attribute access, as
``import apex.transformer`` users expect them to be reachable.
"""

from __future__ import annotations

import importlib

from culmen.transformer.enums import AttnMaskType, AttnType, LayerType, ModelType

__all__ = ["AttnMaskType", "AttnType", "LayerType", "ModelType", "functional"]

_SUBMODULES = (
    "_data", "amp", "functional", "layers", "log_util", "microbatches", "parallel_state", "pipeline_parallel",
    "tensor_parallel", "testing", "utils",
)


def __getattr__(name: str):
    # Lazy submodules: `culmen.transformer.functional` works without importing every subpackage up front.
    if name in _SUBMODULES:
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":  # a real import error inside the submodule
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
