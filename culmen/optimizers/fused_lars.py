"""``FusedLARS``: ROCm Apex's fused LARS (SGD with a per-layer trust ratio, ``amp_C.multi_tensor_lars``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from culmen.multi_tensor_apply import amp_C, multi_tensor_applier
from culmen.optimizers._base import FusedOptimizer, check_hyper, required


class FusedLARS(FusedOptimizer):
    """LARS: momentum SGD whose rate is scaled per tensor by ``||p|| / ||g||``; two norms + one update launch.

    A drop-in for ROCm Apex's ``apex.optimizers.FusedLARS``. Per tensor, with ``wd`` the weight decay::

        trust = trust_coefficient * ||p|| / (||g|| + wd * ||p|| + eps)   if ||g|| > 0 and ||p|| > 0, else 1
        lr_t  = lr (group["is_skipped"]) or lr * trust

    and per element (fp32 math; the momentum buffer holds the rate-scaled step, the LARS paper's form)::

        g += wd * p (unless wd_after_momentum)
        buf = -lr_t g on a param's first step, else momentum * buf - (1 - dampening) * lr_t * g
        d = momentum * buf - lr_t g (nesterov) or buf   (d = -lr_t g without momentum)
        d -= lr_t * wd * p (wd_after_momentum);  p += d

    Args:
        params: iterable of params or of param-group dicts (fp32/fp16/bf16, several devices allowed).
        lr: learning rate (required). momentum, dampening, weight_decay: default 0.
        trust_coefficient: default 0.001. eps: default 0.0. nesterov: default False.
        wd_after_momentum: default False. materialize_master_grads: kept for signature compatibility.
        set_grad_none: default False.

    A group may set ``is_skipped=True`` (e.g. for biases and norms) to use plain ``lr``; the default is
    False (ROCm's version needs the key in every group). ``trust_coefficient`` and ``eps`` are read per
    group.

    State (per param): ``momentum_buffer`` (param dtype; only with ``momentum != 0``).

    GradScaler: ``_step_supports_amp_scaling`` is True; the gradients are unscaled (one multi-tensor
    multiply per device and dtype) before their norms, and ``found_inf`` skips the update in the kernel,
    with no host sync.
    """

    def __init__(self, params: Iterable, lr: float = required, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001, eps: float = 0.0,
                 nesterov: bool = False, wd_after_momentum: bool = False, materialize_master_grads: bool = True,
                 set_grad_none: bool = False) -> None:
        check_hyper(type(self).__name__, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                    trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"{type(self).__name__}: nesterov=True requires momentum > 0 and dampening == 0, got "
                             f"momentum={momentum!r}, dampening={dampening!r}")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        trust_coefficient=trust_coefficient, eps=eps, is_skipped=False)
        super().__init__(params, defaults)
        self.wd_after_momentum = bool(wd_after_momentum)
        self.materialize_master_grads = bool(materialize_master_grads)
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        self.set_grad_none = bool(set_grad_none)
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self._step_supports_amp_scaling = True

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)
            group.setdefault("is_skipped", False)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """One LARS step over every param with a gradient; returns ``closure()``'s loss if given."""
        loss, grad_scaler = self._begin_step(closure, kwargs)
        grad_scale, found_inf = self._amp_scaling(grad_scaler)
        inv_scale = self._inv_scale(grad_scale)
        host_scale = 1.0 / self.most_recent_scale
        self._skipped: bool | None = None
        for group in self.param_groups:
            live, grads = self._live(group)
            if not live:
                continue
            momentum = group["momentum"]
            sets = self._state_lists(group, momentum != 0, live, grads,
                                     lambda ps, g=group: self._build(g, ps, found_inf))
            if not sets:
                continue
            self._unscale_grads_(grads, inv_scale)
            dev = live[0].device
            noop = self._noop(dev) if found_inf is None else self._found_inf_flag(found_inf, dev)
            # Per-tensor norms of all params and grads of the group: two multi-tensor launches each.
            zero = self._noop(dev)
            _, p_norms = multi_tensor_applier(amp_C.multi_tensor_l2norm, zero, [live], True)
            _, g_norms = multi_tensor_applier(amp_C.multi_tensor_l2norm, zero, [grads], True)
            if host_scale != 1.0:
                g_norms = g_norms * host_scale  # Apex amp's loss scale: the kernel unscales, the norms must too
            for first, idx, sel, (ps, bufs) in sets:
                gs = grads if idx is None else [grads[i] for i in idx]
                gn, pn = (g_norms, p_norms) if sel is None else (g_norms[sel], p_norms[sel])
                multi_tensor_applier(amp_C.multi_tensor_lars, noop, [gs, ps, gs if bufs is None else bufs], gn, pn,
                                     float(group["lr"]), group["trust_coefficient"], group["eps"],
                                     group["weight_decay"], momentum, group["dampening"], group["nesterov"], first,
                                     self.wd_after_momentum, host_scale, bool(group["is_skipped"]))
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        return loss

    def _build(self, group: dict, live: list[Tensor], found_inf: Tensor | None) -> tuple[list, bool]:
        """``[(first_run, grad indices | None, device indices | None, [params, buffers | None])]`` (as
        FusedSGD's: params on their first step are a launch of their own)."""
        if group["momentum"] == 0:  # no buffers: the gradients stand in (the kernel never touches them)
            return [(False, None, None, [list(live), None])], True
        sets = self._momentum_sets(group, live, found_inf, torch.zeros_like)
        out = []
        for first, idx in sets.items():
            ps = [live[i] for i in idx]
            whole = len(idx) == len(live)
            out.append((first, None if whole else idx, None if whole else torch.tensor(idx, device=live[0].device),
                        [ps, [self.state[p]["momentum_buffer"] for p in ps]]))
        return out, len(sets) == 1 and False in sets


Fused_LARS = FusedLARS
"""ROCm Apex's class name."""
