"""``apex.contrib.nccl_allocator``: allocate tensors with NCCL's allocator (``ncclMemAlloc``) so NCCL can
register them for its NVLS / zero-copy collectives. Built on ``torch.cuda.MemPool`` and the allocator
that ``ProcessGroupNCCL`` exposes; see ``culmen.contrib.nccl_allocator.nccl_allocator``."""

from culmen.contrib.nccl_allocator.nccl_allocator import create_nccl_mem_pool, init, nccl_mem

__all__ = ["create_nccl_mem_pool", "init", "nccl_mem"]
