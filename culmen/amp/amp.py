"""Apex's ``apex.amp.amp``: the old ``amp.init()`` API and user cast registration.

* ``half_function`` / ``float_function`` / ``promote_function`` (and ``bfloat16_function``, from
  ROCm's Apex) decorate a function so its floating tensor arguments are cast while O1 is active;
  outside O1 they pass through.
* ``register_half_function(module, name)`` (and the float / promote / bfloat16 forms) ask O1 to
  patch ``module.name`` the same way. Apex applied registrations only at the next ``amp.init`` /
  ``amp.initialize``; culmen also applies one made while O1 is already active.
* ``init(...)`` is the deprecated pre-``initialize`` API (a one-time ``FutureWarning``): it turns on
  O1 casting and returns an :class:`~culmen.amp.handle.AmpHandle`.

Difference from Apex: ``half_function`` casts to the O1 dtype, which is bf16 under O4 (or with
``patch_torch_functions_type=torch.bfloat16``); Apex's ``half_function`` always meant fp16.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from culmen.amp._amp_state import _amp_state, warn_deprecated_once
from culmen.amp._cast_engine import USER_CAST_REGISTRY, CastEngine, make_cast_wrapper

__all__ = [
    "bfloat16_function",
    "float_function",
    "half_function",
    "init",
    "promote_function",
    "register_bfloat16_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
]

F = TypeVar("F", bound=Callable[..., Any])


def half_function(fn: F) -> F:
    """Decorator: cast ``fn``'s fp32 tensor arguments to the O1 dtype (fp16, or bf16 under O4)."""
    return make_cast_wrapper(fn, "half")  # type: ignore[return-value]


def bfloat16_function(fn: F) -> F:
    """Decorator: cast ``fn``'s fp32 tensor arguments to bf16 while O1 casting is active."""
    return make_cast_wrapper(fn, "bfloat16")  # type: ignore[return-value]


def float_function(fn: F) -> F:
    """Decorator: cast ``fn``'s fp16/bf16 tensor arguments to fp32 while O1 casting is active."""
    return make_cast_wrapper(fn, "float")  # type: ignore[return-value]


def promote_function(fn: F) -> F:
    """Decorator: cast ``fn``'s floating tensor arguments to the widest floating dtype among them."""
    return make_cast_wrapper(fn, "promote")  # type: ignore[return-value]


def _register(module: Any, name: str, policy: str) -> None:
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}.")
    USER_CAST_REGISTRY.append((module, name, policy))
    engine = _amp_state.cast_engine
    if engine is not None and engine.active:
        engine.apply_registration(module, name, policy)


def register_half_function(module: Any, name: str) -> None:
    """Have O1 cast the fp32 tensor arguments of ``module.name`` to the O1 dtype."""
    _register(module, name, "half")


def register_bfloat16_function(module: Any, name: str) -> None:
    """Have O1 cast the fp32 tensor arguments of ``module.name`` to bf16."""
    _register(module, name, "bfloat16")


def register_float_function(module: Any, name: str) -> None:
    """Have O1 cast the fp16/bf16 tensor arguments of ``module.name`` to fp32."""
    _register(module, name, "float")


def register_promote_function(module: Any, name: str) -> None:
    """Have O1 promote the floating tensor arguments of ``module.name`` to the widest dtype among them."""
    _register(module, name, "promote")


def _default_device_types() -> list[str]:
    return ["cuda"] if torch.cuda.is_available() else ["cpu"]


def _start_casts(device_types: list[str], dtype: torch.dtype, allow_banned: bool = False, enable_caching: bool = True,
                 verbose: bool = False) -> CastEngine:
    """Switch O1 casting on (replacing an active engine); used by ``init`` and ``initialize``."""
    if _amp_state.cast_engine is not None:
        _amp_state.cast_engine.deactivate()
    engine = CastEngine(device_types, dtype, allow_banned=allow_banned, enable_caching=enable_caching, verbose=verbose)
    engine.activate()
    _amp_state.cast_engine = engine
    return engine


def init(enabled: bool = True, loss_scale: float | str = "dynamic", enable_caching: bool = True, verbose: bool = False,
         allow_banned: bool = False, patch_type: torch.dtype = torch.float16):
    """Deprecated (as in Apex): start O1 casting and return a handle for loss scaling.

    Prefer ``model, optimizer = amp.initialize(model, optimizer, opt_level="O1")``. Casting covers
    CUDA when a GPU is present, else CPU.

    Args:
        enabled: False returns a :class:`~culmen.amp.handle.NoOpHandle` (nothing is cast or scaled).
        loss_scale: ``"dynamic"`` or a number, for ``handle.scale_loss``.
        enable_caching: cache casts of parameters within one forward of an ``amp.initialize``-d model.
        verbose: print the ops culmen registered for Apex's cast lists.
        allow_banned: run ``binary_cross_entropy`` in fp32 instead of raising on 16-bit inputs.
        patch_type: the low-precision dtype of the casts, ``torch.float16`` or ``torch.bfloat16``.

    Returns:
        An ``AmpHandle`` (``wrap_optimizer``, ``scale_loss``, ``is_active``).
    """
    from culmen.amp.handle import AmpHandle, NoOpHandle

    warn_deprecated_once("amp.init", "amp.init() is deprecated (as in Apex); use amp.initialize(model, optimizer, "
                                      "opt_level='O1') or torch.autocast with torch.amp.GradScaler.")
    if not enabled:
        handle = NoOpHandle()
        _amp_state.handle = handle
        return handle
    if patch_type not in (torch.float16, torch.bfloat16):
        raise ValueError(f"amp.init: patch_type must be torch.float16 or torch.bfloat16, got {patch_type!r}")
    engine = _start_casts(_default_device_types(), patch_type, allow_banned=allow_banned,
                          enable_caching=enable_caching, verbose=verbose)
    handle = AmpHandle(loss_scale, enable_caching, verbose, engine=engine)
    _amp_state.handle = handle
    return handle
