"""``FusedLAMB``: Apex's fused LAMB (global grad-norm clipping, per-tensor trust ratio)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from culmen.multi_tensor_apply import amp_C, multi_tensor_applier
from culmen.ops.multi_tensor.lamb import lamb_update
from culmen.optimizers._base import FusedOptimizer, check_hyper

LAMB_MODE_L2, LAMB_MODE_DECOUPLED = 0, 1


def max_norm_arg(max_grad_norm: float | None) -> float:
    """``max_grad_norm`` as the kernels take it: ``None`` or a value <= 0 means no clipping (inf)."""
    if max_grad_norm is None or max_grad_norm <= 0:
        return math.inf
    return float(max_grad_norm)


def global_grad_norm(grads: list[Tensor], noop: Tensor, inv_scale: Tensor | None) -> Tensor:
    """L2 norm of all ``grads`` together (times ``inv_scale``): a 1-element fp32 tensor on ``noop``'s device."""
    if inv_scale is None:
        return multi_tensor_applier(amp_C.multi_tensor_l2norm, noop, [grads], False)[0]
    return multi_tensor_applier(amp_C.multi_tensor_unscale_l2norm, noop, [grads], inv_scale.to(noop.device), False)[0]


class FusedLAMB(FusedOptimizer):
    """LAMB (layer-wise adaptive moments) in three launches per (device, dtype) of a group, plus one global norm.

    A drop-in for ``apex.optimizers.FusedLAMB``. Per step: the L2 norm ``G`` of all gradients of all
    groups; then per param (fp32 math), with ``c = G / max_grad_norm`` if ``G > max_grad_norm`` else 1::

        g = grad / c   (+ wd * p in L2 mode, adam_w_mode=False)
        m = beta1 m + beta3 g            (beta3 = 1 - beta1 with grad_averaging, else 1)
        v = beta2 v + (1 - beta2) g^2
        u = (m / bc1) / (sqrt(v / bc2) + eps)   (+ wd * p in decoupled mode)
        p -= lr * (||p|| / ||u||) * u   when (wd != 0 or use_nvlamb) and both norms are non-zero, else lr * u

    with ``bc1 = 1 - beta1^step``, ``bc2 = 1 - beta2^step`` (1 without bias correction). As in Apex the
    gradients are overwritten with the updates ``u``.

    Args:
        params: iterable of params or of param-group dicts (fp32/fp16/bf16, several devices allowed).
        lr: default 1e-3. bias_correction: default True. betas: default (0.9, 0.999). eps: default 1e-6.
        weight_decay: default 0.01. amsgrad: not supported (raises, as Apex).
        adam_w_mode: decoupled weight decay (default True). grad_averaging: default True.
        set_grad_none: default True.
        max_grad_norm: global gradient-norm clip, default 1.0; ``None`` or ``<= 0`` disables clipping
            (Apex would divide by zero). Read per group (Apex reads only the constructor's value).
        use_nvlamb: apply the trust ratio to params with zero weight decay too. Default False.

    State (per param): ``exp_avg``, ``exp_avg_sq`` (fp32). Per group: ``step`` (host int; a device
    tensor once a GradScaler drove a step).

    GradScaler: ``_step_supports_amp_scaling`` is True; the gradients are unscaled inside the kernels,
    the global norm is that of the unscaled gradients, and a step with inf/NaN gradients changes nothing
    (``step`` included), with no host sync.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 set_grad_none: bool = True, max_grad_norm: float | None = 1.0, use_nvlamb: bool = False) -> None:
        check_hyper(type(self).__name__, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                    bias_correction=bias_correction, grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant (amsgrad=True)")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self.adam_w_mode = LAMB_MODE_DECOUPLED if adam_w_mode else LAMB_MODE_L2
        self.set_grad_none = bool(set_grad_none)
        self.use_nvlamb = bool(use_nvlamb)
        self._step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """One LAMB step over every param with a gradient; returns ``closure()``'s loss if given."""
        loss, grad_scaler = self._begin_step(closure, kwargs)
        grad_scale, found_inf = self._amp_scaling(grad_scaler)
        inv_scale = self._inv_scale(grad_scale)
        groups = []
        for group in self.param_groups:
            live, grads = self._live(group)
            if live:
                groups.append((group, grads, self._zero_state_lists(group, live, grads, ("exp_avg", "exp_avg_sq"))))
        if not groups:
            return loss
        all_grads = groups[0][1] if len(groups) == 1 else [g for _, grads, _ in groups for g in grads]
        dev0 = all_grads[0].device
        noop0 = self._noop(dev0) if found_inf is None else self._found_inf_flag(found_inf, dev0)
        gnorm = global_grad_norm(all_grads, noop0, inv_scale)

        for group, grads, (ps, ms, vs) in groups:
            dev = ps[0].device
            noop = self._noop(dev) if found_inf is None else self._found_inf_flag(found_inf, dev)
            step = self._advance_step(group, dev, found_inf is not None, noop if found_inf is not None else None)
            beta1, beta2 = group["betas"]
            lamb_update([grads, ps, ms, vs], lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], step=step,
                        bias_correction=bool(group["bias_correction"]), weight_decay=group["weight_decay"],
                        grad_averaging=bool(group["grad_averaging"]), mode=self.adam_w_mode, global_grad_norm=gnorm,
                        max_grad_norm=max_norm_arg(group.get("max_grad_norm")), use_nvlamb=self.use_nvlamb,
                        noop_flag=noop, found_inf=None, inv_scale=inv_scale, unscale_skipped=True, op="FusedLAMB")
        return loss
