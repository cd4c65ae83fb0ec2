"""``FusedNovoGrad``: Apex's fused NovoGrad (per-layer second moment kept as a moving gradient norm)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from culmen.multi_tensor_apply import amp_C, multi_tensor_applier
from culmen.optimizers._base import FusedOptimizer, check_hyper, group_by_device

NOVOGRAD_MODE_INSIDE, NOVOGRAD_MODE_DECOUPLED = 0, 1


class FusedNovoGrad(FusedOptimizer):
    """NovoGrad in three launches per (device, dtype) of a group (norms, norm blend, update).

    A drop-in for ``apex.optimizers.FusedNovoGrad``. Per param (fp32 math), with ``n`` the L2 norm
    (``norm_type=2``) or max-abs (``norm_type=0``) of its gradient::

        gn = sqrt(beta2 gn^2 + (1 - beta2) n^2)     (L2; inf: gn = beta2 gn + (1 - beta2) n)
        d  = gn / bc2 + eps                         (bc2 = sqrt(1 - beta2^step), bc1 = 1 - beta1^step)
        reg_inside_moment: g = g / d + wd p;  m = beta1 m + beta3 g;  p -= lr m / bc1
        otherwise:         m = beta1 m + beta3 g;  p -= lr ((m / bc1) / d + wd p)

    ``beta3 = 1 - beta1`` with ``grad_averaging`` (else 1). ``gn`` starts at 0 (``init_zero``) or at the
    first step's ``n``.

    Args:
        params: iterable of params or of param-group dicts (fp32/fp16/bf16, several devices allowed).
        lr: default 1e-3. bias_correction: default True. betas: default (0.9, 0.999). eps: default 1e-8.
        weight_decay: default 0. amsgrad: not supported (raises, as Apex).
        reg_inside_moment: default False. grad_averaging: default True.
        norm_type: 2 (L2) or 0 (max-abs). Default 2. init_zero: default False. set_grad_none: default True.

    State (per param): ``exp_avg`` (fp32) and ``exp_avg_sq``: the moving norm, a 0-dim fp32 tensor
    (Apex keeps one tensor per group and dtype, which breaks when the set of params with gradients
    changes). Per group: ``step`` (host int, as Apex). The first step's norms are computed on the device
    (Apex reads each one back to the host).

    GradScaler: the standard path (``GradScaler`` unscales the gradients and skips the step on inf/NaN,
    reading ``found_inf`` on the host): Apex's ``multi_tensor_novograd`` takes the step count, hence the
    bias corrections, as a host number, so a skipped step cannot be decided on the device.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, reg_inside_moment: bool = False, grad_averaging: bool = True,
                 norm_type: int = 2, init_zero: bool = False, set_grad_none: bool = True) -> None:
        check_hyper(type(self).__name__, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                    bias_correction=bias_correction, grad_averaging=grad_averaging, init_zero=init_zero)
        if amsgrad:
            raise RuntimeError("FusedNovoGrad does not support the AMSGrad variant (amsgrad=True)")
        if norm_type not in (0, 2):
            raise ValueError(f"FusedNovoGrad supports norm_type 2 (L2) and 0 (inf), got {norm_type!r}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging, norm_type=norm_type,
                        init_zero=init_zero)
        super().__init__(params, defaults)
        self.moment_mode = NOVOGRAD_MODE_INSIDE if reg_inside_moment else NOVOGRAD_MODE_DECOUPLED
        self.set_grad_none = bool(set_grad_none)
        # (group index, device) -> (params, flat norms, the 0-dim views of it held in the state)
        self._norm_cache: dict[tuple[int, torch.device], tuple[tuple[Tensor, ...], Tensor, tuple[Tensor, ...]]] = {}

    def _after_load_state_dict(self) -> None:
        self._norm_cache = {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._norm_cache = {}

    def _first_norms(self, grads: list[Tensor], norm_type: int, device: torch.device) -> Tensor:
        if norm_type == 2:
            _, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, self._noop(device), [grads], True)
            return per
        try:
            norms = torch._foreach_norm(grads, float("inf"), dtype=torch.float32)
        except TypeError:  # older torch
            norms = torch._foreach_norm([g.float() for g in grads], float("inf"))
        return torch.stack(list(norms))

    def _norms(self, gid: int, group: dict, params: list[Tensor], device: torch.device) -> Tensor:
        """The group's moving norms on ``device`` as one flat fp32 tensor whose elements the state views."""
        key = (gid, device)
        cached = self._norm_cache.get(key)
        if cached is not None and len(cached[0]) == len(params) and all(a is b for a, b in zip(cached[0], params)) \
                and all(self.state[p].get("exp_avg_sq") is v for p, v in zip(params, cached[2])):
            return cached[1]
        new = [i for i, p in enumerate(params) if "exp_avg_sq" not in self.state[p]]
        flat = torch.empty(len(params), dtype=torch.float32, device=device)
        old = [i for i in range(len(params)) if i not in set(new)]
        if old:
            vals = torch.stack([self.state[params[i]]["exp_avg_sq"].reshape(()).to(device, torch.float32)
                                for i in old])
            flat[torch.tensor(old, device=device)] = vals
        if new:
            idx = torch.tensor(new, device=device)
            if group["init_zero"]:
                flat[idx] = 0.0
            else:
                flat[idx] = self._first_norms([params[i].grad for i in new], group["norm_type"], device)
        views = tuple(flat[i] for i in range(len(params)))
        for p, v in zip(params, views):
            self.state[p]["exp_avg_sq"] = v
        self._norm_cache[key] = (tuple(params), flat, views)
        return flat

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """One NovoGrad step over every param with a gradient; returns ``closure()``'s loss if given."""
        loss, grad_scaler = self._begin_step(closure, kwargs)
        grad_scale, found_inf = self._amp_scaling(grad_scaler)
        if found_inf is not None and bool(found_inf.reshape(-1)[0].item() != 0):
            return loss  # only reached through step(grad_scaler=...): the host step count must not advance
        inv_scale = self._inv_scale(grad_scale)
        for gid, group in enumerate(self.param_groups):
            live, grads = self._live(group)
            if not live:
                continue
            entries = self._state_lists(group, "novograd", live, grads, self._build)
            self._unscale_grads_(grads, inv_scale)
            group["step"] = int(group.get("step", 0)) + 1
            beta1, beta2 = group["betas"]
            for dev, idx, ps, ms in entries:
                gs = grads if idx is None else [grads[i] for i in idx]
                norms = self._norms(gid, group, ps, dev)
                multi_tensor_applier(amp_C.multi_tensor_novograd, self._noop(dev), [gs, ps, ms], norms,
                                     float(group["lr"]), beta1, beta2, group["eps"], group["step"],
                                     int(bool(group["bias_correction"])), group["weight_decay"],
                                     int(bool(group["grad_averaging"])), self.moment_mode, group["norm_type"])
        return loss

    def _build(self, live: list[Tensor]) -> tuple[list, bool]:
        """``[(device, grad indices | None, params, exp_avgs)]``: one launch set per device (the moving
        norms of a set live on its device)."""
        out = []
        by_dev = group_by_device(live)
        for dev, idx in by_dev.items():
            ps = [live[i] for i in idx]
            for p in ps:
                if "exp_avg" not in self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p, dtype=torch.float32,
                                                                memory_format=torch.preserve_format)
            out.append((dev, None if len(by_dev) == 1 else idx, ps, [self.state[p]["exp_avg"] for p in ps]))
        return out, True
