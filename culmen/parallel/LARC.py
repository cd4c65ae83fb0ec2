"""``LARC``: layer-wise adaptive rate clipping / scaling around any optimizer (Apex's ``apex.parallel.LARC``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from culmen.multi_tensor_apply import amp_C, multi_tensor_applier

__all__ = ["LARC"]


class LARC:
    """Wrap ``optimizer`` so that each param's gradient is rescaled by its layer-wise trust ratio.

    For every param with a gradient, with ``wd`` its group's weight decay and ``lr`` its group's lr::

        local_lr = trust_coefficient * ||p|| / (||g|| + wd * ||p|| + eps)
        g <- (g + wd * p) * (min(local_lr / lr, 1) if clip else local_lr)

    so that the wrapped optimizer's effective rate is ``min(lr, local_lr)`` (clip mode) or
    ``lr * local_lr`` (scale mode). Params whose ``||p||`` or ``||g||`` is zero keep their gradient
    unchanged. The weight decay is applied here: the group's ``weight_decay`` is set to 0 while the
    wrapped optimizer steps, then restored.

    Unlike Apex's version (a Python loop with two norms and a host sync per param) the norms are two
    multi-tensor launches per (device, dtype) of a group and the ratios stay on the device: no host sync.
    The per-param rescale is ``torch._foreach_mul_`` with per-tensor device factors.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (e.g. ``torch.optim.SGD``, ``culmen.optimizers.FusedSGD``).
        trust_coefficient: default 0.02.
        clip: clip mode (True, default) or scale mode (False).
        eps: added to the denominator. Default 1e-8.

    ``state``, ``param_groups``, ``state_dict``, ``load_state_dict``, ``zero_grad`` and
    ``add_param_group`` are the wrapped optimizer's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, trust_coefficient: float = 0.02, clip: bool = True,
                 eps: float = 1e-8) -> None:
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.clip = clip
        self._flags: dict[torch.device, Tensor] = {}

    def __getstate__(self) -> Any:
        return self.optim.__getstate__()

    def __setstate__(self, state: Any) -> None:
        self.optim.__setstate__(state)

    @property
    def state(self) -> Any:
        return self.optim.state

    def __repr__(self) -> str:
        return self.optim.__repr__()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optim.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        self.optim.zero_grad(*args, **kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def _zero_flag(self, device: torch.device) -> Tensor:
        flag = self._flags.get(device)
        if flag is None:
            flag = self._flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return flag

    @torch.no_grad()
    def _rescale_group(self, group: dict[str, Any], weight_decay: float) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        dev = params[0].device
        flag = self._zero_flag(dev)
        _, p_norms = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [[p.detach() for p in params]], True)
        _, g_norms = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [grads], True)
        local = self.trust_coefficient * p_norms / (g_norms + p_norms * weight_decay + self.eps)
        if self.clip:
            lr = group["lr"]
            lr = lr.to(dev, torch.float32) if isinstance(lr, Tensor) else float(lr)
            local = torch.clamp(local / lr, max=1.0)
        ok = (p_norms != 0) & (g_norms != 0)
        # Where ||g|| == 0 the gradient is all zeros and must stay so: factor 0 also cancels the wd*p term
        # added below. Where only ||p|| == 0 the wd*p term is zero and the factor is 1.
        factor = torch.where(ok, local, (g_norms != 0).to(local.dtype))
        by_key: dict[tuple[torch.device, torch.dtype, torch.dtype], list[int]] = {}
        for i, p in enumerate(params):
            by_key.setdefault((p.device, p.dtype, grads[i].dtype), []).append(i)
        for (d, _, _), idx in by_key.items():
            gs = [grads[i] for i in idx]
            if weight_decay != 0:
                torch._foreach_add_(gs, [params[i].detach() for i in idx], alpha=weight_decay)
            f = factor.to(d, non_blocking=d.type != "cpu")  # a copy to the host must block
            torch._foreach_mul_(gs, [f[i] for i in idx])

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Rescale the gradients, step the wrapped optimizer (weight decay off), restore the decay.

        A ``closure`` is evaluated first (it recomputes the gradients), then the rescaled gradients are
        stepped; its loss is returned.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        weight_decays = [group.get("weight_decay", 0) for group in self.optim.param_groups]
        try:
            for group, wd in zip(self.optim.param_groups, weight_decays):
                group["weight_decay"] = 0
                self._rescale_group(group, float(wd))
            out = self.optim.step()
        finally:
            for group, wd in zip(self.optim.param_groups, weight_decays):
                group["weight_decay"] = wd
        return loss if closure is not None else out
