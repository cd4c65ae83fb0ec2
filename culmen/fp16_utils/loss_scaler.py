"""The standalone loss scalers of ``apex.fp16_utils`` (``LossScaler`` static, ``DynamicLossScaler``).

``FP16_Optimizer`` uses :class:`culmen.amp.scaler.LossScaler` (as Apex's last releases did); these two
remain for scripts that drive them by hand: ``has_overflow(params)``, ``update_scale(overflow)``,
``backward(loss)`` and ``loss_scale``.

Difference from Apex: the overflow test is ``not isfinite(x).all()``. Apex summed the tensor in fp32
and tested the sum, which reports a false overflow when finite values sum past fp32's range.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["DynamicLossScaler", "LossScaler", "to_python_float"]


def to_python_float(t: Tensor | float) -> float:
    """``t.item()`` for a tensor (``t[0]`` for other indexables, as in Apex)."""
    if hasattr(t, "item"):
        return t.item()
    return t[0]  # type: ignore[index]


class _ScalerBase:
    """What both scalers share: ``loss_scale`` (``cur_scale``), ``scale_gradient`` and ``backward``."""

    cur_scale: float

    @property
    def loss_scale(self) -> float:
        """The current scale."""
        return self.cur_scale

    def scale_gradient(self, module: torch.nn.Module, grad_in: tuple, grad_out: tuple) -> tuple:
        """Backward-hook helper: multiply every incoming gradient by the scale."""
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss: Tensor, retain_graph: bool = False) -> None:
        """``(loss * scale).backward()``."""
        (loss * self.loss_scale).backward(retain_graph=retain_graph)


class LossScaler(_ScalerBase):
    """A static loss scale (``scale``); never reports an overflow."""

    def __init__(self, scale: float = 1) -> None:
        self.cur_scale = scale

    def has_overflow(self, params: Iterable[Tensor]) -> bool:
        """Always False (a static scaler does not check)."""
        return False

    @staticmethod
    def _has_inf_or_nan(x: Tensor) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        """Nothing to update."""


class DynamicLossScaler(_ScalerBase):
    """Dynamic loss scale: divide by ``scale_factor`` on overflow (not below 1), multiply by it after
    ``scale_window`` iterations without one.

    Args:
        init_scale: first scale (Apex's default 2**32).
        scale_factor: back-off divisor and growth multiplier.
        scale_window: iterations without overflow before the scale grows.
    """

    def __init__(self, init_scale: float = 2.0**32, scale_factor: float = 2.0, scale_window: int = 1000) -> None:
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    def has_overflow(self, params: Iterable[Tensor]) -> bool:
        """True when any ``p.grad`` of ``params`` holds an inf or NaN."""
        return any(p.grad is not None and DynamicLossScaler._has_inf_or_nan(p.grad.data) for p in params)

    @staticmethod
    def _has_inf_or_nan(x: Tensor) -> bool:
        return not bool(torch.isfinite(x).all())

    def update_scale(self, overflow: bool) -> None:
        """Apply Apex's rule for one iteration that did (``overflow``) or did not overflow."""
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1
