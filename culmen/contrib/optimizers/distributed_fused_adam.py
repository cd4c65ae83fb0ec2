"""``apex.contrib.optimizers.distributed_fused_adam.DistributedFusedAdam``: ZeRO-2 Adam on torch.distributed."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from culmen.contrib.optimizers._zero import ZeroBase
from culmen.ops.multi_tensor.adam import ADAM_MODE_ADAMW, ADAM_MODE_L2, adam_update
from culmen.optimizers._base import check_hyper

__all__ = ["DistributedFusedAdam"]


class DistributedFusedAdam(ZeroBase):
    """Adam / AdamW whose state and gradients are sharded over the data-parallel ranks (ZeRO stage 2).

    Each rank keeps the fp32 moments (and master params) of ``1 / distributed_size`` of the model;
    gradients are reduce-scattered per bucket from backward hooks (``overlap_grad_sync``), each rank
    updates its shard with culmen's multi-tensor Adam kernel, and the new params are all-gathered
    (overlapped with the next forward with ``overlap_param_sync``). See ``culmen.contrib.optimizers._zero``
    for the layout. The math is :class:`culmen.optimizers.FusedAdam`'s (``adam_w_mode``: decoupled weight
    decay) on the averaged gradient.

    Args (Apex's names and defaults):
        params: params or param groups (all on ``device``). lr=1e-3, bias_correction=True,
        betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True, weight_decay=0.0.
        amsgrad: unsupported (raises, as Apex).
        dtype: dtype of the optimizer state and master params (default float32).
        grad_sync_dtype / param_sync_dtype: dtypes of the reduce-scatter and all-gather buffers (default
            ``dtype``; e.g. bfloat16 halves the traffic).
        device: where params and state live (default "cuda"; "cpu" runs on gloo).
        process_group: the data-parallel group (default WORLD). distributed_process_group: the group the
            state is sharded over (default ``process_group``); redundant_process_group: the group across
            which shards are replicated (its size times the distributed size = the process group size).
        average_grad_sync: average (not sum) gradients over the process group. Default True.
        overlap_grad_sync: reduce-scatter buckets from backward hooks. Default True.
        overlap_param_sync: launch the all-gathers at the end of ``step`` and wait for them at the first
            forward pre-hook of a module owning a param (or ``param_sync()``). Default False.
        bucket_cap_mb: bucket size in MiB of ``grad_sync_dtype``. Default 100.
        pipeline_size: reduce-scatters in flight at once. Default 2.
        contiguous_param_buffer / contiguous_grad_buffer: buckets are views of one persistent buffer
            (params of ``param_sync_dtype`` become views of it; enables :meth:`grad_buffer_view`).
        store_params: keep master params (``dtype``) for the local shard (default True); False updates
            from the params themselves.
        store_param_remainders: bf16 params with fp32 masters stored as the 16 low bits only
            (``dtype=float32``, ``param_sync_dtype=bfloat16``): the master is the param's bits plus the
            remainder, exactly.
        with_scaled_states: keep moments and masters in fp16 with one fp32 scale per fragment.
        nccl_ub: accepted (NCCL user buffers are an allocator detail culmen leaves to PyTorch).
        capturable: step counter and lr as device tensors (no host sync in ``step``).

    State: per bucket shard ``exp_avg``, ``exp_avg_sq`` and ``params`` (or ``param_remainders``); per
    group ``step``. ``state_dict`` / ``load_state_dict``: see :meth:`ZeroBase.state_dict`.

    GradScaler: ``torch.amp.GradScaler.step(opt)`` passes itself (``grad_scaler=``); the gradients are
    unscaled inside the update, a non-finite global gradient norm skips the step on every rank (no host
    sync) and is reported to the scaler (``found_inf_per_device``).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, dtype: torch.dtype = torch.float32,
                 grad_sync_dtype: torch.dtype | None = None, param_sync_dtype: torch.dtype | None = None,
                 device: torch.device | str = "cuda", process_group: Any = None,
                 distributed_process_group: Any = None, redundant_process_group: Any = None,
                 average_grad_sync: bool = True, overlap_grad_sync: bool = True, overlap_param_sync: bool = False,
                 bucket_cap_mb: float = 100.0, pipeline_size: int = 2, contiguous_param_buffer: bool = False,
                 contiguous_grad_buffer: bool = False, store_params: bool = True, store_param_remainders: bool = False,
                 with_scaled_states: bool = False, nccl_ub: bool = False, capturable: bool = False) -> None:
        check_hyper(type(self).__name__, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                    bias_correction=bias_correction)
        if amsgrad:
            raise RuntimeError("DistributedFusedAdam does not support the AMSGrad variant (amsgrad=True)")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.capturable = bool(capturable)
        self.nccl_ub = bool(nccl_ub)
        self._step_supports_amp_scaling = True
        self._zero_init(dtype=dtype, grad_sync_dtype=grad_sync_dtype, param_sync_dtype=param_sync_dtype,
                        device=device, process_group=process_group,
                        distributed_process_group=distributed_process_group,
                        redundant_process_group=redundant_process_group, average_grad_sync=average_grad_sync,
                        overlap_grad_sync=overlap_grad_sync, overlap_param_sync=overlap_param_sync,
                        bucket_cap_mb=bucket_cap_mb, pipeline_size=pipeline_size,
                        contiguous_param_buffer=contiguous_param_buffer,
                        contiguous_grad_buffer=contiguous_grad_buffer, store_params=store_params,
                        store_param_remainders=store_param_remainders, with_scaled_states=with_scaled_states)
        for g in self.param_groups:
            g.setdefault("step", 0)

    def init_params(self, params: Iterable[Tensor] | None = None, **kwargs: Any) -> None:
        """Apex initializes buckets lazily; culmen lays out every param at construction, so this only
        checks that ``params`` are managed by the optimizer."""
        for p in params or ():
            if id(p) not in self._param_index:
                raise ValueError("DistributedFusedAdam.init_params: a param is not managed by this optimizer")

    def init_params_bucket(self, params: Iterable[Tensor], **kwargs: Any) -> None:
        """Same as :meth:`init_params` (the layout is fixed at construction)."""
        self.init_params(params)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, grad_scaler: Any = None) -> Any:
        """Synchronize gradients, update the local shard, all-gather the params; returns ``closure()``'s loss."""
        loss, inv_scale, noop, found_inf = self._begin(closure, grad_scaler)
        mode = ADAM_MODE_ADAMW if self.adam_w_mode else ADAM_MODE_L2
        frags_by_group = self._group_frags()
        for gi, group in enumerate(self.param_groups):
            step = group.get("step", 0)
            on_device = self.capturable or found_inf is not None or isinstance(step, Tensor)
            if on_device:
                if not isinstance(step, Tensor):
                    step = torch.full((1,), int(step), dtype=torch.int32, device=self.device)
                step = group["step"] = step.to(self.device)
                step.add_(noop.eq(0).to(step.dtype))
            else:
                step = group["step"] = int(step) + 1
            frags = frags_by_group.get(gi)
            if not frags:
                continue
            lr = group["lr"]
            if self.capturable and not isinstance(lr, Tensor):
                lr = torch.tensor(float(lr), dtype=torch.float32, device=self.device)
            if self.store_param_remainders:
                # the kernel rebuilds the fp32 master from the bf16 value and the int16 remainder in place
                masters, back_p = self._remainder_views(frags), None
            else:
                masters, back_p = self._master_views(frags)
            ms, back_m = self._state_views(frags, "exp_avg")
            vs, back_v = self._state_views(frags, "exp_avg_sq")
            grads = self._grad_views(frags)
            outs = self._param_outs(frags)
            beta1, beta2 = group["betas"]
            adam_update([grads, outs, ms, vs, masters], lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                        step=step, mode=mode, bias_correction=bool(group["bias_correction"]),
                        weight_decay=group["weight_decay"], noop_flag=noop, inv_scale=inv_scale,
                        op="DistributedFusedAdam")
            for back in (back_p, back_m, back_v):
                if back is not None:
                    back()
        self._end()
        return loss
