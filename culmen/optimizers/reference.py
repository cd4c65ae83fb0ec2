"""Plain PyTorch reference optimizers: LAMB, MixedPrecisionLamb, NovoGrad and LARS, one tensor at a time.

These are the oracles of culmen's tests and benchmarks for the optimizers torch.optim lacks. They
follow the update rules documented in :mod:`culmen.optimizers` (Apex's semantics), loop over params in
Python and compute in ``float64`` for float64 params (fp32 otherwise), so a float64 copy of a model
stepped with them is a high-precision reference for the fused optimizers. They are slow by design.

The options mirror the fused classes (same names and defaults). The LAMB references round each update
to its gradient's dtype before taking its norm, as the fused kernels (Apex's and culmen's) store the
update over the gradient: a float64 reference (float64 gradients) is not rounded at all, one fed the
bf16 gradients of a ``FusedMixedPrecisionLamb`` run rounds exactly where the kernel does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["RefLAMB", "RefLARS", "RefMixedPrecisionLamb", "RefNovoGrad"]


def _math_dtype(p: Tensor) -> torch.dtype:
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _found_inf(opt: torch.optim.Optimizer, grad_scaler: Any) -> tuple[float | None, bool]:
    """(inverse scale as a host number or None, skip) from GradScaler's attributes or the scaler itself."""
    if grad_scaler is not None:
        from torch.amp.grad_scaler import OptState

        st = grad_scaler._per_optimizer_states[id(opt)]
        if st["stage"] is OptState.UNSCALED:
            found, scale = st["found_inf_per_device"], None
        else:
            found, scale = grad_scaler._check_inf_per_device(opt), grad_scaler._get_scale_async()
        skip = any(float(v.item()) != 0 for v in found.values())
    else:
        scale, f = getattr(opt, "grad_scale", None), getattr(opt, "found_inf", None)
        skip = f is not None and float(f.item()) != 0
    inv = None if scale is None else 1.0 / float(scale.item())
    return inv, skip


class RefLAMB(torch.optim.Optimizer):
    """LAMB as :class:`culmen.optimizers.FusedLAMB` computes it, one tensor at a time.

    Args: as ``FusedLAMB`` (``lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
    weight_decay=0.01, adam_w_mode=True, grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False``),
    State: ``exp_avg``, ``exp_avg_sq`` (math dtype);
    per group ``step``. The gradients are left unchanged.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 adam_w_mode: bool = True, grad_averaging: bool = True, max_grad_norm: float | None = 1.0,
                 use_nvlamb: bool = False) -> None:
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.use_nvlamb = use_nvlamb

    def _masters(self, group: dict, p: Tensor) -> Tensor:
        """The tensor the update runs on (the param itself here; a master copy in the MP reference)."""
        return p

    def _write_back(self, p: Tensor, master: Tensor) -> None:
        pass

    def _lamb(self, inv_scale: float | None) -> None:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return
        dt = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        scale = 1.0 if inv_scale is None else inv_scale
        gnorm = math.sqrt(sum(float((g.to(dt) * scale).pow(2).sum()) for g in grads))
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            group["step"] = group.get("step", 0) + 1
            step = group["step"]
            beta1, beta2 = group["betas"]
            bc1, bc2 = (1 - beta1 ** step, 1 - beta2 ** step) if group["bias_correction"] else (1.0, 1.0)
            beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
            wd, lr, eps = group["weight_decay"], float(group["lr"]), group["eps"]
            mx = group["max_grad_norm"]
            clip = gnorm / mx if mx is not None and mx > 0 and gnorm > mx else 1.0
            for p in params:
                q = self._masters(group, p)
                mdt = _math_dtype(q)
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(q, dtype=mdt)
                    state["exp_avg_sq"] = torch.zeros_like(q, dtype=mdt)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                g = p.grad.to(mdt) * scale / clip
                w = q.to(mdt)
                if not self.adam_w_mode and wd != 0:
                    g = g + wd * w
                m.mul_(beta1).add_(beta3 * g)
                v.mul_(beta2).add_((1 - beta2) * g * g)
                u = (m / bc1) / ((v / bc2).sqrt() + eps)
                if self.adam_w_mode and wd != 0:
                    u = u + wd * w
                u = u.to(p.grad.dtype).to(mdt)  # stored over the gradient by the fused kernels
                ratio = lr
                if self.use_nvlamb or wd != 0:
                    pn, un = float(w.norm()), float(u.norm())
                    if pn != 0 and un != 0:
                        ratio = lr * (pn / un)
                q.copy_(w - ratio * u)
                self._write_back(p, q)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._lamb(None)
        return loss


class RefMixedPrecisionLamb(RefLAMB):
    """LAMB as :class:`culmen.optimizers.FusedMixedPrecisionLamb` computes it, one tensor at a time.

    Params of ``reduced_precision_dtype`` are updated through a master copy of dtype ``master_dtype``
    (default fp32; float64 makes an oracle) kept in ``state["master_param"]`` and rounded into the param.
    With a GradScaler (attributes ``grad_scale`` / ``found_inf``, or ``step(grad_scaler=...)``) the
    gradients are unscaled and a step with inf/NaN gradients is skipped entirely (host check: this is a
    reference). ``lr`` and ``step`` are host numbers here.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, step: int = 0, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 adam_w_mode: bool = True, grad_averaging: bool = True, max_grad_norm: float | None = 1.0,
                 use_nvlamb: bool = False, reduced_precision_dtype: torch.dtype | None = None,
                 master_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, adam_w_mode=adam_w_mode, grad_averaging=grad_averaging,
                         max_grad_norm=max_grad_norm, use_nvlamb=use_nvlamb)
        for group in self.param_groups:
            group["step"] = int(step)
        self.reduced_precision_dtype = reduced_precision_dtype
        self.master_dtype = master_dtype
        self._step_supports_amp_scaling = True

    def _masters(self, group: dict, p: Tensor) -> Tensor:
        if self.reduced_precision_dtype is None or p.dtype != self.reduced_precision_dtype:
            return p
        state = self.state[p]
        if "master_param" not in state:
            state["master_param"] = p.detach().to(self.master_dtype, copy=True)
        return state["master_param"]

    def _write_back(self, p: Tensor, master: Tensor) -> None:
        if master is not p:
            p.copy_(master)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        grad_scaler = kwargs.pop("grad_scaler", None)  # **kwargs: GradScaler then uses the attribute contract
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inv, skip = _found_inf(self, grad_scaler)
        if not skip:
            self._lamb(inv)
        return loss


class RefNovoGrad(torch.optim.Optimizer):
    """NovoGrad as :class:`culmen.optimizers.FusedNovoGrad` computes it, one tensor at a time.

    Args: as ``FusedNovoGrad`` (``lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0.0, reg_inside_moment=False, grad_averaging=True, norm_type=2, init_zero=False``).
    State: ``exp_avg`` (math dtype) and ``exp_avg_sq`` (the moving norm, a 0-dim tensor); group ``step``.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 reg_inside_moment: bool = False, grad_averaging: bool = True, norm_type: int = 2,
                 init_zero: bool = False) -> None:
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, norm_type=norm_type, init_zero=init_zero)
        super().__init__(params, defaults)
        self.reg_inside_moment = reg_inside_moment

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            group["step"] = group.get("step", 0) + 1
            step = group["step"]
            beta1, beta2 = group["betas"]
            if group["bias_correction"]:
                bc1, bc2 = 1 - beta1 ** step, math.sqrt(1 - beta2 ** step)
            else:
                bc1 = bc2 = 1.0
            beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
            wd, lr, eps = group["weight_decay"], float(group["lr"]), group["eps"]
            for p in params:
                mdt = _math_dtype(p)
                g = p.grad.to(mdt)
                n = g.abs().max() if group["norm_type"] == 0 else g.norm()
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=mdt)
                    state["exp_avg_sq"] = torch.zeros((), dtype=mdt, device=p.device) if group["init_zero"] \
                        else n.clone()
                m, gn = state["exp_avg"], state["exp_avg_sq"]
                if group["norm_type"] == 0:
                    gn.copy_(beta2 * gn + (1 - beta2) * n)
                else:
                    gn.copy_((beta2 * gn * gn + (1 - beta2) * n * n).sqrt())
                denom = gn / bc2 + eps
                w = p.to(mdt)
                if self.reg_inside_moment:
                    g = g / denom + wd * w
                    m.mul_(beta1).add_(beta3 * g)
                    w = w - lr * (m / bc1)
                else:
                    m.mul_(beta1).add_(beta3 * g)
                    w = w - lr * ((m / bc1) / denom + wd * w)
                p.copy_(w)
        return loss


class RefLARS(torch.optim.Optimizer):
    """LARS as :class:`culmen.optimizers.FusedLARS` computes it, one tensor at a time.

    Args: as ``FusedLARS`` (``lr`` required, ``momentum=0, dampening=0, weight_decay=0,
    trust_coefficient=0.001, eps=0.0, nesterov=False, wd_after_momentum=False``; group key
    ``is_skipped``). State: ``momentum_buffer`` (math dtype) with ``momentum != 0``.
    """

    def __init__(self, params: Iterable, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001, eps: float = 0.0,
                 nesterov: bool = False, wd_after_momentum: bool = False) -> None:
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        trust_coefficient=trust_coefficient, eps=eps, is_skipped=False)
        super().__init__(params, defaults)
        self.wd_after_momentum = wd_after_momentum

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            wd, mom, damp = group["weight_decay"], group["momentum"], group["dampening"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                mdt = _math_dtype(p)
                g, w = p.grad.to(mdt), p.to(mdt)
                lr_t = float(group["lr"])
                if not group["is_skipped"]:
                    pn, gn = float(w.norm()), float(g.norm())
                    if pn > 0 and gn > 0:
                        lr_t *= group["trust_coefficient"] * pn / (gn + wd * pn + group["eps"])
                if wd != 0 and not self.wd_after_momentum:
                    g = g + wd * w
                step = lr_t * g
                if mom != 0:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = -step
                    else:
                        buf.mul_(mom).sub_((1 - damp) * step)
                    d = mom * buf - step if group["nesterov"] else buf
                else:
                    d = -step
                if wd != 0 and self.wd_after_momentum:
                    d = d - lr_t * wd * w
                p.copy_(w + d)
        return loss
