"""TMA plumbing shared by the attention kernels that build tensor descriptors on the device: which GPUs
have TMA, whether the bulk reduce-add is there, and Triton's scratch allocator the descriptors live in."""

from __future__ import annotations

import torch
from torch import Tensor


def _torch_scratch(size: int, alignment: int, stream) -> Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _cpu_scratch(size: int, alignment: int, stream) -> Tensor:
    return torch.empty(size, dtype=torch.int8, device="cpu")


def nvidia_hopper(device: torch.device) -> bool:
    """A CUDA (not ROCm) GPU of compute capability 9 or later: TMA descriptors."""
    return torch.cuda.get_device_capability(device)[0] >= 9 and not getattr(torch.version, "hip", None)


def tma_reduce_available(device: torch.device) -> bool:
    """Whether tensor descriptors' ``atomic_add`` (TMA bulk reduce-add) runs on ``device``: a Hopper-class
    NVIDIA GPU (older ones would lower it to element atomics anyway), or, on CPU, an interpreter that
    implements it (Triton 3.9's does not: the plan then keeps the element atomics)."""
    if device.type == "cuda":
        return nvidia_hopper(device)
    try:
        from triton.runtime.interpreter import InterpreterBuilder
    except ImportError:
        return False
    return hasattr(InterpreterBuilder, "create_descriptor_reduce")


def ensure_allocator(device: torch.device) -> None:
    """Device-side descriptors need Triton's scratch allocator. Triton keeps it per thread context (and
    autograd runs backward in its own thread), so this is checked at every TMA launch; an allocator the
    caller installed is left alone."""
    try:
        import triton
        from triton.runtime import _allocation
    except ImportError:  # a Triton without the module cannot build descriptors anyway
        return
    current = _allocation._allocator
    current = current.get() if hasattr(current, "get") else current
    if isinstance(current, _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch if device.type == "cuda" else _cpu_scratch)
