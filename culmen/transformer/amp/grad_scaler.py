"""A loss scaler whose inf/NaN check spans the model-parallel group (Apex's ``apex.transformer.amp.GradScaler``).

With tensor or pipeline parallelism each rank holds only part of the gradients, so one rank may see an
overflow the others do not. This scaler all-reduces (MAX) the found-inf flag over
``parallel_state.get_model_parallel_group()`` both before stepping the optimizer and before updating the
scale, so every rank of a model replica skips the same steps and keeps the same scale. Data-parallel
replicas are not included: their gradients are already all-reduced, so they agree.

Built on ``torch.amp.GradScaler``; it runs on any device ``torch.distributed`` can reduce on (NCCL for
CUDA tensors, gloo for CPU ones: pass ``device="cpu"``). Optimizers that set
``_custom_amp_unscale_grads = True`` unscale their own gradients through
``optimizer.unscale_grads(inv_scale, found_inf, allow_fp16)`` (Apex's hook, used by distributed
optimizers that hold sharded gradients).

Differences from Apex: ``update`` reduces the sum of all found-inf flags in one collective (Apex issued one
per device and optimizer, which deadlocks when ranks hold different numbers of them); the step decision
reads one device value instead of one per device.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import _refresh_per_optimizer_state

from culmen.transformer import parallel_state

__all__ = ["GradScaler"]


def _reduce_found_inf(found_inf: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=parallel_state.get_model_parallel_group())
    return found_inf


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with the found-inf flag all-reduced (MAX) over the model-parallel group.

    Args:
        init_scale: initial scale factor.
        growth_factor: factor the scale grows by after ``growth_interval`` steps without inf/NaN.
        backoff_factor: factor the scale shrinks by after a step with inf/NaN.
        growth_interval: consecutive clean steps before growing.
        enabled: ``False`` makes every method a pass-through.
        device: device type of the gradients (keyword only; Apex was CUDA-only).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, *, device: str = "cuda") -> None:
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)

    def _unscale_grads_(self, optimizer, *args):
        if getattr(optimizer, "_custom_amp_unscale_grads", False):
            return optimizer.unscale_grads(*args)
        return super()._unscale_grads_(optimizer, *args)

    def _combined_found_inf(self, states) -> torch.Tensor:
        flags = [f for state in states for f in state["found_inf_per_device"].values()]
        if not flags:
            raise RuntimeError("No inf checks were recorded prior to update.")
        device = self._scale.device if self._scale is not None else flags[0].device
        # A fresh tensor: the reduction must not overwrite the per-device flags torch keeps.
        total = flags[0].to(device=device, dtype=torch.float32, copy=True)
        for f in flags[1:]:
            total += f.to(device=device, non_blocking=True)
        return _reduce_found_inf(total)

    def _maybe_opt_step(self, optimizer, optimizer_state: dict[str, Any], *args, **kwargs):
        found_inf = self._combined_found_inf([optimizer_state])
        if found_inf.item() == 0:
            return optimizer.step(*args, **kwargs)
        return None

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back off the scale if any rank of the model replica saw inf/NaN this iteration, else count towards
        growth; or set ``new_scale`` (a float or a 1-element tensor on the scaler's device)."""
        if not self._enabled:
            return
        if new_scale is not None:
            super().update(new_scale)
            return
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        found_inf = self._combined_found_inf(self._per_optimizer_states.values())
        torch._amp_update_scale_(scale, growth_tracker, found_inf, self._growth_factor, self._backoff_factor,
                                 self._growth_interval)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
