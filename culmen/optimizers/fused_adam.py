"""``FusedAdam``: Apex's fused Adam / AdamW (every tensor of a param group in one launch per dtype and device)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from culmen.ops.backend import choose_backend
from culmen.ops.multi_tensor.adam import (
    ADAM_MODE_ADAMW,
    ADAM_MODE_L2,
    INV_DIVIDE,
    INV_NONE,
    STEP_ADVANCE,
    STEP_AS_IS,
    STEP_NEXT,
    AdamPlan,
    adam_update,
)
from culmen.optimizers._base import FusedOptimizer, GroupPlan, check_hyper

_LOW = (torch.float16, torch.bfloat16)
_F32, _I32 = torch.float32, torch.int32


class FusedAdam(FusedOptimizer):
    """Adam / AdamW whose whole step is one Triton launch per (device, dtype) of each param group.

    A drop-in for ``apex.optimizers.FusedAdam`` (and ``torch.optim.AdamW``, or ``torch.optim.Adam`` with
    ``adam_w_mode=False``). Params may be fp32, fp16 or bf16 (mixed in one optimizer, on several devices);
    params whose ``grad`` is ``None`` are skipped.

    Args:
        params: iterable of params or of param-group dicts.
        lr: learning rate (a number, or a 1-element tensor). Default 1e-3.
        bias_correction: divide the moments by ``1 - beta**step``. Default True.
        betas: ``(beta1, beta2)``, each in ``[0, 1)``. Default (0.9, 0.999).
        eps: added to ``sqrt(v_hat)``. Default 1e-8.
        adam_w_mode: True: decoupled weight decay (AdamW, ``p -= lr*wd*p``); False: L2 penalty added to
            the gradient (Adam). Default True.
        weight_decay: default 0.
        amsgrad: not supported (raises ``RuntimeError``, as Apex does).
        set_grad_none: ``zero_grad()`` sets grads to ``None`` (else zeroes them). Default True.
        capturable: keep ``lr`` and ``step`` on the device so that ``step()`` never syncs with the host
            and can be captured in a CUDA graph. Default False.
        master_weights: keep fp32 master copies of fp16/bf16 params in the optimizer state (key
            ``"master_param"``); the update runs on the master and is rounded into the param in the same
            pass. Unlike Apex, this works without ``capturable`` too. Default False.

    State (per param): ``exp_avg`` and ``exp_avg_sq`` (fp32, shape of the param), ``master_param``
    (fp32, 16-bit params with ``master_weights``). Per group: ``step`` (a host int, or a 1-element int32
    device tensor when ``capturable`` or once a GradScaler drove a step), as in Apex.

    GradScaler: ``_step_supports_amp_scaling`` is True; with ``torch.amp.GradScaler`` the gradients are
    unscaled inside the kernel (by ``1 / grad_scale``) and written back unscaled, so after
    ``scaler.step(opt)`` every ``.grad`` holds what ``scaler.unscale_`` would have left, as with torch's
    optimizers (skipped steps included). A step whose gradients hold inf/NaN changes nothing else (params,
    moments and ``step`` stay), with no host sync. ``step(grad_scaler=...)`` (the older contract) works too.
    """

    def __init__(self, params: Iterable, lr: float | Tensor = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True,
                 capturable: bool = False, master_weights: bool = False) -> None:
        check_hyper(type(self).__name__, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                    bias_correction=bias_correction)
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant (amsgrad=True); "
                               "use torch.optim.Adam(amsgrad=True)")
        self.capturable = bool(capturable)
        self.master_weights = bool(master_weights)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = bool(set_grad_none)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        self._step_supports_amp_scaling = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if getattr(self, "capturable", False):
            self._lr_to_device(self.param_groups[-1])

    def _lr_to_device(self, group: dict) -> None:
        if not group["params"]:
            return
        dev = group["params"][0].device
        lr = group["lr"]
        if isinstance(lr, Tensor):
            group["lr"] = lr.to(device=dev, dtype=torch.float32)
        else:
            group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=dev)

    def _after_load_state_dict(self) -> None:
        for group in self.param_groups:
            if not group["params"]:
                continue
            if "step" not in group:  # a torch.optim.Adam(W) checkpoint: per-param steps -> the group's
                steps = [self.state[p].pop("step") for p in group["params"] if "step" in self.state[p]]
                if steps:
                    group["step"] = max(int(s) for s in steps)
            if self.capturable:
                self._lr_to_device(group)
                if "step" in group and not isinstance(group["step"], Tensor):
                    group["step"] = torch.full((1,), int(group["step"]), dtype=torch.int32,
                                               device=group["params"][0].device)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """One Adam step over every param with a gradient; returns ``closure()``'s loss if given.

        Keyword ``grad_scaler`` (a ``torch.amp.GradScaler``) is accepted for the older GradScaler contract;
        Apex's removed ``grads`` / ``output_params`` / ``scale`` / ``grad_norms`` raise.
        """
        loss = grad_scaler = None
        if closure is not None or kwargs:
            loss, grad_scaler = self._begin_step(closure, kwargs,
                                                 legacy=("grads", "output_params", "scale", "grad_norms"))
        grad_scale, found_inf = self._amp_scaling(grad_scaler)
        for group in self.param_groups:
            plan = self._group_plan(group, self._build_plan)
            if plan is None:
                continue
            if plan.fast:
                self._step_fast(group, plan, grad_scale, found_inf)
            else:
                self._step_general(group, plan, grad_scale, found_inf)
        return loss

    def _build_plan(self, group: dict, params: list, grads: list, mask: tuple) -> GroupPlan:
        plan = GroupPlan(group, params, grads, mask, self._check_live)
        entries, _ = self._build(plan.live)
        plan.calls = [(idx, static, plan.select(idx)) for idx, static in entries]
        dev = plan.device
        plan.fast = (choose_backend(dev) == "triton"
                     and all(t.device == dev and t.is_contiguous() for t in plan.live_grads)
                     and all(t.device == dev and t.is_contiguous() for _, static, _ in plan.calls for lst in static
                             for t in lst))
        return plan

    def _step_general(self, group: dict, plan: GroupPlan, grad_scale, found_inf) -> None:
        """Any device layout / backend: the per-call ``adam_update`` path, the step counter advanced here."""
        dev = plan.device
        noop = self._noop(dev) if found_inf is None else self._found_inf_flag(found_inf, dev)
        step = self._advance_step(group, dev, self.capturable or found_inf is not None,
                                  noop if found_inf is not None else None)
        beta1, beta2 = group["betas"]
        kw = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], step=step,
                  mode=ADAM_MODE_ADAMW if self.adam_w_mode else ADAM_MODE_L2,
                  bias_correction=bool(group["bias_correction"]), weight_decay=group["weight_decay"], noop_flag=noop,
                  inv_scale=self._inv_scale(grad_scale), unscale_skipped=True, op="FusedAdam")
        grads = plan.live_grads
        for idx, static, _ in plan.calls:
            adam_update([grads if idx is None else [grads[i] for i in idx], *static], **kw)

    def _step_fast(self, group: dict, plan: GroupPlan, grad_scale, found_inf) -> None:
        """One device, contiguous tensors: the cached ``AdamPlan`` launches, nothing else per step.

        A device step counter (capturable, or a GradScaler step) is advanced by the last launch itself,
        only where the step was not skipped (``found_inf`` is the kernels' noop flag, read on the device).
        """
        dev = plan.device
        if found_inf is None:
            noop = self._noop(dev)
        else:
            noop = found_inf if found_inf.device == dev else found_inf.to(dev)
        step = group.get("step", 0)
        on_device = self.capturable or found_inf is not None or isinstance(step, Tensor)
        if on_device:
            if not isinstance(step, Tensor) or step.device != dev or step.dtype != _I32:
                step = group["step"] = (step.to(device=dev, dtype=_I32).reshape(1) if isinstance(step, Tensor)
                                        else torch.full((1,), int(step), dtype=_I32, device=dev))
        else:
            step = group["step"] = int(step) + 1
        lr = group["lr"]
        lr_t = isinstance(lr, Tensor)
        if lr_t and (lr.device != dev or lr.dtype != _F32):
            lr = lr.to(device=dev, dtype=_F32)
        inv = INV_NONE
        if grad_scale is not None:
            inv = INV_DIVIDE
            if grad_scale.device != dev or grad_scale.dtype != _F32:
                grad_scale = grad_scale.to(device=dev, dtype=_F32)
        bc = bool(group["bias_correction"])
        key = (lr_t, on_device, inv, bc, noop.dtype)
        plans = plan.variants.get(key)
        if plans is None:
            plans = plan.variants[key] = self._variant(plan, noop, lr_t, on_device, inv, bc)
        if on_device and plans[-1].step_mode != STEP_ADVANCE:
            step.add_(noop.eq(0))  # the last launch has no chunk to advance it: a torch op does
        beta1, beta2 = group["betas"]
        b1, b2, eps, wd = float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"])
        key = plan.gkey
        for ap, (_, _, sel) in zip(plans, plan.calls):
            ap.run(ap.tables.ptrs(key if sel is None else sel(key)), noop, lr, step, grad_scale, b1, b2, eps, wd)

    def _variant(self, plan: GroupPlan, noop: Tensor, lr_t: bool, on_device: bool, inv: int, bc: bool) -> list:
        """One ``AdamPlan`` per call of ``plan`` (plain / master params) for this step's argument kinds.
        A device step is read as ``step + 1`` by every launch and advanced by the last one (when it has
        chunks; else ``_step_fast`` advances it)."""
        grads = plan.live_grads
        mode = ADAM_MODE_ADAMW if self.adam_w_mode else ADAM_MODE_L2
        out = []
        last = len(plan.calls) - 1
        for k, (idx, static, _) in enumerate(plan.calls):
            lists = [grads if idx is None else [grads[i] for i in idx], *static]
            step_mode = (STEP_NEXT if k != last else STEP_ADVANCE) if on_device else STEP_AS_IS
            ap = AdamPlan("FusedAdam", lists, noop, mode=mode, lr_t=lr_t, step_t=on_device, inv=inv,
                          bias_correction=bc, step_mode=step_mode, static=tuple(range(1, len(lists))),
                          unscale_skipped=True)
            out.append(ap)
        if on_device and out[-1].tables.groups[-1].C == 0:
            # Nothing to launch last: the counter is advanced by _step_fast and every launch reads it as is.
            for ap in out:
                ap.step_mode = STEP_AS_IS
                ap._la.clear()
        return out

    def _build(self, live: list[Tensor]) -> tuple[list, bool]:
        """State for ``live`` (created on a param's first step) as ``[(grad indices | None, lists)]``:
        ``[params, exp_avgs, exp_avg_sqs]`` for fp32 params (and 16-bit ones without masters), and
        ``[params, exp_avgs, exp_avg_sqs, masters]`` for 16-bit params with ``master_weights``."""
        plain: list[int] = []
        master: list[int] = []
        for i, p in enumerate(live):
            state = self.state[p]
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            if self.master_weights and p.dtype in _LOW:
                if "master_param" not in state:
                    state["master_param"] = p.detach().to(torch.float32, copy=True)
                master.append(i)
            else:
                plain.append(i)
        out = []
        for idx, keys in ((plain, ("exp_avg", "exp_avg_sq")), (master, ("exp_avg", "exp_avg_sq", "master_param"))):
            if idx:
                ps = [live[i] for i in idx]
                lists = [ps] + [[self.state[p][k] for p in ps] for k in keys]
                out.append((None if len(idx) == len(live) else idx, lists))
        return out, True
