"""NCCL-allocated memory pools: Apex's ``init``, ``create_nccl_mem_pool`` and ``nccl_mem``.

Apex compiles a ``CUDAPluggableAllocator`` around ``ncclMemAlloc`` / ``ncclMemFree``. PyTorch now ships
the same allocator: ``ProcessGroupNCCL``'s ``mem_allocator``. culmen builds the pool on it, so nothing
is compiled. Differences from Apex:

* the allocator comes from the default process group's NCCL backend, so ``torch.distributed`` must be
  initialized with NCCL before ``create_nccl_mem_pool`` (Apex's extension loads NCCL itself);
* ``symmetric=False`` is accepted on every torch (it is the plain pool); ``symmetric=True`` needs a
  ``torch.cuda.MemPool`` that takes ``symmetric`` (or NVIDIA's ``symm_mem``), else ``ValueError``, as in
  Apex (``torch.distributed._symmetric_memory.get_mem_pool`` is PyTorch's own symmetric pool);
* ``nccl_mem(pool=None)`` uses one default pool per device (Apex's earlier ``nccl_mem()`` form);
* no deprecation warning (Apex deprecates the package in favour of PyTorch's API, which this is).

Without CUDA, without an NCCL process group, or on a torch lacking ``MemPool`` / ``mem_allocator``,
``create_nccl_mem_pool`` raises ``RuntimeError`` saying what is missing; ``nccl_mem(enabled=False)`` is
a no-op everywhere, so code can keep the ``with`` and switch the feature off.
"""

from __future__ import annotations

import inspect
import os
from contextlib import nullcontext
from types import TracebackType
from typing import Any

import torch

__all__ = ["init", "nccl_mem", "create_nccl_mem_pool"]

_DEFAULT_POOLS: dict[int, Any] = {}


def init() -> None:
    """Set the environment NCCL needs for NVLS collectives on NCCL-allocated buffers.

    ``NCCL_NVLS_ENABLE=1`` and ``TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=0`` (the pool is registered
    explicitly by ``nccl_mem``). Call it before ``init_process_group``.
    """
    os.environ["NCCL_NVLS_ENABLE"] = "1"
    os.environ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] = "0"


def _nccl_backend(group: Any = None, device: torch.device | None = None) -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("the NCCL allocator comes from ProcessGroupNCCL: call "
                           "torch.distributed.init_process_group('nccl') first")
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    dev = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    try:
        return group._get_backend(dev)
    except RuntimeError as e:
        raise RuntimeError(f"the process group has no NCCL backend for {dev}: {e}") from e


def get_nccl_allocator() -> Any:
    """PyTorch's ``ncclMemAlloc``-based allocator (``ProcessGroupNCCL.mem_allocator``), for ``MemPool``."""
    if not torch.cuda.is_available():
        raise RuntimeError("the NCCL allocator needs CUDA; use nccl_mem(enabled=False) to run without it")
    backend = _nccl_backend()
    try:
        allocator = getattr(backend, "mem_allocator", None)
    except RuntimeError as e:  # e.g. gloo: "does not support getMemAllocator"
        raise RuntimeError(f"the default process group's CUDA backend is not NCCL ({e}): the NCCL allocator "
                           "needs init_process_group('nccl')") from e
    if allocator is None:
        raise RuntimeError("this torch's ProcessGroupNCCL has no mem_allocator (needs torch >= 2.7 with NCCL)")
    return allocator


def create_nccl_mem_pool(symmetric: bool | None = None) -> torch.cuda.MemPool:
    """A ``torch.cuda.MemPool`` whose memory comes from ``ncclMemAlloc``.

    Args:
        symmetric: ``True`` asks ``MemPool`` for a symmetric (window-registered) pool, which needs a torch
            whose ``MemPool`` takes ``symmetric`` / ``symm_mem``; ``None`` / ``False``: a plain pool.

    Raises:
        RuntimeError: no CUDA, no NCCL process group, or a torch without ``MemPool`` / ``mem_allocator``.
        ValueError: ``symmetric=True`` on a torch whose ``MemPool`` cannot do it.
    """
    if symmetric is not None and not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be a bool or None, got {type(symmetric).__name__} {symmetric!r}")
    if not hasattr(torch.cuda, "MemPool"):
        raise RuntimeError("this torch has no torch.cuda.MemPool (needs torch >= 2.5)")
    allocator = get_nccl_allocator()
    if not symmetric:
        return torch.cuda.MemPool(allocator)
    params = inspect.signature(torch.cuda.MemPool.__init__).parameters
    for name in ("symmetric", "symm_mem"):  # PyTorch's name, NVIDIA's PyTorch's name
        if name in params:
            return torch.cuda.MemPool(allocator, **{name: True})
    raise ValueError("symmetric=True needs a torch.cuda.MemPool that takes `symmetric` (a newer PyTorch); "
                     "torch.distributed._symmetric_memory.get_mem_pool gives PyTorch's symmetric pool")


def _default_pool(device: torch.device) -> Any:
    pool = _DEFAULT_POOLS.get(device.index)
    if pool is None:
        with torch.cuda.device(device):
            pool = _DEFAULT_POOLS[device.index] = create_nccl_mem_pool()
    return pool


class nccl_mem:  # noqa: N801 (Apex's name)
    """Context manager: CUDA allocations inside it come from ``pool`` (NCCL memory); on exit the pool's
    memory is registered with the group's NCCL communicator.

    Args:
        pool: a pool from ``create_nccl_mem_pool`` (``None``: a default NCCL pool for the device).
        enabled: ``False`` makes the context a no-op (ordinary ``cudaMalloc`` memory).
        device: the CUDA device (``None``: the current one; an int index, ``"cuda:N"`` or a torch.device).
        group: the process group whose NCCL communicator registers the pool (``None``: the default group).

    On entry the pool is deregistered from the communicator (registration is per segment; segments added
    inside the context are registered with the rest on exit). Registration failures are ignored, as in
    Apex: the memory still works for collectives, without NCCL's zero-copy path.
    """

    def __init__(self, pool: Any = None, enabled: bool = True, device: int | str | torch.device | None = None,
                 group: Any = None) -> None:
        self.device: torch.device | None = None
        self.group = None
        self.pool = pool
        if not enabled:
            self.mem_context = nullcontext()
            return
        if device is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        elif isinstance(device, int) and not isinstance(device, bool):
            self.device = torch.device("cuda", device)
        elif isinstance(device, (str, torch.device)):
            self.device = torch.device(device)
            if self.device.type != "cuda":
                raise ValueError(f"device must be a CUDA device, got {device!r}")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            raise TypeError(f"device must be None, an int, a str or a torch.device, got {type(device).__name__}")
        if pool is None:
            self.pool = _default_pool(self.device)
        elif not isinstance(pool, torch.cuda.MemPool):
            raise TypeError(f"pool must be a torch.cuda.MemPool (create_nccl_mem_pool()), got {type(pool).__name__}")
        if group is None:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError("nccl_mem needs torch.distributed initialized (its group registers the pool)")
            group = dist.distributed_c10d._get_default_group()
        self.group = group
        self.mem_context = torch.cuda.use_mem_pool(self.pool, self.device)

    def __enter__(self) -> nccl_mem:
        self.mem_context.__enter__()
        if self.group is not None:
            backend = self.group._get_backend(self.device)
            try:
                backend.deregister_mem_pool(self.pool)
            except (RuntimeError, AttributeError):  # not registered yet / a torch without registration
                pass
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if self.group is not None:
                backend = self.group._get_backend(self.device)
                try:
                    backend.register_mem_pool(self.pool)
                except (RuntimeError, AttributeError):
                    pass
        finally:
            self.mem_context.__exit__(exc_type, exc, tb)


def get_func_args(func: Any) -> list[str]:
    """Names of ``func``'s parameters, in order (Apex uses it to find ``torch.cuda.MemPool``'s keyword for
    symmetric memory, which differs between PyTorch builds)."""
    return list(inspect.signature(func).parameters)
