"""Apex's ``SyncBatchNorm``, ``convert_syncbn_model`` and ``create_syncbn_process_group``.

Training-mode statistics are computed per rank by Triton kernels (Welford-exact partials), all-gathered
across the process group as packed ``(mean, M2, count)`` rows and combined with the parallel formula,
so per-rank batch sizes may differ. Eval mode falls back to ``F.batch_norm`` (except with
``channel_last``, ``fuse_relu`` or a residual ``z``, which use culmen's kernels with the running stats).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from culmen.ops.batch_norm import sync_batch_norm

__all__ = ["SyncBatchNorm", "convert_syncbn_model", "create_syncbn_process_group"]


class SyncBatchNorm(_BatchNorm):
    """Batch norm whose training statistics cover the batches of every rank of ``process_group``.

    Args:
        num_features: ``C``.
        eps, momentum, affine, track_running_stats: as ``torch.nn.BatchNorm2d`` (``momentum=None``: cumulative
            average). The running variance is the unbiased variance of the whole group's batch.
        process_group: the ranks that normalize together (default: the world; see
            ``create_syncbn_process_group``). Without ``torch.distributed`` it is this process alone.
        channel_last: inputs have channels in the last dim, ``(N, ..., C)`` (2-D inputs always do).
            NCHW-shaped inputs stored ``torch.channels_last`` are recognised without this flag.
        fuse_relu: ``forward(x, z)`` returns ``relu(bn(x) + z)``.

    ``forward(input, z=None)``: ``input`` 2D-5D, fp16/bf16/fp32/fp64, per-rank batch sizes may differ;
    ``z`` an optional tensor like ``input`` added before the (optional) ReLU. Returns ``input``'s dtype,
    shape and layout; statistics in fp32. ``weight``/``bias`` gradients are this rank's share (the
    data-parallel all-reduce adds them up), as in Apex and ``torch.nn.SyncBatchNorm``.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Any = None, channel_last: bool = False,
                 fuse_relu: bool = False):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats)
        self.process_group = process_group
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def _specify_process_group(self, process_group: Any) -> None:
        self.process_group = process_group

    def _specify_channel_last(self, channel_last: bool) -> None:
        self.channel_last = channel_last

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2 or input.dim() > 5:
            raise ValueError(f"expected 2D-5D input (got {input.dim()}D input)")

    def _group(self):
        if self.process_group is not None:
            return self.process_group
        if dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return None

    def forward(self, input: Tensor, z: Tensor | None = None) -> Tensor:
        # The op checks the input against the parameters and running statistics once per input signature
        # (its cached plan); nothing is validated here per call.
        if not self.training and self.track_running_stats and not self.channel_last and not self.fuse_relu \
                and z is None:
            self._check_input_dim(input)
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                self.eps)
        factor = 0.0
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch_stats = self.training or not self.track_running_stats
        update = self.training and self.track_running_stats
        return sync_batch_norm(
            input, self.weight, self.bias,
            self.running_mean if (update or not use_batch_stats) else None,
            self.running_var if (update or not use_batch_stats) else None,
            use_batch_stats, factor, self.eps, process_group=self._group(), channel_last=self.channel_last,
            fuse_relu=self.fuse_relu, z=z)

    def extra_repr(self) -> str:
        s = super().extra_repr()
        return s + (", channel_last=True" if self.channel_last else "") + (", fuse_relu=True" if self.fuse_relu else "")


def convert_syncbn_model(module: torch.nn.Module, process_group: Any = None,
                         channel_last: bool = False) -> torch.nn.Module:
    """Replace every ``_BatchNorm`` of ``module`` (recursively) by a ``SyncBatchNorm``.

    The running statistics are shared with the original layer (same tensors), the affine parameters
    copied (same device, dtype and ``requires_grad``), ``training`` kept. InstanceNorm layers are left
    alone. Returns the converted module (a new object when ``module`` itself is a batch norm).
    """
    if isinstance(module, torch.nn.modules.instancenorm._InstanceNorm):
        return module
    mod = module
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        mod = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group, channel_last=channel_last)
        mod.running_mean = module.running_mean
        mod.running_var = module.running_var
        mod.num_batches_tracked = module.num_batches_tracked
        if module.affine:
            with torch.no_grad():
                mod.weight = torch.nn.Parameter(module.weight.detach().clone(),
                                                requires_grad=module.weight.requires_grad)
                mod.bias = torch.nn.Parameter(module.bias.detach().clone(), requires_grad=module.bias.requires_grad)
        mod.train(module.training)
    for name, child in module.named_children():
        mod.add_module(name, convert_syncbn_model(child, process_group=process_group, channel_last=channel_last))
    return mod


def create_syncbn_process_group(group_size: int):
    """Split the world into contiguous groups of ``group_size`` ranks; return this rank's group.

    ``group_size == 0`` returns ``None`` (the whole world). Every rank must call it (it creates every
    group collectively). Raises ``ValueError`` unless ``group_size`` divides the world size.
    """
    if group_size == 0:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("create_syncbn_process_group needs torch.distributed initialized")
    world_size = dist.get_world_size()
    if group_size < 0 or group_size > world_size or world_size % group_size != 0:
        raise ValueError(f"group_size={group_size} must divide the world size {world_size}")
    rank = dist.get_rank()
    group = None
    for g in range(world_size // group_size):
        ranks = list(range(g * group_size, (g + 1) * group_size))
        cur = dist.new_group(ranks=ranks)
        if rank // group_size == g:
            group = cur
    return group
