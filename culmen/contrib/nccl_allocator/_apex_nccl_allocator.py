"""Apex's compiled extension ``_apex_nccl_allocator``: ``get_nccl_allocator()`` is PyTorch's NCCL allocator."""

from culmen.contrib.nccl_allocator.nccl_allocator import get_nccl_allocator

__all__ = ["get_nccl_allocator"]
