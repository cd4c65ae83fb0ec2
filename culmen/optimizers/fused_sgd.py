"""``FusedSGD``: Apex's fused SGD with momentum (``amp_C.multi_tensor_sgd``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from culmen.multi_tensor_apply import amp_C, multi_tensor_applier
from culmen.ops.backend import choose_backend
from culmen.ops.multi_tensor.sgd import SGDPlan
from culmen.optimizers._base import FusedOptimizer, GroupPlan, check_hyper, required


class FusedSGD(FusedOptimizer):
    """SGD (momentum, dampening, Nesterov, weight decay) in one launch per (device, dtype) of a group.

    A drop-in for ``apex.optimizers.FusedSGD`` and ``torch.optim.SGD``; the update is torch's:
    ``g += wd*p`` (before momentum, or after it with ``wd_after_momentum``); ``buf = g`` on a param's
    first step, else ``buf = momentum*buf + (1-dampening)*g``; ``g = g + momentum*buf`` (Nesterov) or
    ``buf``; ``p -= lr*g``. Math in fp32, params fp32/fp16/bf16 (mixed, on several devices).

    Args:
        params: iterable of params or of param-group dicts.
        lr: learning rate (required).
        momentum, dampening, weight_decay, nesterov: as torch.optim.SGD (defaults 0, 0, 0, False).
        wd_after_momentum: add the weight decay after the momentum update. Default False.
        materialize_master_grads: Apex's amp-O2 switch; kept for signature compatibility (culmen's amp
            keeps no separate fp16 model copies for this optimizer to write). Default True.
        set_grad_none: ``zero_grad()`` sets grads to ``None``. Default False (as Apex).

    State (per param): ``momentum_buffer`` (param dtype and shape; only when ``momentum != 0``), the
    layout of torch.optim.SGD, so its state dicts load either way.

    GradScaler: ``_step_supports_amp_scaling`` is True. The gradients are multiplied by ``1/grad_scale``
    (one multi-tensor launch per device and dtype: ``amp_C.multi_tensor_sgd`` takes its scale as a host
    number) and the kernel does nothing when ``found_inf`` is set; no host sync. Apex's amp-era
    ``most_recent_scale`` (the gradients' loss scale, a host number) is honoured in the kernel.
    """

    def __init__(self, params: Iterable, lr: float = required, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, wd_after_momentum: bool = False,
                 materialize_master_grads: bool = True, set_grad_none: bool = False) -> None:
        check_hyper(type(self).__name__, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                    nesterov=nesterov)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"{type(self).__name__}: nesterov=True requires momentum > 0 and dampening == 0, got "
                             f"momentum={momentum!r}, dampening={dampening!r}")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults)
        self.wd_after_momentum = bool(wd_after_momentum)
        self.materialize_master_grads = bool(materialize_master_grads)
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        self.set_grad_none = bool(set_grad_none)
        self._step_supports_amp_scaling = True

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """One SGD step over every param with a gradient; returns ``closure()``'s loss if given."""
        loss, grad_scaler = self._begin_step(closure, kwargs)
        grad_scale, found_inf = self._amp_scaling(grad_scaler)
        inv_scale = self._inv_scale(grad_scale)
        host_scale = 1.0 / self.most_recent_scale
        self._skipped: bool | None = None
        for group in self.param_groups:
            plan = self._group_plan(group, lambda g, p, gr, m: self._build_plan(g, p, gr, m, found_inf))
            if plan is not None and plan.has_mom != (group["momentum"] != 0):
                # momentum switched on/off: the state lists (buffers or none) are rebuilt
                self._plans.pop(id(group), None)
                plan = self._group_plan(group, lambda g, p, gr, m: self._build_plan(g, p, gr, m, found_inf))
            if plan is None:
                continue
            grads = plan.live_grads
            self._unscale_grads_(grads, inv_scale)
            dev = plan.device
            noop = self._noop(dev) if found_inf is None else self._found_inf_flag(found_inf, dev)
            momentum = group["momentum"]
            args = (float(group["weight_decay"]), float(momentum), float(group["dampening"]), float(group["lr"]))
            if plan.fast:
                key = (args[0] != 0, args[1] != 0, bool(group["nesterov"]))
                plans = plan.variants.get(key)
                if plans is None:
                    plans = plan.variants[key] = [
                        SGDPlan("FusedSGD", [grads if idx is None else [grads[i] for i in idx], ps, bufs], noop,
                                has_wd=key[0], has_mom=key[1], first_run=first, nesterov=key[2],
                                wd_after=self.wd_after_momentum, static=(1, 2))
                        for first, idx, (ps, bufs), _ in plan.calls]
                gkey = plan.gkey
                for sp, (_, _, _, sel) in zip(plans, plan.calls):
                    sp.run(sp.tables.ptrs(gkey if sel is None else sel(gkey)), noop, *args, host_scale)
                continue
            for first, idx, (ps, bufs), _ in plan.calls:
                gs = grads if idx is None else [grads[i] for i in idx]
                multi_tensor_applier(amp_C.multi_tensor_sgd, noop, [gs, ps, gs if bufs is None else bufs], args[0],
                                     momentum, args[2], args[3], group["nesterov"], first, self.wd_after_momentum,
                                     host_scale)
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        return loss

    def _build_plan(self, group: dict, params: list, grads: list, mask: tuple, found_inf) -> GroupPlan:
        plan = GroupPlan(group, params, grads, mask, self._check_live)
        plan.has_mom = group["momentum"] != 0
        sets, plan.cacheable = self._build(group, plan.live, found_inf)
        plan.calls = [(first, idx, lists, plan.select(idx)) for first, idx, lists in sets]
        dev = plan.device
        plan.fast = (plan.cacheable and choose_backend(dev) == "triton"
                     and all(t.device == dev and t.is_contiguous() for t in plan.live_grads)
                     and all(t.device == dev and t.is_contiguous() for _, _, lists, _ in plan.calls
                             for lst in lists if lst is not None for t in lst))
        if plan.fast:  # without momentum the params stand in for the (untouched) buffers
            plan.calls = [(first, idx, (ps, ps if bufs is None else bufs), sel)
                          for first, idx, (ps, bufs), sel in plan.calls]
        return plan

    def _build(self, group: dict, live: list[Tensor], found_inf: Tensor | None) -> tuple[list, bool]:
        """``[(first_run, grad indices | None, [params, momentum buffers])]`` for ``live``.

        Params on their first step (no buffer yet) form their own launch with ``first_run`` (the kernel
        copies the gradient into the new buffer): Apex passes one flag per launch, which is wrong when a
        param's gradient appears later than the others'. Cacheable once every buffer exists.
        """
        if group["momentum"] == 0:  # no buffers: the gradients stand in (the kernel never touches the list)
            return [(False, None, [list(live), None])], True
        sets = self._momentum_sets(group, live, found_inf, torch.empty_like)
        out = []
        for first, idx in sets.items():
            ps = [live[i] for i in idx]
            out.append((first, None if len(idx) == len(live) else idx,
                        [ps, [self.state[p]["momentum_buffer"] for p in ps]]))
        return out, len(sets) == 1 and False in sets
