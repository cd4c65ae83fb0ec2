"""``FP16_Optimizer``: fp32 master weights and loss scaling around any optimizer (Apex's, deprecated there).

Wrap an optimizer built on a 16-bit (fp16 or bf16) model::

    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True)
    loss = criterion(model(x), y)
    optimizer.backward(loss)        # instead of loss.backward()
    optimizer.step()                # skipped (with the scale reduced) when the gradients overflowed

The 16-bit parameters of each group are replaced by fp32 masters; ``backward`` scales the loss,
and ``update_master_grads`` unscales the 16-bit gradients into the masters' gradients in one
multi-tensor launch with one device-to-host sync for the overflow check. ``step`` updates the masters
and copies them into the model. Scaling uses :class:`culmen.amp.scaler.LossScaler` (as in Apex's last
releases; ``dynamic_loss_args`` are its keyword arguments).

Differences from Apex: parameters may live on any device and be bf16; the first construction emits a
one-time ``FutureWarning`` (Apex's deprecation warning).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from culmen.amp._amp_state import maybe_print, warn_deprecated_once
from culmen.amp._process_optimizer import _copy, _zero_
from culmen.amp.scaler import LossScaler
from culmen.fp16_utils.fp16util import clip_grad_norm
from culmen.multi_tensor_apply import amp_C

__all__ = ["FP16_Optimizer"]

_LOW = (torch.float16, torch.bfloat16)


class _WrapsOptimizer:
    """The wrapped ``self.optimizer``'s ``state`` and ``param_groups`` as the wrapper's own (settable; e.g. to
    change the learning rate); pickling refused, as Apex's wrappers do: they are saved through ``state_dict()``.
    Shared by this module's and ``apex.contrib.optimizers``' ``FP16_Optimizer``."""

    optimizer: torch.optim.Optimizer

    def __getstate__(self) -> None:
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state: Any) -> None:
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    @property
    def state(self) -> Any:
        """The wrapped optimizer's ``state`` (settable)."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's ``param_groups`` (settable; e.g. to change the learning rate)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.optimizer.param_groups = value


class FP16_Optimizer(_WrapsOptimizer):  # noqa: N801 - Apex's name
    """Master-weight wrapper of ``init_optimizer`` (see the module docstring).

    Args:
        init_optimizer: an optimizer over the model's (fp16 / bf16 / fp32) parameters.
        static_loss_scale: the loss scale when ``dynamic_loss_scale`` is False.
        dynamic_loss_scale: use a dynamic loss scale (init 2**16, x2 every 2000 clean steps, /2 on overflow).
        dynamic_loss_args: keyword arguments of :class:`culmen.amp.scaler.LossScaler`
            (``init_scale``, ``scale_factor``, ``scale_window``, ``min_loss_scale``, ``max_loss_scale`` ...).
        verbose: print the parameters found in each group.
    """

    def __init__(self, init_optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict | None = None,
                 verbose: bool = True) -> None:
        warn_deprecated_once("FP16_Optimizer", "culmen.fp16_utils.FP16_Optimizer is deprecated (as in Apex); use "
                                               "amp.initialize(..., opt_level='O2') or torch.autocast with "
                                               "torch.amp.GradScaler.")
        if not hasattr(init_optimizer, "param_groups"):
            raise TypeError(f"FP16_Optimizer wraps an optimizer, got {type(init_optimizer).__name__}")
        self.verbose = verbose
        self.optimizer = init_optimizer
        self.fp16_groups: list[list[Tensor]] = []
        self.fp32_from_fp16_groups: list[list[Tensor]] = []
        self.fp32_from_fp32_groups: list[list[Tensor]] = []
        for gi, group in enumerate(self.optimizer.param_groups):
            self.maybe_print(f"FP16_Optimizer processing param group {gi}:")
            fp16_this, fp32_this, masters_this = [], [], []
            for i, param in enumerate(group["params"]):
                if not param.requires_grad:
                    continue
                if param.dtype in _LOW:
                    self.maybe_print(f"FP16_Optimizer received {param.dtype} with {tuple(param.shape)}")
                    fp16_this.append(param)
                    master = param.detach().clone().float()
                    master.requires_grad = True
                    group["params"][i] = master
                    masters_this.append(master)
                    if param in self.optimizer.state:
                        self.optimizer.state[master] = self.optimizer.state.pop(param)
                elif param.dtype == torch.float32:
                    self.maybe_print(f"FP16_Optimizer received torch.float32 with {tuple(param.shape)}")
                    fp32_this.append(param)
                else:
                    raise TypeError("Wrapped parameters must be float16, bfloat16 or float32 tensors. "
                                    f"Received {param.dtype}")
            self.fp16_groups.append(fp16_this)
            self.fp32_from_fp16_groups.append(masters_this)
            self.fp32_from_fp32_groups.append(fp32_this)
        self.all_fp16_params = [p for g in self.fp16_groups for p in g]
        self.all_fp32_from_fp16_params = [p for g in self.fp32_from_fp16_groups for p in g]
        self.all_fp32_from_fp32_params = [p for g in self.fp32_from_fp32_groups for p in g]
        # Recast any per-parameter state that already exists to fp32.
        self.optimizer.load_state_dict(self.optimizer.state_dict())
        if dynamic_loss_scale:
            self.dynamic_loss_scale = True
            self.loss_scaler = LossScaler("dynamic", **(dynamic_loss_args or {}))
        else:
            self.dynamic_loss_scale = False
            self.loss_scaler = LossScaler(static_loss_scale)
        self.overflow = False
        self.first_closure_call_this_step = True
        self.clip_grad_norm = clip_grad_norm
        self.multi_tensor_scale = amp_C.multi_tensor_scale
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int32,
                                               device=self.all_fp16_params[0].device if self.all_fp16_params
                                               else "cpu")

    def maybe_print(self, msg: str) -> None:
        """Print ``msg`` when ``verbose``."""
        if self.verbose:
            print(msg)

    def zero_grad(self, set_grads_to_None: bool = False) -> None:  # noqa: N803 - Apex's name
        """Zero (or set to None) the grads of the masters, the fp32 params and the 16-bit model params."""
        for group in (*self.optimizer.param_groups, {"params": self.all_fp16_params}):
            for p in group["params"]:
                if set_grads_to_None:
                    p.grad = None
                elif p.grad is not None:
                    _zero_(p.grad)

    def _master_params_to_model_params(self) -> None:
        _copy(self.all_fp32_from_fp16_params, self.all_fp16_params)

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> float | Tensor:
        """Clip the fp32 master grads with ``torch.nn.utils.clip_grad_norm_``; return the total norm.

        Returns -1 when the last backward overflowed (the grads are invalid then).
        """
        if self.overflow:
            return -1
        fp32_params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return self.clip_grad_norm(fp32_params, max_norm, norm_type)

    def state_dict(self) -> dict:
        """The loss scaler, flags, the wrapped optimizer's state dict and the fp32 master values."""
        return {
            "loss_scaler": self.loss_scaler,
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": [[p.detach() for p in g] for g in self.fp32_from_fp16_groups],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from :meth:`state_dict`, including the exact fp32 master values."""
        self.loss_scaler = state_dict["loss_scaler"]
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self.overflow = state_dict["overflow"]
        self.first_closure_call_this_step = state_dict["first_closure_call_this_step"]
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        with torch.no_grad():
            for current_group, saved_group in zip(self.fp32_from_fp16_groups, state_dict["fp32_from_fp16"]):
                for current, saved in zip(current_group, saved_group):
                    current.copy_(saved)

    def step(self, closure: Callable[[], Tensor] | None = None) -> Any:
        """Update the masters and copy them into the model; skipped when the last backward overflowed.

        With a ``closure`` (which must call ``self.backward(loss)`` and return the loss) the step may
        be called without a prior backward; an overflowing closure is re-run at the reduced scale.
        """
        if self.overflow:
            maybe_print(f"Gradient overflow.  Skipping step, reducing loss scale to {self.loss_scaler.loss_scale()}")
            return None
        retval = self._step_with_closure(closure) if closure is not None else self.optimizer.step()
        self._master_params_to_model_params()
        return retval

    def _step_with_closure(self, closure: Callable[[], Tensor]) -> Any:
        def wrapped_closure() -> Tensor:
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                # The optimizer may call the closure several times per step (LBFGS) and update the
                # masters in between: refresh the model before re-evaluating.
                self._master_params_to_model_params()
            temp_loss = closure()
            while self.overflow:
                print(f"OVERFLOW within closure! Skipping step, reducing loss scale to "
                      f"{self.loss_scaler.loss_scale()}")
                temp_loss = closure()
            return temp_loss

        retval = self.optimizer.step(wrapped_closure)
        self.first_closure_call_this_step = True
        return retval

    def backward(self, loss: Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """``(loss.float() * loss_scale).backward()``, then (by default) :meth:`update_master_grads`.

        Pass ``update_master_grads=False`` to accumulate the 16-bit grads over several backwards and
        call :meth:`update_master_grads` once before ``step``.
        """
        scaled_loss = loss.float() * self.loss_scaler.loss_scale()
        scaled_loss.backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Unscale the model grads into the master grads and check them for overflow (one sync)."""
        self.loss_scaler.clear_overflow_state()
        scale = self.loss_scaler.loss_scale()
        with torch.no_grad():
            if self.all_fp16_params:
                model_grads, master_grads = [], []
                for model_p, master_p in zip(self.all_fp16_params, self.all_fp32_from_fp16_params):
                    if model_p.grad is not None:
                        model_grads.append(model_p.grad)
                        if master_p.grad is None:
                            master_p.grad = torch.empty_like(master_p)
                        master_grads.append(master_p.grad)
                self.loss_scaler.unscale(model_grads, master_grads, scale)
            if self.all_fp32_from_fp32_params:
                grads = [p.grad for p in self.all_fp32_from_fp32_params if p.grad is not None]
                self.loss_scaler.unscale(grads, grads, scale)
        self.overflow = self.loss_scaler.update_scale()

    def inspect_master_grad_data(self) -> list[list[Tensor | None]] | None:
        """The masters' ``.grad`` per group (None entries for params without grads); None after an overflow."""
        if self.overflow:
            print("Warning:  calling FP16_Optimizer.inspect_master_grad_data while in an overflow state.  "
                  "Gradients are currently invalid (may be inf, nan, or stale).  Returning None.")
            return None
        return [[p.grad.data if p.grad is not None else None for p in group["params"]]
                for group in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        """The current loss scale (settable)."""
        return self.loss_scaler.loss_scale()

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_scaler._loss_scale = value
