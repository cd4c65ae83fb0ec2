"""``apex.contrib.optimizers.FusedAdam``: deprecated Adam whose ``step`` takes grads, output params and a scale."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from culmen.ops.multi_tensor.adam import ADAM_MODE_ADAMW, adam_update
from culmen.optimizers._base import check_hyper

__all__ = ["FusedAdam"]


def _per_group(name: str, value: Any, n: int) -> list:
    """``value`` as one entry per param group: ``None``, a list for one group, or a list of lists."""
    if value is None:
        return [None] * n
    if n == 1 and isinstance(value, (list, tuple)) and (not value or not isinstance(value[0], (list, tuple))):
        return [value]
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise ValueError(f"FusedAdam.step: {name} must have one entry per param group ({n}), got {value!r:.80}")
    return list(value)


class FusedAdam(torch.optim.Optimizer):
    """Apex's old contrib ``FusedAdam`` (``fused_adam_cuda``), on culmen's multi-tensor Adam kernel.

    ``step(closure=None, grads=None, output_params=None, scale=1.0, grad_norms=None)``: per param group,
    the gradients (``grads`` or ``p.grad``) are divided by ``scale`` (times the clip factor
    ``(grad_norm / scale + 1e-6) / max_grad_norm`` when it exceeds 1 and ``max_grad_norm > 0``), then::

        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        p -= lr * sqrt(bc2) / bc1 * (m / (sqrt(v) + eps) + weight_decay * p)

    (``eps_inside_sqrt``: ``m / sqrt(v + eps)``), ``bc = 1 - beta^step`` with bias correction. The new
    params are also written, cast, into ``output_params`` (e.g. fp16 model copies of fp32 masters).
    Under Apex's old amp (an ``_amp_stash`` on the optimizer) the stashed gradients, outputs, norms and
    ``scale * amp_scale_adjustment`` are used. ``use_mt`` is accepted (every path is multi-tensor here).

    State per param: ``step`` (int), ``exp_avg``, ``exp_avg_sq`` (fp32).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, amsgrad: bool = False, use_mt: bool = False,
                 amp_scale_adjustment: float = 1.0) -> None:
        check_hyper("FusedAdam", lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                    bias_correction=bias_correction, max_grad_norm=max_grad_norm)
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant (amsgrad=True)")
        self._use_multi_tensor = bool(use_mt)
        self._amp_scale_adjustment = float(amp_scale_adjustment)
        self.eps_mode = 0 if eps_inside_sqrt else 1
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, grads: Any = None, output_params: Any = None,
             scale: float = 1.0, grad_norms: Any = None) -> Any:
        """One step (class docstring); returns ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stash = getattr(self, "_amp_stash", None)
        if stash is not None:
            grads, output_params = stash.grads, stash.output_params
            scale, grad_norms = stash.scale * self._amp_scale_adjustment, stash.grad_norms
        n = len(self.param_groups)
        grads_g = _per_group("grads", grads, n)
        outs_g = _per_group("output_params", output_params, n)
        norms_g = [None] * n if grad_norms is None else list(grad_norms)
        if len(norms_g) != n:
            raise ValueError(f"FusedAdam.step: grad_norms must have one entry per param group ({n})")
        for group, gs, outs, gnorm in zip(self.param_groups, grads_g, outs_g, norms_g):
            params = group["params"]
            gs = [p.grad for p in params] if gs is None else list(gs)
            if len(gs) != len(params):
                raise ValueError(f"FusedAdam.step: {len(gs)} grads for {len(params)} params")
            if outs is not None and len(outs) != len(params):
                raise ValueError(f"FusedAdam.step: {len(outs)} output_params for {len(params)} params")
            combined = float(scale)
            if group["max_grad_norm"] > 0 and gnorm is not None:
                clip = (float(gnorm) / float(scale) + 1e-6) / group["max_grad_norm"]
                if clip > 1:
                    combined = clip * float(scale)
            live = [i for i, g in enumerate(gs) if g is not None]
            if not live:
                continue
            ps = [params[i] for i in live]
            for p in ps:
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                st["step"] += 1
            step = self.state[ps[0]]["step"]
            beta1, beta2 = group["betas"]
            bc1 = 1.0 - beta1 ** step if group["bias_correction"] else 1.0
            bc2 = 1.0 - beta2 ** step if group["bias_correction"] else 1.0
            g32 = [gs[i].float() / combined for i in live]  # the caller's gradients are left as they are
            ms = [self.state[p]["exp_avg"] for p in ps]
            vs = [self.state[p]["exp_avg_sq"] for p in ps]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            if self.eps_mode == 1:
                # Apex's old kernel puts eps next to sqrt(v) and folds the bias corrections into the step
                # size; the same update in the kernel's bias-corrected form: eps / sqrt(bc2) and the decay
                # scaled by sqrt(bc2) / bc1.
                noop = torch.zeros(1, dtype=torch.int32, device=ps[0].device)
                adam_update([g32, ps, ms, vs], lr=lr, beta1=beta1, beta2=beta2, eps=eps / math.sqrt(bc2), step=step,
                            mode=ADAM_MODE_ADAMW, bias_correction=bool(group["bias_correction"]),
                            weight_decay=wd * math.sqrt(bc2) / bc1, noop_flag=noop, op="contrib.FusedAdam")
            else:
                step_size = lr * math.sqrt(bc2) / bc1
                for g, p, m, v in zip(g32, ps, ms, vs):
                    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
                    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                    pf = p.float()
                    upd = m / torch.sqrt(v + eps) + wd * pf
                    p.copy_(pf - step_size * upd)
            if outs is not None:
                for i in live:
                    if outs[i] is not None:
                        outs[i].copy_(params[i])
        return loss
