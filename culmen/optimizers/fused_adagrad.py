"""``FusedAdagrad``: Apex's fused Adagrad (``amp_C.multi_tensor_adagrad``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from culmen.multi_tensor_apply import amp_C, multi_tensor_applier
from culmen.optimizers._base import FusedOptimizer, check_hyper

ADAGRAD_MODE_L2, ADAGRAD_MODE_DECOUPLED = 0, 1


class FusedAdagrad(FusedOptimizer):
    """Adagrad in one launch per (device, dtype) of each param group.

    Update (fp32 math): L2 mode ``g += wd*p; h += g*g; p -= lr * g / (sqrt(h) + eps)``; with
    ``adagrad_w_mode`` the decay is decoupled: ``h += g*g; p -= lr * (g / (sqrt(h) + eps) + wd*p)``.
    Matches ``torch.optim.Adagrad(lr, lr_decay=0, weight_decay, initial_accumulator_value=0, eps)`` in
    L2 mode.

    Args:
        params: iterable of params or of param-group dicts.
        lr: learning rate. Default 1e-2.
        eps: added to ``sqrt(h)``. Default 1e-10.
        weight_decay: default 0.
        set_grad_none: ``zero_grad()`` sets grads to ``None``. Default True.
        adagrad_w_mode: decoupled weight decay. Default False.

    State (per param): ``sum`` (fp32, shape of the param; fp32 also for 16-bit params, whose squared
    gradients would overflow fp16 after a few steps; Apex keeps it in the param dtype).

    Unlike Apex, the params of a group may live on several devices (one launch per device and dtype).
    GradScaler: as :class:`~culmen.optimizers.FusedSGD` (grads unscaled by one multi-tensor multiply, the
    kernel skipped on ``found_inf``, no host sync).
    """

    def __init__(self, params: Iterable, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 set_grad_none: bool = True, adagrad_w_mode: bool = False) -> None:
        check_hyper(type(self).__name__, lr=lr, eps=eps, weight_decay=weight_decay)
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adagrad_w_mode = ADAGRAD_MODE_DECOUPLED if adagrad_w_mode else ADAGRAD_MODE_L2
        self.set_grad_none = bool(set_grad_none)
        self._step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """One Adagrad step over every param with a gradient; returns ``closure()``'s loss if given."""
        loss, grad_scaler = self._begin_step(closure, kwargs)
        grad_scale, found_inf = self._amp_scaling(grad_scaler)
        inv_scale = self._inv_scale(grad_scale)
        for group in self.param_groups:
            live, grads = self._live(group)
            if not live:
                continue
            ps, sums = self._zero_state_lists(group, live, grads, ("sum",))
            self._unscale_grads_(grads, inv_scale)
            dev = live[0].device
            noop = self._noop(dev) if found_inf is None else self._found_inf_flag(found_inf, dev)
            multi_tensor_applier(amp_C.multi_tensor_adagrad, noop, [grads, ps, sums], float(group["lr"]),
                                 group["eps"], self.adagrad_w_mode, group["weight_decay"])
        return loss
