"""Apex's ``apex.contrib.cudnn_gbn``: ``GroupBatchNorm2d``, batch norm whose training statistics cover the batches
of ``group_size`` ranks.

Built on culmen's synchronized batch norm (``culmen.ops.batch_norm``: Triton statistics and normalization, fp32
statistics all-gathered over the group with ``torch.distributed``).

Differences from Apex's cuDNN version (peer-memory buffers, CUDA only, fp16 only, channels-last only, channels a
multiple of 8): any device, fp16 / bf16 / fp32 / fp64, NCHW or channels-last (the output keeps the input's
layout), any channel count; the groups are contiguous ranks ``[g * group_size, (g + 1) * group_size)`` as in
Apex; ``minibatch_mean`` / ``minibatch_inv_var`` exist but are not written (the batch statistics stay inside
the autograd graph); ``momentum=None`` gives the cumulative average.

The weight and bias gradients are, as with Apex's (its two-GPU test compares them with the whole batch's
gradient divided by the group size), the group's sum divided by ``group_size``: the same on every rank of a
group (one extra all-reduce of ``2C`` values per backward when ``group_size > 1``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from culmen.contrib.groupbn.batch_norm import group_and_factor, rank_group
from culmen.ops.batch_norm import sync_batch_norm

__all__ = ["GroupBatchNorm2d"]


class _GroupMeanGrad(torch.autograd.Function):
    """Identity on ``(weight, bias)``; their gradients become the group's mean (one all-reduce)."""

    @staticmethod
    def forward(ctx, weight, bias, group, size):
        ctx.group, ctx.size, ctx.C = group, size, weight.numel()
        return weight.view_as(weight), bias.view_as(bias)

    @staticmethod
    def backward(ctx, dw, db):
        both = torch.cat([dw.reshape(-1), db.reshape(-1)]).to(torch.promote_types(dw.dtype, torch.float32))
        dist.all_reduce(both, group=ctx.group)
        both.div_(ctx.size)
        C = ctx.C
        return both[:C].to(dw.dtype).view_as(dw), both[C:].to(db.dtype).view_as(db), None, None


class GroupBatchNorm2d(_BatchNorm):
    """Batch norm over ``(N, C, H, W)`` input, synchronized in training across groups of ``group_size`` ranks.

    Args:
        num_features: ``C``.
        group_size: ranks normalized together (a divisor of the world size; 1 without ``torch.distributed``).
            Every rank of a group must run the layer in step.
        eps, momentum, affine, track_running_stats: as ``torch.nn.BatchNorm2d``.

    ``forward(input)``: ``(N, C, H, W)`` fp16/bf16/fp32/fp64 (under autocast, cast to the autocast dtype as in
    Apex); returns ``input``'s dtype, shape and memory format. Evaluation with running statistics uses
    ``F.batch_norm``. The weight and bias gradients are the group's sum divided by ``group_size`` (see above).
    """

    def __init__(self, num_features: int, group_size: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True) -> None:
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats)
        self._group = rank_group(group_size, "group_size")
        self.group_size = group_size
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.group_id = rank // group_size
        self.group_rank = rank % group_size
        self.minibatch_mean = torch.zeros(num_features)
        self.minibatch_inv_var = torch.zeros(num_features)

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() != 4:
            raise ValueError(f"expected 4D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"input has {input.shape[1]} channels, GroupBatchNorm2d expects {self.num_features}")
        dev = input.device.type
        if torch.is_autocast_enabled(dev):
            input = input.to(torch.get_autocast_dtype(dev))
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                self.eps)
        group, factor = group_and_factor(self, self.group_size, "group_size")
        keep = self.training and self.track_running_stats
        weight, bias = self.weight, self.bias
        if self.group_size > 1 and weight is not None and torch.is_grad_enabled() and weight.requires_grad:
            weight, bias = _GroupMeanGrad.apply(weight, bias, group, self.group_size)
        return sync_batch_norm(input, weight, bias, self.running_mean if keep else None,
                               self.running_var if keep else None, True, factor, self.eps, process_group=group)
