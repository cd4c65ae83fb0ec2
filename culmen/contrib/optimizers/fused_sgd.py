"""``apex.contrib.optimizers.FusedSGD``: deprecated SGD whose ``step`` takes grads, output params and a scale."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from culmen.contrib.optimizers.fused_adam import _per_group
from culmen.optimizers._base import required
from culmen.optimizers.fused_sgd import FusedSGD as _FusedSGD

__all__ = ["FusedSGD"]


class FusedSGD(_FusedSGD):
    """SGD (momentum, dampening, Nesterov, ``wd_after_momentum``) on :class:`culmen.optimizers.FusedSGD`'s
    kernel, with Apex's old contrib step ``step(closure=None, grads=None, output_params=None, scale=1.0,
    grad_norms=None)``: the gradients (``grads`` per group, or ``p.grad``) are divided by ``scale`` before
    the update (the caller's tensors are not modified) and the new params are copied, cast, into
    ``output_params``. ``grad_norms`` is accepted and unused, as in Apex."""

    def __init__(self, params: Iterable, lr: float = required, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, wd_after_momentum: bool = False,
                 materialize_master_grads: bool = True) -> None:
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov, wd_after_momentum=wd_after_momentum,
                         materialize_master_grads=materialize_master_grads)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, grads: Any = None, output_params: Any = None,
             scale: float = 1.0, grad_norms: Any = None) -> Any:
        """One SGD step (class docstring); returns ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        n = len(self.param_groups)
        grads_g = _per_group("grads", grads, n)
        outs_g = _per_group("output_params", output_params, n)
        saved = [[p.grad for p in g["params"]] for g in self.param_groups]
        try:
            for group, gs in zip(self.param_groups, grads_g):
                params = group["params"]
                src = [p.grad for p in params] if gs is None else list(gs)
                if len(src) != len(params):
                    raise ValueError(f"FusedSGD.step: {len(src)} grads for {len(params)} params")
                for p, g in zip(params, src):
                    p.grad = None if g is None else (g.to(p.dtype) / float(scale) if scale != 1.0 or g.dtype != p.dtype
                                                     else g.clone())
            super().step()
        finally:
            for group, gs in zip(self.param_groups, saved):
                for p, g in zip(group["params"], gs):
                    p.grad = g
        for group, outs in zip(self.param_groups, outs_g):
            if outs is not None:
                for p, o in zip(group["params"], outs):
                    if o is not None:
                        o.copy_(p)
        return loss
