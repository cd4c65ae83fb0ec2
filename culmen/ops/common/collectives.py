"""Dim-0 collectives shared by every distributed part of culmen (``apex.parallel``, ``apex.transformer``,
the ZeRO optimizers, flash_attn's tensor-parallel modules, SyncBatchNorm).

* ``all_gather_single`` / ``reduce_scatter_single``: torch 2.13 renamed the flat tensor collectives
  (``all_gather_into_tensor`` / ``reduce_scatter_tensor`` still work there but warn); older torch (the GPU
  machine's 2.11) has only the old names. Same arguments either way.
* ``all_gather_raw`` / ``reduce_scatter_raw``: ``(output, handle)`` forms, optionally asynchronous; a
  group of one rank skips the collective and returns the input; gloo, which lacks reduce-scatter in some
  torch builds, runs it as an all-reduce plus a slice (also asynchronously).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = ["all_gather_raw", "all_gather_single", "reduce_scatter_raw", "reduce_scatter_single"]

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _world(pg: ProcessGroup | None) -> int:
    return dist.get_world_size(pg) if pg is not None else 1


class _SliceAfter:
    """The handle of an asynchronous gloo reduce-scatter: waits for the all-reduce, then copies this
    rank's slice into the output returned earlier."""

    def __init__(self, work, full: Tensor, out: Tensor, start: int) -> None:
        self._work, self._full, self._out, self._start = work, full, out, start

    def wait(self, timeout=None) -> bool:
        if self._work is not None:
            self._work.wait() if timeout is None else self._work.wait(timeout)
            self._out.copy_(self._full.narrow(0, self._start, self._out.shape[0]))
            self._work = self._full = None
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


def all_gather_raw(input_: Tensor, process_group: ProcessGroup | None, async_op: bool = False):
    """All-gather along dim 0, no autograd. ``input_`` ``(n, ...)`` on each of ``world`` ranks; returns
    ``(output (world * n, ...), handle)`` (``handle`` is ``None`` unless ``async_op``: then wait on it
    before reading ``output``)."""
    world = _world(process_group)
    if world == 1:
        return input_, None
    input_ = input_.contiguous()
    out = input_.new_empty((world * input_.shape[0], *input_.shape[1:]))
    handle = all_gather_single(out, input_, group=process_group, async_op=async_op)
    return out, handle


def reduce_scatter_raw(input_: Tensor, process_group: ProcessGroup | None, async_op: bool = False):
    """Reduce-scatter (sum) along dim 0, no autograd. ``input_`` ``(world * n, ...)``; returns
    ``(output (n, ...), handle)``: this rank's rows of the sum over ranks."""
    world = _world(process_group)
    if world == 1:
        return input_, None
    if input_.shape[0] % world:
        raise ValueError(f"reduce_scatter needs dim 0 ({input_.shape[0]}) divisible by the world size ({world})")
    input_ = input_.contiguous()
    n = input_.shape[0] // world
    if dist.get_backend(process_group) == "gloo":
        full = input_.clone()
        start = dist.get_rank(process_group) * n
        work = dist.all_reduce(full, group=process_group, async_op=async_op)
        if not async_op:
            return full.narrow(0, start, n).clone(), None
        out = input_.new_empty((n, *input_.shape[1:]))
        return out, _SliceAfter(work, full, out, start)
    out = input_.new_empty((n, *input_.shape[1:]))
    handle = reduce_scatter_single(out, input_, group=process_group, async_op=async_op)
    return out, handle
