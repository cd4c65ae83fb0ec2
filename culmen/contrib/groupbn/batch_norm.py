"""Apex's ``apex.contrib.groupbn``: ``BatchNorm2d_NHWC``, batch norm of ``(N, H, W, C)`` tensors with a fused ReLU
or add-ReLU, whose statistics may be synchronized over groups of ``bn_group`` ranks.

Built on culmen's synchronized batch norm (``culmen.ops.batch_norm``: Triton statistics, normalize + residual +
ReLU in one pass, fp32 statistics all-gathered over the group with ``torch.distributed``).

Differences from Apex's CUDA version: any device, fp16 / bf16 / fp32 / fp64; ``bn_group`` is any divisor of
the world size (Apex: 1, 2, 4 or 8 GPUs exchanging through CUDA IPC), the groups being contiguous ranks
``[g * bn_group, (g + 1) * bn_group)`` (the same ranks as Apex's XOR pairing); ``max_cta_per_sm``,
``cta_launch_margin`` and ``multi_stream`` are accepted and kept (the Triton launch plans size the grids);
``minibatch_mean`` / ``minibatch_riv`` exist as in Apex but are not written (the batch statistics stay inside
the autograd graph); ``momentum=None`` gives the cumulative average like ``torch.nn.BatchNorm2d``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from culmen.ops.batch_norm import sync_batch_norm

__all__ = ["BatchNorm2d_NHWC", "bn_NHWC_impl", "bn_addrelu_NHWC_impl"]

_GROUPS: dict[tuple[int, ...], object] = {}


def rank_group(group_size: int, arg: str = "group_size"):
    """The process group of this rank's ``group_size`` contiguous ranks (cached; only its members take part in
    creating it), or ``None`` when ``torch.distributed`` is not initialized (``group_size`` must then be 1).
    ``arg`` names the argument in errors."""
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"{arg} must be a positive int, got {group_size!r}")
    if not (dist.is_available() and dist.is_initialized()):
        if group_size != 1:
            raise ValueError(f"{arg}={group_size} needs torch.distributed to be initialized")
        return None
    world = dist.get_world_size()
    if world % group_size != 0:
        raise ValueError(f"{arg}={group_size} must divide the world size {world}")
    if group_size == world:
        return dist.group.WORLD
    rank = dist.get_rank()
    first = rank // group_size * group_size
    ranks = tuple(range(first, first + group_size))
    group = _GROUPS.get(ranks)
    if group is None:
        group = _GROUPS[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return group


def group_and_factor(bn: _BatchNorm, group_size: int, arg: str) -> tuple[object, float]:
    """A training step's bookkeeping for a group-synchronized batch norm ``bn``: its process group (``bn._group``,
    looked up now if the layer was built before ``torch.distributed`` was initialized) and the running-statistics
    update factor (``momentum``, or the cumulative average's ``1 / batches`` when it is ``None``; 0 outside
    training), counting the batch in ``num_batches_tracked``."""
    group = bn._group
    if group is None:
        group = bn._group = rank_group(group_size, arg)
    factor = 0.0
    if bn.training and bn.track_running_stats:
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    return group, factor


class BatchNorm2d_NHWC(_BatchNorm):
    """Batch norm over ``(N, H, W, C)`` (explicit NHWC, Apex's layout) input.

    Args:
        num_features: ``C``.
        fuse_relu: apply ReLU after the normalization; needed for ``forward(x, z)``.
        bn_group: ranks whose batches are normalized together (1: this rank alone). Every rank of a group
            must run the layer in step.
        max_cta_per_sm, cta_launch_margin, multi_stream: Apex's tuning knobs, accepted (see the module notes).

    ``forward(x, z=None)``: ``x`` ``(N, H, W, C)`` fp16/bf16/fp32/fp64; ``z`` like ``x`` (needs ``fuse_relu``):
    returns ``relu(bn(x) + z)``, else ``relu(bn(x))`` with ``fuse_relu``, else ``bn(x)``, in ``x``'s dtype and shape.
    eps 1e-5, momentum 0.1, affine, tracked running statistics (``_BatchNorm``'s defaults, as in Apex).
    Gradients for ``x``, ``z``, ``weight`` and ``bias`` (the parameter gradients are this rank's share).
    """

    def __init__(self, num_features: int, fuse_relu: bool = False, bn_group: int = 1, max_cta_per_sm: int = 2,
                 cta_launch_margin: int = 12, multi_stream: bool = False) -> None:
        super().__init__(num_features)
        if not isinstance(max_cta_per_sm, int) or max_cta_per_sm < 1:
            raise ValueError(f"max_cta_per_sm must be a positive int, got {max_cta_per_sm!r}")
        self.fuse_relu = bool(fuse_relu)
        self.multi_stream = multi_stream
        self.bn_group = bn_group
        self.max_cta_per_sm = max_cta_per_sm
        self.cta_launch_margin = cta_launch_margin
        self.minibatch_mean = torch.zeros(num_features)
        self.minibatch_riv = torch.zeros(num_features)
        self.local_rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        # The group's members construct the layer together, as in Apex. bn_group=1 still needs this rank's own
        # group once torch.distributed is up: the op's default would synchronize the whole world.
        self._group = rank_group(bn_group, "bn_group")

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() != 4:
            raise ValueError(f"expected 4D (N, H, W, C) input (got {input.dim()}D input)")

    def forward(self, x: Tensor, z: Tensor | None = None) -> Tensor:
        if z is not None and not self.fuse_relu:
            raise ValueError("z (the fused add-ReLU residual) needs fuse_relu=True")
        if x.dim() != 4 or x.shape[-1] != self.num_features:
            raise ValueError(f"x must be (N, H, W, {self.num_features}), got shape {tuple(x.shape)}")
        group, factor = group_and_factor(self, self.bn_group, "bn_group")
        use_batch_stats = self.training or not self.track_running_stats
        keep = self.track_running_stats
        return sync_batch_norm(x, self.weight, self.bias, self.running_mean if keep else None,
                               self.running_var if keep else None, use_batch_stats, factor, self.eps,
                               process_group=group, channel_last=True, fuse_relu=self.fuse_relu, z=z)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fuse_relu={self.fuse_relu}, bn_group={self.bn_group}"


class bn_NHWC_impl:  # noqa: N801 (Apex's name)
    """Apex's autograd function behind ``BatchNorm2d_NHWC.forward(x)``, with its positional arguments.

    ``apply(x, s, b, rm, riv, mini_m, mini_riv, ret_cta, mom, epsilon, fuse_relu, is_train, bn_group, my_data,
    pair_data, magic, pair_data2, pair_data3, fwd_occup, fwd_grid_x, bwd_occup, bwd_grid_x, multi_stream)``:
    ``x`` ``(N, H, W, C)``; ``s`` / ``b`` the ``(C,)`` scale and bias; ``rm`` / ``riv`` the running mean and
    variance (updated in place when ``is_train``, momentum ``mom``). Normalizes over the batch of this rank's
    ``bn_group`` contiguous ranks (culmen's ``sync_batch_norm``; differentiable in ``x``, ``s``, ``b``).
    Apex's CUDA-extension plumbing (``mini_m`` / ``mini_riv`` scratch, ``ret_cta``, the IPC peer pointers
    ``my_data`` / ``pair_data*`` / ``magic``, occupancies, grid sizes, ``multi_stream``) is accepted and unused:
    the group's reduction goes through ``torch.distributed``. Prefer the module, ``BatchNorm2d_NHWC``.
    """

    @staticmethod
    def apply(x, s, b, rm, riv, mini_m, mini_riv, ret_cta, mom, epsilon, fuse_relu, is_train, bn_group, my_data,
              pair_data, magic, pair_data2, pair_data3, fwd_occup, fwd_grid_x, bwd_occup, bwd_grid_x, multi_stream):
        return sync_batch_norm(x, s, b, rm, riv, bool(is_train), mom, epsilon,
                               process_group=rank_group(bn_group, "bn_group"), channel_last=True,
                               fuse_relu=bool(fuse_relu))


class bn_addrelu_NHWC_impl:  # noqa: N801 (Apex's name)
    """Apex's autograd function behind ``BatchNorm2d_NHWC.forward(x, z)``: ``relu(bn(x) + z)``.

    ``apply(x, z, s, b, rm, riv, mini_m, mini_riv, grid_dim_y, ret_cta, mom, epsilon, is_train, bn_group, my_data,
    pair_data, magic, pair_data2, pair_data3, fwd_occup, fwd_grid_x, bwd_occup, bwd_grid_x, multi_stream)``:
    as ``bn_NHWC_impl.apply`` with the residual ``z`` (like ``x``, ``(N, H, W, C)``; differentiable) added
    before the ReLU; ``grid_dim_y`` and the other CUDA-extension arguments are accepted and unused.
    """

    @staticmethod
    def apply(x, z, s, b, rm, riv, mini_m, mini_riv, grid_dim_y, ret_cta, mom, epsilon, is_train, bn_group, my_data,
              pair_data, magic, pair_data2, pair_data3, fwd_occup, fwd_grid_x, bwd_occup, bwd_grid_x, multi_stream):
        return sync_batch_norm(x, s, b, rm, riv, bool(is_train), mom, epsilon,
                               process_group=rank_group(bn_group, "bn_group"), channel_last=True, fuse_relu=True,
                               z=z)
