"""The global state that amp's modules share (Apex's ``apex.amp._amp_state``).

``_amp_state`` holds what :func:`culmen.amp.initialize` decided: the opt-level ``Properties``, the
loss scalers (one per loss), the O1 cast engine and a few switches Apex exposes as attributes
(``hard_override``, ``allow_incoming_model_not_fp32``, ``verbosity``). ``warn_or_err`` turns an
invalid option combination into a ``RuntimeError`` unless ``_amp_state.hard_override`` is set, in
which case it only prints (as in Apex).

culmen additions (not in Apex): :func:`capture_state` / :func:`restore_state` snapshot the whole
state so that two differently initialized set-ups can share one process (benchmarks, tests).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "AmpState",
    "DeprecatedFeatureWarning",
    "capture_state",
    "master_params",
    "maybe_print",
    "restore_state",
    "warn_deprecated_once",
    "warn_or_err",
]


class DeprecatedFeatureWarning(FutureWarning):
    """Warning category of the APIs Apex had deprecated (old ``amp.init``, ``FP16_Optimizer`` ...)."""


class AmpState:
    """Attribute stash shared by the amp modules (one instance: ``_amp_state``)."""

    def __init__(self) -> None:
        self.hard_override: bool = False
        self.allow_incoming_model_not_fp32: bool = False
        self.verbosity: int = 1
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        # Everything initialize() sets; hard_override / allow_incoming_model_not_fp32 are user switches
        # and survive a reset.
        self.opt_properties: Any = None
        self.loss_scalers: list[Any] = []
        self.handle: Any = None
        self.cast_engine: Any = None
        self.min_loss_scale: float | None = None
        self.max_loss_scale: float = 2.0**24
        self.hysteresis: int = 1


_amp_state = AmpState()

_warned: set[str] = set()


def warn_or_err(msg: str) -> None:
    """Raise ``RuntimeError(msg)``, or only print it when ``_amp_state.hard_override`` is True."""
    if _amp_state.hard_override:
        print("Warning:  " + msg)
    else:
        raise RuntimeError(msg)


def _is_rank0() -> bool:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank() == 0
    return True


def maybe_print(msg: str, rank0: bool = False) -> None:
    """Print ``msg`` when ``verbosity > 0`` (on rank 0 only when ``rank0`` and distributed)."""
    if _amp_state.verbosity > 0 and (not rank0 or _is_rank0()):
        print(msg)


def warn_deprecated_once(key: str, msg: str) -> None:
    """One ``DeprecatedFeatureWarning`` per ``key`` per process, on rank 0 only (as Apex warned)."""
    if key in _warned or not _is_rank0():
        return
    _warned.add(key)
    warnings.warn(msg, DeprecatedFeatureWarning, stacklevel=3)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Iterate over the parameters ``optimizer`` updates: the fp32 master weights under O2.

    Use it to clip gradients when master weights are on:
    ``torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm)``.

    Args:
        optimizer: an optimizer returned by ``amp.initialize`` (any optimizer works).
    """
    lazy_init = getattr(optimizer, "_amp_lazy_init", None)
    if lazy_init is not None:
        # Apex creates the master weights on the first backward; culmen makes sure they exist here so
        # the generator never yields the 16-bit model params by accident.
        lazy_init()
    for group in optimizer.param_groups:
        yield from group["params"]


class _Snapshot:
    __slots__ = ("values",)

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values


def capture_state() -> _Snapshot:
    """Snapshot of the whole amp state (culmen extension; for benchmarks and tests).

    The O1 cast engine is part of the snapshot: :func:`restore_state` switches the current engine off
    and the captured one on, so the snapshot can be restored after another ``initialize``.
    """
    return _Snapshot(dict(_amp_state.__dict__))


def restore_state(snapshot: _Snapshot) -> None:
    """Make ``snapshot`` (from :func:`capture_state`) the current amp state (culmen extension)."""
    current = _amp_state.cast_engine
    target = snapshot.values.get("cast_engine")
    if current is not None and current is not target:
        current.deactivate()
    _amp_state.__dict__.clear()
    _amp_state.__dict__.update(snapshot.values)
    if target is not None and not target.active:
        target.activate()
