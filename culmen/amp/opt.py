"""``OptimWrapper``: the optimizer wrapper of the deprecated ``amp.init()`` API (Apex's ``amp.opt``).

One dynamic ``LossScaler`` per loss; ``scale_loss(loss)`` is used once per loss per step, in order.
When several losses share the optimizer, the gradients accumulated so far are set aside before each
later loss's backward, so every loss is unscaled with its own scale, then added back. ``step()`` is
skipped when any loss of the step overflowed.

Difference from Apex: late Apex releases passed the parameters (not their gradients) to the
scaler's unscale here, which scaled the weights; culmen unscales the gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from culmen.amp._amp_state import master_params, maybe_print
from culmen.amp.scaler import LossScaler

__all__ = ["OptimWrapper"]


class OptimWrapper:
    """Wraps ``optimizer`` for ``num_loss`` losses (returned by ``AmpHandle.wrap_optimizer``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, amp_handle: Any, num_loss: int) -> None:
        self._optimizer = optimizer
        self._amp_handle = amp_handle
        self._num_loss = num_loss
        self._loss_idx = 0
        self._skip_next = [False] * num_loss
        self._loss_scaler = [LossScaler("dynamic") for _ in range(num_loss)]

    @contextlib.contextmanager
    def scale_loss(self, loss: Tensor) -> Iterator[Tensor]:
        """Yield the loss scaled by the current loss's scaler; unscale and check on exit."""
        if not self._amp_handle.is_active():
            yield loss
            return
        cached_grads: list[Tensor | None] = []
        if self._loss_idx > 0:
            for p in master_params(self._optimizer):
                cached_grads.append(p.grad.detach().clone() if p.grad is not None else None)
            self._optimizer.zero_grad()
        scaler = self._cur_loss_scaler()
        loss_scale = scaler.loss_scale()
        yield loss.float() * loss_scale
        scaler.clear_overflow_state()
        grads = [p.grad for p in master_params(self._optimizer) if p.grad is not None]
        scaler.unscale(grads, grads, loss_scale, models_are_masters=True)
        self._skip_next[self._loss_idx] = scaler.update_scale()
        self._loss_idx += 1
        if cached_grads:
            for p, cached in zip(master_params(self._optimizer), cached_grads):
                if cached is None:
                    continue
                if p.grad is None:
                    p.grad = cached
                else:
                    p.grad.add_(cached)

    def _cur_loss_scaler(self) -> LossScaler:
        if not 0 <= self._loss_idx < self._num_loss:
            raise RuntimeError(f"OptimWrapper.scale_loss was used more than num_loss={self._num_loss} times before "
                               "step(); pass the number of losses to handle.wrap_optimizer(optimizer, num_loss).")
        return self._loss_scaler[self._loss_idx]

    def step(self, closure: Any = None) -> Any:
        """Step the wrapped optimizer unless a loss of this step overflowed."""
        if not self._amp_handle.is_active():
            return self._optimizer.step(closure=closure)
        self._loss_idx = 0
        for group in self._optimizer.param_groups:
            for p in group["params"]:
                self._amp_handle.remove_cache(p)
        if closure is not None:
            raise NotImplementedError("The closure argument is not supported by the amp optimizer wrapper.")
        if any(self._skip_next):
            maybe_print("Gradient overflow, skipping update")
            self._skip_next = [False] * self._num_loss
            return None
        return self._optimizer.step()

    def __getattr__(self, attr: str) -> Any:
        if attr == "_optimizer":  # not set yet (e.g. while unpickling): avoid infinite recursion
            raise AttributeError(attr)
        return getattr(self._optimizer, attr)

    def __getstate__(self) -> Any:
        return self._optimizer.__getstate__()

    def __setstate__(self, state: Any) -> None:
        return self._optimizer.__setstate__(state)

    def __repr__(self) -> str:
        return self._optimizer.__repr__()

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict."""
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load the wrapped optimizer's state dict."""
        return self._optimizer.load_state_dict(state_dict)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """Zero the wrapped optimizer's gradients."""
        return self._optimizer.zero_grad(*args, **kwargs)

    def add_param_group(self, param_group: dict) -> None:
        """Add a parameter group to the wrapped optimizer."""
        return self._optimizer.add_param_group(param_group)
