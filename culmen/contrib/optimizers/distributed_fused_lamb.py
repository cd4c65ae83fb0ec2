"""``apex.contrib.optimizers.distributed_fused_lamb.DistributedFusedLAMB``: LAMB with sharded state."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from culmen.contrib.optimizers._zero import ZeroBase
from culmen.multi_tensor_apply import amp_C, multi_tensor_applier
from culmen.optimizers._base import check_hyper

__all__ = ["DistributedFusedLAMB"]


def _shard_groups(group_size: int) -> tuple[Any, Any]:
    """(distributed group, redundant group) of this rank for shards over ``group_size`` consecutive ranks.

    Every rank creates every group (``new_group`` is collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if group_size <= 0 or group_size >= world:
        return None, None
    if world % group_size:
        raise ValueError(f"DistributedFusedLAMB: dwu_group_size={group_size} must divide the world size {world}")
    mine_d = mine_r = None
    for start in range(0, world, group_size):
        g = dist.new_group(list(range(start, start + group_size)))
        if start <= rank < start + group_size:
            mine_d = g
    for off in range(group_size):
        g = dist.new_group(list(range(off, world, group_size)))
        if rank % group_size == off:
            mine_r = g
    return mine_d, mine_r


class DistributedFusedLAMB(ZeroBase):
    """LAMB with the state and gradients sharded over the data-parallel ranks (Apex's DistributedFusedLAMB).

    Per step: gradients are reduce-scattered (averaged over the ranks), the global norm ``G`` of the
    reduced gradients clips them to ``max_grad_norm`` (``> 0``); each rank computes the Adam direction
    ``u`` of its shard (``adam_w_mode``: decoupled weight decay added to ``u``; else L2 added to the
    gradient), the per-param norms ``||p||`` and ``||u||`` are summed over the shards' fragments and
    all-reduced, and ``p -= lr * ||p|| / ||u|| * u`` (the trust ratio applies where ``weight_decay != 0``
    or ``use_nvlamb``, and both norms are non-zero), then the params are all-gathered. The result equals
    :class:`culmen.optimizers.FusedLAMB` on the averaged gradient.

    Args: Apex's. ``lr=1e-3, bias_correction=True, grad_averaging=True, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0.0, max_grad_norm=0.0`` (0: no clipping), ``adam_w_mode=True, use_nvlamb=False,
    step_supports_amp_scaling=True, overlap_reductions=True`` (reduce-scatter from backward hooks),
    ``dwu_group_size=0`` (ranks the state is sharded over; 0: all, else shards are replicated across
    ``world / dwu_group_size`` groups), ``dwu_num_blocks=4`` (number of buckets),
    ``set_param_views_to_flat_buffer`` (params become views of the gathered buffer),
    ``skip_allgather`` (``step`` leaves the gather to :meth:`param_sync`), ``clip_after_ar=True``.
    The NCCL tuning knobs (``dwu_num_chunks``, ``dwu_num_rs_pg``, ``dwu_num_ar_pg``, ``dwu_num_ag_pg``,
    ``fused_norm``, ``full_ar``, ``fuse_scale``, ``nccl_allgather_channels``, ``verbose``, ``param_order``)
    are accepted and change nothing numerically. ``clip_after_ar=False`` clips with the same global norm
    (of the reduced gradients; Apex approximates it before the reduction). ``e5m2_allgather`` is not
    supported (raises).

    Extra keywords (culmen): ``dtype``, ``grad_sync_dtype``, ``param_sync_dtype``, ``device`` (default
    "cuda"), ``process_group``, ``bucket_cap_mb`` (overrides ``dwu_num_blocks``).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True, grad_averaging: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, adam_w_mode: bool = True, use_nvlamb: bool = False,
                 step_supports_amp_scaling: bool = True, overlap_reductions: bool = True, dwu_group_size: int = 0,
                 dwu_num_blocks: int = 4, dwu_num_chunks: int = 4, dwu_num_rs_pg: int = 1, dwu_num_ar_pg: int = 4,
                 dwu_num_ag_pg: int = 0, fused_norm: bool = False, e5m2_allgather: bool = False,
                 verbose: bool = False, clip_after_ar: bool = True, full_ar: bool = False,
                 set_param_views_to_flat_buffer: bool = False, skip_allgather: bool = False, fuse_scale: bool = False,
                 param_order: Any = None, nccl_allgather_channels: int = 0, *, dtype: torch.dtype = torch.float32,
                 grad_sync_dtype: torch.dtype | None = None, param_sync_dtype: torch.dtype | None = None,
                 device: torch.device | str = "cuda", process_group: Any = None,
                 bucket_cap_mb: float | None = None) -> None:
        owner = type(self).__name__
        check_hyper(owner, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                    grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        if e5m2_allgather:
            raise NotImplementedError(f"{owner}: e5m2_allgather=True (fp8 parameter all-gather) is not supported")
        if isinstance(dwu_num_blocks, bool) or not isinstance(dwu_num_blocks, int) or dwu_num_blocks < 1:
            raise ValueError(f"{owner}: dwu_num_blocks must be an int >= 1, got {dwu_num_blocks!r}")
        defaults = dict(lr=lr, bias_correction=bias_correction, grad_averaging=grad_averaging, betas=tuple(betas),
                        eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm, step=0)
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.use_nvlamb = bool(use_nvlamb)
        self.clip_after_ar = bool(clip_after_ar)
        self.skip_allgather = bool(skip_allgather)
        self._step_supports_amp_scaling = bool(step_supports_amp_scaling)
        self._global_scale: float | None = None
        self._has_overflow = False
        self._L2_grad_norm: Tensor | None = None
        if bucket_cap_mb is None:
            total = sum(p.numel() for g in self.param_groups for p in g["params"] if p.requires_grad)
            elem = torch.empty((), dtype=grad_sync_dtype or dtype).element_size()
            bucket_cap_mb = max(1, math.ceil(total / dwu_num_blocks)) * elem / 2 ** 20
        dgroup, rgroup = (None, None) if process_group is not None else _shard_groups(int(dwu_group_size))
        self._zero_init(dtype=dtype, grad_sync_dtype=grad_sync_dtype, param_sync_dtype=param_sync_dtype,
                        device=device, process_group=process_group, distributed_process_group=dgroup,
                        redundant_process_group=rgroup, average_grad_sync=True, overlap_grad_sync=overlap_reductions,
                        overlap_param_sync=False, bucket_cap_mb=bucket_cap_mb, pipeline_size=2,
                        contiguous_param_buffer=set_param_views_to_flat_buffer, contiguous_grad_buffer=False,
                        store_params=True, store_param_remainders=False, with_scaled_states=False)

    # Apex's amp hooks -----------------------------------------------------------------------

    def set_global_scale(self, global_scale: float) -> None:
        """The loss scale the gradients carry (they are divided by it in the next step)."""
        self._global_scale = float(global_scale)

    @property
    def global_scale(self) -> float | None:
        return self._global_scale

    @property
    def has_overflow(self) -> bool:
        """Whether the last step found inf/NaN gradients (and was skipped); reading it clears it."""
        flag, self._has_overflow = self._has_overflow, False
        return flag

    @property
    def peek_overflow(self) -> bool:
        return self._has_overflow

    @property
    def L2_grad_norm(self) -> Tensor | None:
        """Global L2 norm of the (unscaled) gradients of the last step."""
        return self._L2_grad_norm

    def complete_reductions(self) -> None:
        """Finish every gradient reduction (``grad_sync``)."""
        self.grad_sync()

    def set_is_accumulation_step(self, is_accumulation_step: bool) -> None:
        """On accumulation steps backward does not communicate (as :meth:`no_sync`)."""
        self._require_grad_sync = not bool(is_accumulation_step)

    def set_last_step(self, last_step: bool) -> None:
        self._last_step = bool(last_step)

    # step -------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, grad_scaler: Any = None) -> Any:
        """One LAMB step over the local shard (module docstring); returns ``closure()``'s loss."""
        if self._global_scale is not None and self._global_scale != 1.0:
            self._grad_scale = self._grad_scale / self._global_scale
        loss, inv_scale, noop, found_inf = self._begin(closure, grad_scaler)
        gnorm = self.grad_norm()
        self._L2_grad_norm = gnorm
        finite = bool(torch.isfinite(gnorm).item())  # one host sync: LAMB needs it for the skip anyway
        if not finite:
            self._has_overflow = True
            self._end()
            return loss
        frags_by_group = self._group_frags()
        dev = self.device
        nparams = len(self._params)
        # 1) Adam direction per fragment, 2) per-param norms over all shards, 3) trust-ratio update.
        work = []
        sums = torch.zeros(2, nparams, dtype=torch.float32, device=dev)
        for gi, group in enumerate(self.param_groups):
            group["step"] = int(group.get("step", 0)) + 1
            frags = frags_by_group.get(gi)
            if not frags:
                continue
            step = group["step"]
            beta1, beta2 = group["betas"]
            beta3 = 1.0 - beta1 if group["grad_averaging"] else 1.0
            bc1 = 1.0 - beta1 ** step if group["bias_correction"] else 1.0
            bc2 = 1.0 - beta2 ** step if group["bias_correction"] else 1.0
            wd, eps = float(group["weight_decay"]), float(group["eps"])
            maxn = group.get("max_grad_norm") or 0.0
            scale = inv_scale.reshape(())
            if maxn > 0:
                scale = scale / torch.clamp(gnorm / maxn, min=1.0)
            masters, _ = self._master_views(frags)
            ms, _ = self._state_views(frags, "exp_avg")
            vs, _ = self._state_views(frags, "exp_avg_sq")
            grads = [g.float() * scale for g in self._grad_views(frags)]
            if not self.adam_w_mode and wd != 0:
                torch._foreach_add_(grads, masters, alpha=wd)
            torch._foreach_mul_(ms, beta1)
            torch._foreach_add_(ms, grads, alpha=beta3)
            torch._foreach_mul_(vs, beta2)
            torch._foreach_addcmul_(vs, grads, grads, value=1.0 - beta2)
            den = torch._foreach_div(vs, bc2)
            torch._foreach_sqrt_(den)
            torch._foreach_add_(den, eps)
            upd = torch._foreach_div(ms, bc1)
            torch._foreach_div_(upd, den)
            if self.adam_w_mode and wd != 0:
                torch._foreach_add_(upd, masters, alpha=wd)
            noop_i = torch.zeros(1, dtype=torch.int32, device=dev)
            _, pn = multi_tensor_applier(amp_C.multi_tensor_l2norm, noop_i, [masters], True)
            _, un = multi_tensor_applier(amp_C.multi_tensor_l2norm, noop_i, [upd], True)
            idx = torch.tensor([f.param_id for f in frags], device=dev)
            sums[0].index_add_(0, idx, pn.float().square())
            sums[1].index_add_(0, idx, un.float().square())
            work.append((group, frags, masters, upd, idx))
        dist.all_reduce(sums, group=self.distributed_process_group)
        norms = sums.sqrt()
        for group, frags, masters, upd, idx in work:
            trust_on = self.use_nvlamb or float(group["weight_decay"]) != 0
            noop_i = torch.zeros(1, dtype=torch.int32, device=dev)
            # stage 2 takes per-tensor norms: each fragment gets its param's full norms
            multi_tensor_applier(amp_C.multi_tensor_lamb_stage2_cuda, noop_i, [masters, upd],
                                 norms[0].index_select(0, idx), norms[1].index_select(0, idx), float(group["lr"]),
                                 float(group["weight_decay"]) if trust_on else 0.0, self.use_nvlamb)
            torch._foreach_copy_(self._param_outs(frags), masters)
        if self.skip_allgather:
            self._grad_scale = self._unit_grad_scale()
            self._grad_norm = None
            self._launch_param_sync()
            return loss
        self._end()
        return loss
