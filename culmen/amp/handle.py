"""``amp.scale_loss``, ``amp.disable_casts`` and the old API's ``AmpHandle`` / ``NoOpHandle``.

``scale_loss`` (Apex's semantics): yields ``loss.float() * loss_scale``; on exit it unscales the
gradients of every listed optimizer (into the fp32 master gradients under O2), checks them for
inf/NaN with one device-to-host sync, updates the loss scale and, on overflow, makes the next
``optimizer.step()`` a no-op. With ``delay_unscale=True`` the gradients stay scaled (gradient
accumulation: unscale on the last micro-batch).

When every listed optimizer can skip a step on the device (culmen's fused optimizers,
``torch.optim`` with ``fused=True``), even that one sync goes: the overflow flag is handed to the
optimizer as ``found_inf`` and the scale is updated from an asynchronous copy of it, by the same
rule, when it is next read (see :meth:`culmen.amp.scaler.LossScaler.defer_update`).

Differences from Apex:

* ``delay_overflow_check=True`` moves the overflow check (and its sync) to the next
  ``optimizer.step()`` instead of dropping it: Apex skipped the check entirely, so an overflowing
  step was applied.
* A clear ``RuntimeError`` names an optimizer that did not go through ``amp.initialize`` and a
  ``loss_id`` beyond ``num_losses`` (Apex failed with ``AttributeError`` / ``IndexError``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from culmen.amp._amp_state import _amp_state, maybe_print
from culmen.amp.scaler import LossScaler

__all__ = ["AmpHandle", "NoOpHandle", "disable_casts", "scale_loss"]


def _as_optimizer_list(optimizers: Any) -> list[Any]:
    if isinstance(optimizers, (list, tuple)):
        return list(optimizers)
    if isinstance(optimizers, torch.optim.Optimizer) or hasattr(optimizers, "_amp_stash") \
            or hasattr(optimizers, "param_groups"):
        return [optimizers]
    raise TypeError(f"optimizers must be an optimizer returned by amp.initialize or a list of them, "
                    f"got {type(optimizers).__name__}")


def _skips_on_device(optimizer: Any) -> bool:
    """True for optimizers that skip a step on the device given ``found_inf`` (torch's GradScaler
    protocol: ``_step_supports_amp_scaling``), so no host sync is needed to skip an overflowing step."""
    return getattr(optimizer, "_step_supports_amp_scaling", False) is True and isinstance(
        optimizer, torch.optim.Optimizer)


def _check_stash(optimizers: Sequence[Any]) -> None:
    for i, opt in enumerate(optimizers):
        if not hasattr(opt, "_amp_stash"):
            raise RuntimeError(
                f"amp.scale_loss: optimizer {i} ({type(opt).__name__}) was not passed through amp.initialize. "
                "Build the optimizer on the model's parameters first, then call "
                "model, optimizer = amp.initialize(model, optimizer, ...) and use the optimizer it returns "
                "(an optimizer created after amp.initialize is unknown to amp).")


@contextlib.contextmanager
def scale_loss(loss: Tensor, optimizers: Any, loss_id: int = 0, model: torch.nn.Module | None = None,
               delay_unscale: bool = False, delay_overflow_check: bool = False) -> Iterator[Tensor]:
    """Context manager yielding the scaled loss; unscales and checks the gradients on exit.

    Example::

        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()  # a no-op when the gradients overflowed

    Args:
        loss: the loss tensor (any float dtype; it is scaled in fp32).
        optimizers: the optimizer(s) returned by ``amp.initialize`` whose parameters get gradients
            from this loss.
        loss_id: which of the ``num_losses`` loss scalers to use.
        model: unused (Apex kept it for future use).
        delay_unscale: leave the gradients scaled (for all but the last micro-batch of gradient
            accumulation); no unscale, no overflow check, no scale update.
        delay_overflow_check: do the overflow check (and its sync) in the next ``optimizer.step()``.
    """
    if _amp_state.opt_properties is None:
        raise RuntimeError("amp.scale_loss was called before amp.initialize: call "
                           "model, optimizer = amp.initialize(model, optimizer, opt_level=...) first.")
    if not _amp_state.opt_properties.enabled:
        yield loss
        return
    optimizers = _as_optimizer_list(optimizers)
    _check_stash(optimizers)
    if not isinstance(loss_id, int) or not 0 <= loss_id < len(_amp_state.loss_scalers):
        raise RuntimeError(f"amp.scale_loss: loss_id={loss_id!r} but amp.initialize was called with "
                           f"num_losses={len(_amp_state.loss_scalers)} (loss_id must be in 0..num_losses-1).")
    loss_scaler: LossScaler = _amp_state.loss_scalers[loss_id]
    loss_scale = loss_scaler.loss_scale()

    if not _amp_state.opt_properties.master_weights and not loss_scaler.dynamic and loss_scale == 1.0:
        yield loss.float()
        return

    if not delay_unscale:
        for opt in optimizers:
            if not opt._amp_stash.params_have_scaled_gradients:
                opt._prepare_amp_backward()

    yield loss.float() * loss_scale

    if delay_unscale:
        for opt in optimizers:
            opt._amp_stash.params_have_scaled_gradients = True
        return

    loss_scaler.clear_overflow_state()
    for opt in optimizers:
        opt._post_amp_backward(loss_scaler)
        opt._amp_stash.params_have_scaled_gradients = False
    if delay_overflow_check:
        for opt in optimizers:
            opt._amp_stash.pending_checks.append((loss_id, loss_scaler))
        return
    if loss_scaler.can_defer() and all(_skips_on_device(opt) for opt in optimizers):
        # No host sync: the optimizers skip the step on the device; the scale follows one step later.
        found_inf = loss_scaler.defer_update(loss_id)
        for opt in optimizers:
            opt._amp_stash.found_infs.append(found_inf)
        return
    if loss_scaler.update_scale():
        for opt in optimizers:
            opt._amp_stash.skip_reasons.append((loss_id, loss_scaler.loss_scale()))


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Context manager that switches O1's casts off inside the block (a no-op without O1)."""
    engine = _amp_state.cast_engine
    handle = _amp_state.handle
    ctx = engine.disabled() if engine is not None and engine.active else contextlib.nullcontext()
    was = getattr(handle, "_is_active", None)
    if was is not None:
        handle._is_active = False
    try:
        with ctx:
            yield
    finally:
        if was is not None:
            handle._is_active = was


def _grads(param_groups: Sequence[dict]) -> list[Tensor]:
    return [p.grad for g in param_groups for p in g["params"] if p.grad is not None]


class AmpHandle:
    """Handle returned by the deprecated ``amp.init()`` (Apex's ``AmpHandle``).

    ``scale_loss(loss, optimizer)`` scales with the handle's own scaler until ``wrap_optimizer`` is
    called; after that use the wrapper's ``scale_loss``. Unlike late Apex releases, where this method
    only raised "the old API is no longer supported", it works.
    """

    def __init__(self, loss_scale: float | str = "dynamic", enable_caching: bool = True, verbose: bool = False,
                 engine: Any = None) -> None:
        self._enable_caching = enable_caching
        self._verbose = verbose
        self._cache: dict = {}
        self._default_scaler: LossScaler | None = LossScaler(loss_scale)
        self._is_active = True
        self._all_wrappers: list = []
        self._engine = engine

    def is_active(self) -> bool:
        """True while casting is on (False inside ``disable_casts`` or after ``_deactivate``)."""
        return self._is_active and (self._engine is None or self._engine.active)

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        with disable_casts():
            yield

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1):
        """Return an :class:`~culmen.amp.opt.OptimWrapper` with ``num_loss`` dynamic loss scalers."""
        from culmen.amp.opt import OptimWrapper

        self._default_scaler = None
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def scale_loss(self, loss: Tensor, optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
        """Yield ``loss * scale``; on exit unscale the grads and make the next step a no-op on overflow."""
        if not self.is_active():
            yield loss
            return
        if self._default_scaler is None:
            raise RuntimeError("After calling handle.wrap_optimizer(), use optimizer.scale_loss(loss) "
                               "(the wrapper's method) instead of handle.scale_loss.")
        scaler = self._default_scaler
        loss_scale = scaler.loss_scale()
        yield loss.float() * loss_scale
        scaler.clear_overflow_state()
        grads = _grads(optimizer.param_groups)
        scaler.unscale(grads, grads, loss_scale, models_are_masters=True)
        if scaler.update_scale():
            optimizer_step = optimizer.step

            def skip_step(*args: Any, **kwargs: Any) -> None:
                maybe_print("Gradient overflow, skipping update")
                optimizer.step = optimizer_step

            optimizer.step = skip_step

    def _clear_cache(self) -> None:
        self._cache.clear()

    def _save_func(self, mod: Any, fn: str, func: Any) -> None:
        self._all_wrappers.append((mod, fn, func))

    def _deactivate(self) -> None:
        """Switch casting off and undo the patches (Apex's ``_deactivate``)."""
        for mod, fn, func in self._all_wrappers:
            setattr(mod, fn, func)
        self._all_wrappers = []
        if self._engine is not None:
            self._engine.deactivate()
            if _amp_state.cast_engine is self._engine:
                _amp_state.cast_engine = None
        self._is_active = False

    @property
    def has_cache(self) -> bool:
        """Whether casts are cached (within a model forward)."""
        return self._enable_caching

    @property
    def cache(self) -> dict:
        """Apex's cast cache dict (culmen caches inside torch.autocast; this stays empty)."""
        return self._cache

    def remove_cache(self, param: Tensor) -> None:
        """Drop ``param`` from the cache (kept for Apex's API)."""
        if self.has_cache and param in self.cache:
            del self.cache[param]

    @property
    def verbose(self) -> bool:
        """The ``verbose`` flag given to ``amp.init``."""
        return self._verbose


class NoOpHandle:
    """Handle of ``amp.init(enabled=False)``: nothing is cast or scaled."""

    def is_active(self) -> bool:
        """Always False."""
        return False

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        yield

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1):
        """Return an :class:`~culmen.amp.opt.OptimWrapper` that passes everything through."""
        from culmen.amp.opt import OptimWrapper

        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def scale_loss(self, loss: Tensor, optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
        """Yield ``loss`` unchanged."""
        yield loss

    @property
    def has_cache(self) -> bool:
        """Always False."""
        return False

    @property
    def verbose(self) -> bool:
        """Always False."""
        return False

    def _clear_cache(self) -> None:
        pass

    def _deactivate(self) -> None:
        pass
