"""``apex.contrib.optimizers.FP16_Optimizer``: the master-weight wrapper of the deprecated contrib fused
optimizers (``FusedAdam``, ``FusedLAMB``, ``FusedSGD`` of ``apex.contrib.optimizers``).

Unlike ``apex.fp16_utils.FP16_Optimizer`` (one fp32 master per parameter, any optimizer), this variant keeps
each param group as two flat buffers: the model's half-precision parameters become views into one flat
fp16/bf16 buffer, and the wrapped optimizer steps one flat fp32 master copy. A step flattens the group's
gradients, takes their norm (inf / nan = overflow: the step is skipped and a dynamic scale shrinks), and hands
the optimizer the old contrib ``step(grads=, output_params=, scale=, grad_norms=)`` call, which unscales (and
clips by ``max_grad_norm``), updates the master and writes it back, cast, into the flat model buffer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from culmen.amp._amp_state import warn_deprecated_once
from culmen.fp16_utils.fp16_optimizer import _WrapsOptimizer
from culmen.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler

__all__ = ["FP16_Optimizer"]

_DYNAMIC_ARGS = ("init_scale", "scale_factor", "scale_window")


class FP16_Optimizer(_WrapsOptimizer):  # noqa: N801 - Apex's name
    """Flat fp32 masters and loss scaling around a contrib fused optimizer.

    Args:
        init_optimizer: a contrib ``FusedAdam`` / ``FusedLAMB`` / ``FusedSGD`` (``step`` taking ``grads``,
            ``output_params``, ``scale``, ``grad_norms``) over the model's fp16/bf16 parameters; every param
            group is replaced by one flat fp32 master.
        static_loss_scale: the loss scale when ``dynamic_loss_scale`` is False.
        dynamic_loss_scale: start at 2**16, halve on overflow (not below 1), double after ``scale_window``
            (1000) steps without one.
        dynamic_loss_args: Apex refuses these; culmen takes ``init_scale``, ``scale_factor`` (2) and
            ``scale_window`` (1000).
        verbose: print when an overflow skips a step.

    ``backward(loss)`` runs ``(loss.float() * loss_scale).backward()``; ``step()`` (``None`` when an overflow
    skipped it); ``zero_grad(set_grads_to_None=True)``; ``state_dict`` / ``load_state_dict`` (the scaler's state,
    the wrapped optimizer's, and the flat masters); ``state`` and ``param_groups`` are the wrapped optimizer's.
    """

    def __init__(self, init_optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict | None = None,
                 verbose: bool = True) -> None:
        warn_deprecated_once("contrib.FP16_Optimizer", "apex.contrib.optimizers.FP16_Optimizer is deprecated (as in "
                                                       "Apex); use apex.optimizers with amp or torch.autocast.")
        if not hasattr(init_optimizer, "param_groups"):
            raise TypeError(f"FP16_Optimizer wraps an optimizer, got {type(init_optimizer).__name__}")
        self.optimizer = init_optimizer
        self.verbose = verbose
        self.fp16_groups: list[list[Tensor]] = []
        self.fp16_groups_flat: list[Tensor] = []
        self.fp32_groups_flat: list[Tensor] = []
        for gi, group in enumerate(init_optimizer.param_groups):
            params = list(group["params"])
            if not params:
                raise ValueError(f"FP16_Optimizer: param group {gi} has no parameters")
            dtypes = {p.dtype for p in params}
            if len(dtypes) != 1 or next(iter(dtypes)) not in (torch.float16, torch.bfloat16, torch.float32):
                raise TypeError(f"FP16_Optimizer: param group {gi} must hold parameters of one floating dtype "
                                f"(fp16, bf16 or fp32), got {sorted(str(d) for d in dtypes)}")
            flat = _flatten_dense_tensors([p.detach() for p in params])
            # the model's parameters become views of the flat buffer the optimizer writes
            for p, view in zip(params, _unflatten_dense_tensors(flat, params)):
                p.data = view
            master = flat.detach().clone().float().requires_grad_()
            self.fp16_groups.append(params)
            self.fp16_groups_flat.append(flat)
            self.fp32_groups_flat.append(master)
            group["params"] = [master]
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        self.cur_iter = 0
        # the scale and its update rule are fp16_utils' scalers (Apex's contrib copy has the same rule)
        self.loss_scaler: LossScaler | DynamicLossScaler
        if self.dynamic_loss_scale:
            args = dict(dynamic_loss_args or {})
            unknown = sorted(set(args) - set(_DYNAMIC_ARGS))
            if unknown:
                raise ValueError(f"dynamic_loss_args takes {', '.join(_DYNAMIC_ARGS)}, got {unknown}")
            self.loss_scaler = DynamicLossScaler(float(args.get("init_scale", 2.0 ** 16)),
                                                 float(args.get("scale_factor", 2.0)),
                                                 int(args.get("scale_window", 1000)))
        else:
            if dynamic_loss_args is not None:
                raise ValueError("dynamic_loss_args needs dynamic_loss_scale=True")
            self.loss_scaler = LossScaler(float(static_loss_scale))

    # ---------------------------------------------------------------------------------------------- steps

    @property
    def loss_scale(self) -> float:
        """The current loss scale."""
        return self.loss_scaler.cur_scale

    @property
    def cur_scale(self) -> float:
        """The current loss scale (Apex's attribute name)."""
        return self.loss_scaler.cur_scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self.loss_scaler.cur_scale = float(value)

    def backward(self, loss: Tensor) -> None:
        """``(loss.float() * loss_scale).backward()``."""
        (loss.float() * self.cur_scale).backward()

    def zero_grad(self, set_grads_to_None: bool = True) -> None:  # noqa: N803 - Apex's name
        """Clear the model parameters' gradients (to None, or zeroed in place)."""
        for group in self.fp16_groups:
            for p in group:
                if set_grads_to_None:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_()
                    p.grad.zero_()

    def step(self, closure: Any = None) -> Any:
        """Unscale, update the flat masters through the wrapped optimizer, write the model parameters; skipped
        (and a dynamic scale shrinks) when any group's gradient overflowed. Returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = []
        for gi, group in enumerate(self.fp16_groups):
            missing = [i for i, p in enumerate(group) if p.grad is None]
            if missing:
                raise RuntimeError(f"FP16_Optimizer.step: parameters {missing} of group {gi} have no gradient "
                                   "(call backward first)")
            grads.append(_flatten_dense_tensors([p.grad for p in group]))
        # every group's fp32 2-norm of its scaled gradient in one host read; inf or nan is an overflow (-1)
        dev = grads[0].device
        norms = torch.stack([torch.linalg.vector_norm(g, 2, dtype=torch.float32).to(dev) for g in grads]).tolist()
        norms = [n if math.isfinite(n) else -1.0 for n in norms]
        if any(n < 0 for n in norms):
            self._update_scale(True)
            return loss
        self.optimizer.step(grads=[[g] for g in grads], output_params=[[f] for f in self.fp16_groups_flat],
                            scale=self.cur_scale, grad_norms=norms)
        self._update_scale(False)
        return loss

    def _update_scale(self, overflow: bool) -> None:
        if overflow and self.verbose:
            kind = "dynamic" if self.dynamic_loss_scale else "static"
            print(f"\nGrad overflow on iteration {self.cur_iter}; skipping the step ({kind} loss scale "
                  f"{self.cur_scale})")
        self.loss_scaler.update_scale(overflow)
        self.cur_iter += 1

    # ------------------------------------------------------------------------------------------ the state

    # ``state`` / ``param_groups`` (one flat fp32 master each) are the wrapped optimizer's (``_WrapsOptimizer``)

    def state_dict(self) -> dict:
        """The scaler's state, ``optimizer_state_dict`` and the flat masters (``fp32_groups_flat``)."""
        sd = {"dynamic_loss_scale": self.dynamic_loss_scale, "cur_scale": self.cur_scale, "cur_iter": self.cur_iter}
        if self.dynamic_loss_scale:
            sc = self.loss_scaler
            sd.update(last_overflow_iter=sc.last_overflow_iter, scale_factor=sc.scale_factor,
                      scale_window=sc.scale_window)
        sd["optimizer_state_dict"] = self.optimizer.state_dict()
        sd["fp32_groups_flat"] = self.fp32_groups_flat
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what ``state_dict`` saved; the model parameters take the loaded masters' values."""
        masters = state_dict["fp32_groups_flat"]
        if len(masters) != len(self.fp32_groups_flat) or any(
                a.shape != b.shape for a, b in zip(masters, self.fp32_groups_flat)):
            raise ValueError("load_state_dict: fp32_groups_flat does not match this optimizer's param groups "
                             f"({[tuple(m.shape) for m in masters]} vs "
                             f"{[tuple(m.shape) for m in self.fp32_groups_flat]})")
        self.dynamic_loss_scale = bool(state_dict["dynamic_loss_scale"])
        self.cur_iter = int(state_dict["cur_iter"])
        if self.dynamic_loss_scale:
            self.loss_scaler = DynamicLossScaler(float(state_dict["cur_scale"]), float(state_dict["scale_factor"]),
                                                 int(state_dict["scale_window"]))
            self.loss_scaler.cur_iter = self.cur_iter
            self.loss_scaler.last_overflow_iter = int(state_dict["last_overflow_iter"])
        else:
            self.loss_scaler = LossScaler(float(state_dict["cur_scale"]))
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        with torch.no_grad():
            for current, saved, flat in zip(self.fp32_groups_flat, masters, self.fp16_groups_flat):
                current.copy_(saved)
                flat.copy_(current)
