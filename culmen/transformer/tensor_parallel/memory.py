"""Pre-allocated contiguous buffers (Megatron-legacy), ``apex.transformer.tensor_parallel.memory``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["MemoryBuffer", "RingMemBuffer", "allocate_mem_buff", "get_mem_buff"]

_MEM_BUFFS: dict[str, MemoryBuffer] = {}


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _is_rank_0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def allocate_mem_buff(name: str, numel: int, dtype: torch.dtype, track_usage: bool) -> MemoryBuffer:
    """Create and register the buffer ``name`` (``ValueError`` when that name exists)."""
    if name in _MEM_BUFFS:
        raise ValueError(f"memory buffer {name} already allocated")
    _MEM_BUFFS[name] = MemoryBuffer(name, numel, dtype, track_usage)
    return _MEM_BUFFS[name]


def get_mem_buff(name: str) -> MemoryBuffer:
    """The registered buffer ``name`` (``KeyError`` when there is none)."""
    return _MEM_BUFFS[name]


class MemoryBuffer:
    """One contiguous 1-D ``dtype`` tensor of ``numel`` elements (on the current CUDA device, or the CPU
    without CUDA) handed out front to back: ``add(t)`` copies ``t`` into the next free chunk and returns
    that chunk viewed as ``t.shape``; ``reset()`` frees everything at once. It avoids fragmenting the
    allocator with many short-lived activation copies.
    """

    def __init__(self, name: str, numel: int, dtype: torch.dtype, track_usage: bool) -> None:
        if not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        if _is_rank_0():
            size_mb = numel * torch.empty((), dtype=dtype).element_size() / 1024 / 1024
            print(f"> building the {name} memory buffer with {numel} num elements and {dtype} dtype "
                  f"({size_mb:.1f} MB)...", flush=True)
        self.name = name
        self.numel = numel
        self.dtype = dtype
        self.data = torch.empty(numel, dtype=dtype, device=_default_device(), requires_grad=False)
        self._start = 0
        self.track_usage = track_usage
        if track_usage:
            self.in_use_value = 0.0
            self.total_value = 0.0

    def reset(self) -> None:
        """Mark the whole buffer free."""
        self._start = 0

    def is_in_use(self) -> bool:
        """Whether any chunk is handed out."""
        return self._start > 0

    def numel_in_use(self) -> int:
        """Elements handed out since the last ``reset``."""
        return self._start

    def add(self, tensor: Tensor) -> Tensor:
        """Copy ``tensor`` (of the buffer's dtype) into the next free chunk; return the chunk as
        ``tensor.shape``. ``TypeError`` on another dtype, ``ValueError`` when it does not fit."""
        if tensor.dtype != self.dtype:
            raise TypeError(f"input tensor type {tensor.dtype} different from buffer type {self.dtype}")
        n = tensor.numel()
        new_start = self._start + n
        if new_start > self.numel:
            raise ValueError(f"not enough memory left in the buffer ({n} > {self.numel - self._start})")
        chunk = self.data[self._start:new_start].view(tensor.shape)
        self._start = new_start
        chunk.copy_(tensor)
        return chunk

    def get_data(self) -> Tensor:
        """The part of the buffer in use (a view); counts towards the usage statistics."""
        if self.track_usage:
            self.in_use_value += float(self._start)
            self.total_value += float(self.numel)
        return self.data[:self._start]

    def print_average_usage(self) -> None:
        """Print (rank 0) the average fraction of the buffer in use at ``get_data`` calls."""
        if not self.track_usage:
            raise ValueError("print_average_usage needs track_usage=True")
        if _is_rank_0():
            print(f" > usage of {self.name} memory buffer: "
                  f"{self.in_use_value * 100.0 / max(self.total_value, 1.0):.2f} %", flush=True)


class RingMemBuffer:
    """``num_buffers`` registered ``MemoryBuffer``s named ``"{name} {i}"``, handed out in turn."""

    def __init__(self, name: str, num_buffers: int, numel: int, dtype: torch.dtype, track_usage: bool) -> None:
        self.num_buffers = num_buffers
        self.buffers = [allocate_mem_buff(f"{name} {i}", numel, dtype, track_usage) for i in range(num_buffers)]
        self._index = -1

    def get_next_buffer(self) -> MemoryBuffer:
        """The next buffer of the ring (``RuntimeError`` if it is still in use)."""
        self._index = (self._index + 1) % self.num_buffers
        buff = self.buffers[self._index]
        if buff.is_in_use():
            raise RuntimeError("buffer is already in use")
        return buff
