"""flash_attn 2.8's ``flash_attn.utils.distributed`` on culmen: collectives along dim 0 for tensor and
sequence parallelism, raw (``(output, handle)``, optionally asynchronous) and differentiable, plus the
helpers that keep replicated parameters in sync.

* ``all_gather``: concatenation of every rank's input along dim 0; its gradient is a reduce-scatter.
* ``reduce_scatter``: the sum over ranks, of which each rank keeps its slice of dim 0; gradient: all-gather.
* ``all_reduce``: the sum over ranks; its gradient passes through unchanged (every rank holds the same
  gradient of a replicated output).

Differences from flash_attn, on purpose: gloo (which has no reduce-scatter) runs ``reduce_scatter_raw`` as
an all-reduce plus a slice, also asynchronously; a group of one rank skips the collective; the
differentiable ``all_reduce`` never modifies its input (flash_attn's reduces in place when the input is
contiguous; ``all_reduce_raw`` keeps that behaviour); ``allreduce_sequence_parallel_grad`` skips
parameters without a gradient instead of failing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from culmen.ops.common.collectives import all_gather_raw, reduce_scatter_raw

__all__ = [
    "AllGatherFunc",
    "AllReduceFunc",
    "ReduceScatterFunc",
    "all_gather",
    "all_gather_raw",
    "all_reduce",
    "all_reduce_raw",
    "allreduce_sequence_parallel_grad",
    "get_dim_for_local_rank",
    "reduce_scatter",
    "reduce_scatter_raw",
    "sync_shared_params",
]


def _world(pg: ProcessGroup | None) -> int:
    return dist.get_world_size(pg) if pg is not None else 1


def all_reduce_raw(input_: Tensor, process_group: ProcessGroup, async_op: bool = False):
    """All-reduce (sum), no autograd, as flash_attn: in place on ``input_.contiguous()`` (so on
    ``input_`` itself when it is contiguous); returns ``(that tensor, handle)``."""
    input_ = input_.contiguous()
    if _world(process_group) == 1:
        return input_, None
    handle = dist.all_reduce(input_, group=process_group, async_op=async_op)
    return input_, handle


def _all_reduce_copy(x: Tensor, pg: ProcessGroup) -> Tensor:
    """The sum over ranks in a new tensor (the input is left alone)."""
    if _world(pg) == 1:
        return x
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=pg)
    return x


class AllGatherFunc(torch.autograd.Function):
    """Differentiable all-gather along dim 0: ``apply(input_, process_group)``."""

    @staticmethod
    def forward(ctx, input_: Tensor, process_group: ProcessGroup) -> Tensor:
        ctx.process_group = process_group
        return all_gather_raw(input_, process_group)[0]

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        return reduce_scatter_raw(grad_output, ctx.process_group)[0], None


class ReduceScatterFunc(torch.autograd.Function):
    """Differentiable reduce-scatter (sum) along dim 0: ``apply(input_, process_group)``."""

    @staticmethod
    def forward(ctx, input_: Tensor, process_group: ProcessGroup) -> Tensor:
        ctx.process_group = process_group
        return reduce_scatter_raw(input_, process_group)[0]

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        return all_gather_raw(grad_output, ctx.process_group)[0], None


class AllReduceFunc(torch.autograd.Function):
    """Differentiable all-reduce (sum): ``apply(input_, process_group)``; the gradient passes through."""

    @staticmethod
    def forward(ctx, input_: Tensor, process_group: ProcessGroup) -> Tensor:
        return _all_reduce_copy(input_, process_group)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        return grad_output, None


def all_gather(input_: Tensor, process_group: ProcessGroup) -> Tensor:
    """Differentiable all-gather along dim 0: ``(n, ...)`` per rank -> ``(world * n, ...)``."""
    return AllGatherFunc.apply(input_, process_group)


def reduce_scatter(input_: Tensor, process_group: ProcessGroup) -> Tensor:
    """Differentiable reduce-scatter (sum) along dim 0: ``(world * n, ...)`` -> this rank's ``(n, ...)``."""
    return ReduceScatterFunc.apply(input_, process_group)


def all_reduce(input_: Tensor, process_group: ProcessGroup) -> Tensor:
    """Differentiable all-reduce (sum) into a new tensor; its gradient passes through."""
    return AllReduceFunc.apply(input_, process_group)


def _flagged(model: torch.nn.Module, flag: str) -> list[torch.nn.Parameter]:
    # Sorted by name: ranks may hold different parameter sets (only rank 0 has a row-parallel bias),
    # so the flagged ones must be visited in the same order everywhere.
    return [p for _, p in sorted((n, p) for n, p in model.named_parameters() if getattr(p, flag, False))]


def sync_shared_params(model: torch.nn.Module, process_group: ProcessGroup) -> None:
    """Broadcast every parameter marked ``_shared_params = True`` (e.g. by ``Block(mark_shared_params=
    True)``) from the group's rank 0 to the others, so replicated parameters start identical."""
    src = dist.get_global_rank(process_group, 0)
    with torch.no_grad():
        for p in _flagged(model, "_shared_params"):
            dist.broadcast(p.data, src=src, group=process_group)


def allreduce_sequence_parallel_grad(model: torch.nn.Module, process_group: ProcessGroup) -> None:
    """Sum over the group the gradients of parameters marked ``_sequence_parallel = True`` (norm weights
    under sequence parallelism: each rank saw only its slice of the sequence), in one coalesced
    all-reduce per call; parameters without a gradient are skipped."""
    grads = [p.grad for p in _flagged(model, "_sequence_parallel") if p.grad is not None]
    if not grads or _world(process_group) == 1:
        return
    with torch.no_grad():
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=process_group)
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)


def get_dim_for_local_rank(dim: int, world_size: int, local_rank: int, multiple_of: int = 1) -> int:
    """This rank's share of ``dim`` split over ``world_size`` ranks in units of ``multiple_of``: the
    ``dim // multiple_of`` units are dealt evenly and the first ``units % world_size`` ranks take one
    more. Returns a multiple of ``multiple_of``."""
    if multiple_of <= 0 or dim % multiple_of:
        raise ValueError(f"dim ({dim}) must be a multiple of multiple_of ({multiple_of})")
    if world_size <= 0 or not 0 <= local_rank < world_size:
        raise ValueError(f"local_rank ({local_rank}) must be in [0, world_size={world_size})")
    units = dim // multiple_of
    return (units // world_size + int(local_rank < units % world_size)) * multiple_of
