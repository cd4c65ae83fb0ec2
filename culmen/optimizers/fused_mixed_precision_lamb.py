"""``FusedMixedPrecisionLamb``: Apex's LAMB with fp32 masters for reduced-precision params, lr/step on device."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from culmen.ops.multi_tensor.lamb import lamb_update
from culmen.optimizers._base import FusedOptimizer, check_hyper
from culmen.optimizers.fused_lamb import LAMB_MODE_DECOUPLED, LAMB_MODE_L2, global_grad_norm, max_norm_arg


class FusedMixedPrecisionLamb(FusedOptimizer):
    """LAMB for mixed-precision training: device-resident lr/step, fp32 master weights, in-kernel unscaling.

    A drop-in for ``apex.optimizers.FusedMixedPrecisionLamb``. The math is :class:`FusedLAMB`'s; in
    addition:

    * each group's ``lr`` and ``step`` are 1-element device tensors (fp32 and int32), so ``step()`` never
      syncs with the host (CUDA-graph capturable after one warm-up step);
    * params of ``reduced_precision_dtype`` (e.g. ``torch.bfloat16``) get fp32 master copies, kept in the
      optimizer state (key ``"master_param"``, saved by ``state_dict``; Apex keeps them outside it),
      created at the param's first step; the update runs on the master and is rounded into the param in
      the same pass, and their moments are fp32;
    * with ``torch.amp.GradScaler`` (``_step_supports_amp_scaling``) or ``step(grad_scaler=...)`` the
      gradients are unscaled inside the kernels and a step with inf/NaN gradients changes nothing.

    Args:
        params: iterable of params or of param-group dicts.
        lr: default 1e-3 (stored as a device tensor). step: initial step count, default 0.
        bias_correction, betas, eps (default 1e-6), weight_decay (default 0.01), amsgrad (unsupported),
        adam_w_mode, grad_averaging, max_grad_norm (default 1.0; ``None``/``<= 0`` disables clipping),
        use_nvlamb: as :class:`FusedLAMB`.
        reduced_precision_dtype: the 16-bit dtype whose params get fp32 masters (``None``: no masters).

    The update of each tensor is stored over its gradient in the gradient's dtype before its norm is
    taken (Apex's kernels do the same). Unlike Apex, the params of one group may have different dtypes.
    """

    def __init__(self, params: Iterable, lr: float | Tensor = 1e-3, step: int = 0, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 max_grad_norm: float | None = 1.0, use_nvlamb: bool = False,
                 reduced_precision_dtype: torch.dtype | None = None) -> None:
        check_hyper(type(self).__name__, lr=lr, step=step, betas=betas, eps=eps, weight_decay=weight_decay,
                    bias_correction=bias_correction, grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        if amsgrad:
            raise RuntimeError("FusedMixedPrecisionLamb does not support the AMSGrad variant (amsgrad=True)")
        if reduced_precision_dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError(f"reduced_precision_dtype must be None, torch.float16 or torch.bfloat16, "
                             f"got {reduced_precision_dtype}")
        # Host tensors (named: the default device may be another), moved to each group's device by _to_device.
        lr_t = lr.detach().to(torch.float32).reshape(()) if isinstance(lr, Tensor) else \
            torch.tensor(float(lr), dtype=torch.float32, device="cpu")
        step_t = torch.tensor([int(step)], dtype=torch.int32, device="cpu")
        defaults = dict(lr=lr_t, step=step_t, bias_correction=bias_correction,
                        betas=tuple(betas), eps=eps, weight_decay=weight_decay, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm)
        self.reduced_precision_dtype = reduced_precision_dtype
        super().__init__(params, defaults)
        self.adam_w_mode = LAMB_MODE_DECOUPLED if adam_w_mode else LAMB_MODE_L2
        self.use_nvlamb = bool(use_nvlamb)
        self.set_grad_none = True
        self._step_supports_amp_scaling = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``; tensor defaults (lr, step) are cloned per group and moved to its device."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for name, default in self.defaults.items():
            if isinstance(default, Tensor) and group[name] is default:
                group[name] = default.clone()
        self._to_device(group)

    @staticmethod
    def _to_device(group: dict[str, Any]) -> None:
        if not group["params"]:
            return
        dev = group["params"][0].device
        lr = group["lr"]
        group["lr"] = (lr.to(device=dev, dtype=torch.float32) if isinstance(lr, Tensor)
                       else torch.tensor(float(lr), dtype=torch.float32, device=dev))
        st = group["step"]
        group["step"] = (st.to(device=dev, dtype=torch.int32).reshape(1) if isinstance(st, Tensor)
                         else torch.full((1,), int(st), dtype=torch.int32, device=dev))

    def _after_load_state_dict(self) -> None:
        for group in self.param_groups:
            self._to_device(group)

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
                groups.append((group, live, grads, self._state_lists(group, "mp_lamb", live, grads, self._build)))
        if not groups:
            return loss
        all_grads = groups[0][2] if len(groups) == 1 else [g for _, _, grads, _ in groups for g in grads]
        dev0 = all_grads[0].device
        noop0 = self._noop(dev0) if found_inf is None else self._found_inf_flag(found_inf, dev0)
        gnorm = global_grad_norm(all_grads, noop0, inv_scale)

        for group, live, grads, entries in groups:
            dev = live[0].device
            noop = self._noop(dev) if found_inf is None else self._found_inf_flag(found_inf, dev)
            step = self._advance_step(group, dev, True, noop if found_inf is not None else None)
            beta1, beta2 = group["betas"]
            kw = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], step=step,
                      bias_correction=bool(group["bias_correction"]), weight_decay=group["weight_decay"],
                      grad_averaging=bool(group["grad_averaging"]), mode=self.adam_w_mode, global_grad_norm=gnorm,
                      max_grad_norm=max_norm_arg(group.get("max_grad_norm")), use_nvlamb=self.use_nvlamb,
                      noop_flag=noop, found_inf=None, inv_scale=inv_scale, unscale_skipped=True,
                      op="FusedMixedPrecisionLamb")
            for idx, static in entries:
                gs = grads if idx is None else [grads[i] for i in idx]
                lamb_update([gs, *static], **kw)
        return loss

    def _build(self, live: list[Tensor]) -> tuple[list, bool]:
        """``[(grad indices | None, lists)]``: ``[params, m, v]`` for full-precision params and
        ``[masters, m, v, params]`` for params of ``reduced_precision_dtype`` (state created here)."""
        low = self.reduced_precision_dtype
        plain: list[int] = []
        master: list[int] = []
        for i, p in enumerate(live):
            state = self.state[p]
            has_master = low is not None and p.dtype == low
            if "exp_avg" not in state:
                dt = torch.float32 if has_master else p.dtype
                state["exp_avg"] = torch.zeros_like(p, dtype=dt, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=dt, memory_format=torch.preserve_format)
            if has_master:
                if "master_param" not in state:
                    state["master_param"] = p.detach().to(torch.float32, copy=True)
                master.append(i)
            else:
                plain.append(i)
        out = []
        if plain:
            ps = [live[i] for i in plain]
            out.append((None if len(plain) == len(live) else plain,
                        [ps, [self.state[p]["exp_avg"] for p in ps], [self.state[p]["exp_avg_sq"] for p in ps]]))
        if master:
            ps = [live[i] for i in master]
            st = [self.state[p] for p in ps]
            out.append((None if len(master) == len(live) else master,
                        [[s["master_param"] for s in st], [s["exp_avg"] for s in st], [s["exp_avg_sq"] for s in st],
                         ps]))
        return out, True
