"""Autograd-aware collectives between the replicated, tensor-parallel and sequence-parallel regions.

Each mapping is an autograd function whose backward is the conjugate collective of its forward
(Megatron / Apex semantics):

=============================================  =======================  ===========================
function                                       forward                  backward
=============================================  =======================  ===========================
``copy_to_tensor_model_parallel_region``       identity                 all-reduce
``reduce_from_tensor_model_parallel_region``   all-reduce (in place)    identity
``scatter_to_tensor_model_parallel_region``    keep own last-dim chunk  all-gather last dim
``gather_from_tensor_model_parallel_region``   all-gather last dim      keep own last-dim chunk
``scatter_to_sequence_parallel_region``        keep own first-dim chunk all-gather first dim
``gather_from_sequence_parallel_region``       all-gather first dim     reduce-scatter first dim
                                                                        (or keep own chunk when
                                                                        ``to_model_parallel=False``)
``reduce_scatter_to_sequence_parallel_region`` reduce-scatter first dim all-gather first dim
=============================================  =======================  ===========================

All run over ``parallel_state.get_tensor_model_parallel_group()`` and are the identity when its size
is 1. Chunk ``r`` goes to tensor-parallel rank ``r``. As in Apex, ``reduce_from_...`` all-reduces its
input in place and returns it (no copy): pass a tensor nothing else needs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from culmen.ops.common.collectives import all_gather_raw, reduce_scatter_raw
from culmen.transformer import parallel_state
from culmen.transformer.tensor_parallel.utils import divide

__all__ = [
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
]

_world = parallel_state.get_tensor_model_parallel_world_size
_group = parallel_state.get_tensor_model_parallel_group


def _reduce(input_: Tensor) -> Tensor:
    """Sum-all-reduce ``input_`` in place over the tensor-parallel group; return it."""
    if _world() == 1:
        return input_
    dist.all_reduce(input_, group=_group())
    return input_


def _split_along_last_dim(input_: Tensor) -> Tensor:
    """This rank's contiguous chunk of the last dimension."""
    world = _world()
    if world == 1:
        return input_
    n = divide(input_.shape[-1], world)
    rank = parallel_state.get_tensor_model_parallel_rank()
    return input_[..., rank * n:(rank + 1) * n].contiguous()


def _split_along_first_dim(input_: Tensor) -> Tensor:
    """This rank's chunk of the first dimension (contiguous: a slice of rows of a contiguous tensor)."""
    world = _world()
    if world == 1:
        return input_
    n = divide(input_.shape[0], world)
    rank = parallel_state.get_tensor_model_parallel_rank()
    return input_[rank * n:(rank + 1) * n].contiguous()


def _gather_along_last_dim(input_: Tensor) -> Tensor:
    """Concatenate every rank's ``input_`` along the last dimension (rank order)."""
    world = _world()
    if world == 1:
        return input_
    group = _group()
    # One flat all-gather (rank-major), then one copy that interleaves the chunks into the last dim.
    stacked, _ = all_gather_raw(input_.unsqueeze(0), group)
    return torch.cat(stacked.unbind(0), dim=-1)


def _gather_along_first_dim(input_: Tensor) -> Tensor:
    world = _world()
    if world == 1:
        return input_
    return all_gather_raw(input_, _group())[0]


def _reduce_scatter_along_first_dim(input_: Tensor) -> Tensor:
    world = _world()
    if world == 1:
        return input_
    return reduce_scatter_raw(input_, _group())[0]


class _CopyToModelParallelRegion(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient."""

    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        # A copy: autograd may hand the same gradient tensor to another branch (an add's two inputs),
        # which an in-place all-reduce would corrupt.
        if _world() == 1:
            return grad_output
        grad = grad_output.clone()
        dist.all_reduce(grad, group=_group())
        return grad


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """All-reduce forward; identity backward."""

    @staticmethod
    def forward(ctx, input_):
        return _reduce(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _split_along_last_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output)


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _gather_along_last_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_last_dim(grad_output)


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _split_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, to_model_parallel=True):
        ctx.to_model_parallel = to_model_parallel
        return _gather_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.to_model_parallel:
            return _reduce_scatter_along_first_dim(grad_output), None
        return _split_along_first_dim(grad_output), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _reduce_scatter_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output)


def copy_to_tensor_model_parallel_region(input_: Tensor) -> Tensor:
    """Enter the tensor-parallel region: ``input_`` unchanged; its gradient is summed over the TP ranks."""
    return _CopyToModelParallelRegion.apply(input_)


def reduce_from_tensor_model_parallel_region(input_: Tensor) -> Tensor:
    """Leave the tensor-parallel region: the sum of ``input_`` over the TP ranks (computed in place in
    ``input_``, which is returned); the gradient passes unchanged."""
    return _ReduceFromModelParallelRegion.apply(input_)


def scatter_to_tensor_model_parallel_region(input_: Tensor) -> Tensor:
    """``(..., n)`` -> this rank's ``(..., n / tp)`` chunk (``n`` must divide); backward all-gathers."""
    return _ScatterToModelParallelRegion.apply(input_)


def gather_from_tensor_model_parallel_region(input_: Tensor) -> Tensor:
    """``(..., m)`` -> ``(..., tp * m)``, the ranks' tensors in rank order; backward keeps this rank's chunk."""
    return _GatherFromModelParallelRegion.apply(input_)


def scatter_to_sequence_parallel_region(input_: Tensor) -> Tensor:
    """``(s, ...)`` -> this rank's ``(s / tp, ...)`` rows (``s`` must divide); backward all-gathers them."""
    return _ScatterToSequenceParallelRegion.apply(input_)


def gather_from_sequence_parallel_region(input_: Tensor, to_model_parallel: bool = True) -> Tensor:
    """``(s / tp, ...)`` -> ``(s, ...)``. Backward: reduce-scatter of the gradient when the result feeds
    the tensor-parallel region (``to_model_parallel=True``, each rank holds a partial gradient), else
    just this rank's rows of it."""
    return _GatherFromSequenceParallelRegion.apply(input_, to_model_parallel)


def reduce_scatter_to_sequence_parallel_region(input_: Tensor) -> Tensor:
    """``(s, ...)`` partial sums -> this rank's ``(s / tp, ...)`` rows of their total; backward all-gathers."""
    return _ReduceScatterToSequenceParallelRegion.apply(input_)
