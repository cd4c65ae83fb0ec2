"""``PeerMemoryPool``: Apex's pool of memory that every rank of a peer group can address directly.

Apex allocates one raw CUDA block per rank and opens the peers' blocks through CUDA IPC handles (its
``peer_memory_cuda`` extension). culmen builds the same pool on what PyTorch provides:

* **CUDA**: ``torch.distributed._symmetric_memory`` (``empty`` + ``rendezvous``); the peer views are
  ``handle.get_buffer(peer, ...)``, tensors that alias the peers' device memory (NVLink / PCIe P2P).
* **CPU** (gloo, ranks on one host): each rank's block is a file in ``/dev/shm`` mapped with
  ``torch.from_file(shared=True)`` by every peer, so a peer view really is the peer's memory.
  The files are unlinked once every peer has mapped them (the mappings stay valid, nothing is left behind).
* Otherwise (symmetric memory missing or failing, peers on other hosts): a local block only;
  ``is_symmetric`` is False and the peers' entries of ``allocate_peer_tensors`` are ``None``.
  ``PeerHaloExchanger1d`` then exchanges halos with point-to-point send/recv.

The pool's bookkeeping is Apex's: sizes rounded up to 256 bytes, a static region (never reset) followed by
a dynamic region (``reset()`` rewinds it, typically once per training step), every allocation aligned to
256 bytes. Every rank must make the same allocations in the same order (same shapes and dtypes), so an
offset means the same place in every peer's block.
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
import uuid
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["PeerMemoryPool"]

_ALIGNMENT = 256


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int number of bytes, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 bytes, got {value}")
    return value


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class PeerMemoryPool:
    """A block of memory per rank, with views of every peer's block, carved into aligned tensors.

    Args:
        static_size: bytes of the static region (allocations that live as long as the pool).
        dynamic_size: bytes of the dynamic region (allocations that ``reset()`` releases at once).
        peer_ranks: the global ranks sharing memory with this one, in the order of the lists that
            ``allocate_peer_tensors`` returns; must contain this rank, and every rank listed must pass the
            same set. Default: the ranks on this host (Apex: the ranks on this node).

    Construction is collective over the default process group (every rank constructs its pool, in the
    same order as its other pools), like Apex's, which all-gathers IPC handles.

    Attributes:
        peer_ranks: the peer group's global ranks; ``peer_rank``: this rank's index in it.
        is_symmetric: whether the peer entries of ``allocate_peer_tensors`` alias the peers' memory.
        mode: ``"symmetric_memory"`` (CUDA), ``"shared_memory"`` (CPU, one host) or ``"local"``.
        group: the process group of ``peer_ranks`` (``None`` for a group of one).
        device: where the blocks live (the current CUDA device with an NCCL default group, else CPU).
    """

    def __init__(self, static_size: int, dynamic_size: int, peer_ranks: Sequence[int] | None = None) -> None:
        static_size = _check_size("static_size", static_size)
        dynamic_size = _check_size("dynamic_size", dynamic_size)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("PeerMemoryPool needs torch.distributed initialized (init_process_group) first")
        rank, world = dist.get_rank(), dist.get_world_size()
        if peer_ranks is not None:
            if isinstance(peer_ranks, (str, bytes)) or not isinstance(peer_ranks, Sequence):
                raise TypeError(f"peer_ranks must be a sequence of ints, got {type(peer_ranks).__name__}")
            peer_ranks = list(peer_ranks)
            bad = [r for r in peer_ranks if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world]
            if bad or not peer_ranks:
                raise ValueError(f"peer_ranks must be ranks in [0, {world}), got {peer_ranks}")
            if len(set(peer_ranks)) != len(peer_ranks):
                raise ValueError(f"peer_ranks has repeated ranks: {peer_ranks}")
            if rank not in peer_ranks:
                raise ValueError(f"peer_ranks {peer_ranks} must contain this rank ({rank})")

        self.alignment = _ALIGNMENT
        self.static_size = _round_up(static_size, _ALIGNMENT)
        self.dynamic_size = _round_up(dynamic_size, _ALIGNMENT)
        self.static_offset = 0
        self.dynamic_offset = 0
        nbytes = max(self.static_size + self.dynamic_size, _ALIGNMENT)
        use_cuda = torch.cuda.is_available() and "nccl" in str(dist.get_backend()).lower()
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

        # A CPU rank creates its shared file before the exchange, so the peers can map it right after.
        path = None
        if not use_cuda:
            path = os.path.join(_shm_dir(), f"culmen_peer_{uuid.uuid4().hex}_{rank}")
            local = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        try:
            info = [None] * world
            dist.all_gather_object(info, (socket.gethostname(), None if peer_ranks is None else list(peer_ranks),
                                          path))
            host = info[rank][0]
            if peer_ranks is None:
                peer_ranks = [r for r in range(world) if info[r][0] == host]
            for r in range(world):  # a rank that took the default must see the resolved list too
                if info[r][1] is None:
                    info[r] = (info[r][0], [q for q in range(world) if info[q][0] == info[r][0]], info[r][2])
            mine = sorted(peer_ranks)
            # Every rank checks every rank's list, so all of them raise together (none waits in new_group).
            for r in range(world):
                for q in info[r][1]:
                    if sorted(info[q][1]) != sorted(info[r][1]):
                        raise ValueError(f"rank {r} has peer_ranks {info[r][1]} but rank {q} has {info[q][1]}: "
                                         "every rank of a peer group must pass the same ranks")
            self.peer_ranks = list(peer_ranks)
            self.peer_rank = self.peer_ranks.index(rank)
            # new_group is collective over the default group: every rank creates every group, in one order.
            groups = sorted({tuple(sorted(i[1])) for i in info if len(i[1]) > 1})
            self.group = None
            for g in groups:
                pg = dist.new_group(list(g))
                if list(g) == mine:
                    self.group = pg
            same_host = all(info[r][0] == host for r in peer_ranks)
            self._symm = None
            if use_cuda:
                self.raw, peers = self._cuda_blocks(nbytes)
            else:
                self.raw = local
                peers = None
                if same_host:
                    peers = [local if r == rank else torch.from_file(info[r][2], shared=True, size=nbytes,
                                                                      dtype=torch.uint8) for r in self.peer_ranks]
            dist.barrier()  # every peer has mapped every file
        finally:
            if path is not None:
                os.unlink(path)
        if peers is None:
            self.mode = "local"
            self.peer_raw: list[Tensor | None] = [self.raw if r == rank else None for r in self.peer_ranks]
        else:
            self.mode = "symmetric_memory" if use_cuda else "shared_memory"
            self.peer_raw = peers
        self.is_symmetric = peers is not None

    def _cuda_blocks(self, nbytes: int) -> tuple[Tensor, list[Tensor] | None]:
        """The local CUDA block and, where symmetric memory works, views of every peer's block."""
        if self.group is None:
            raw = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            return raw, [raw]
        try:
            import torch.distributed._symmetric_memory as symm_mem

            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.8, harmless after
                symm_mem.enable_symm_mem_for_group(self.group.group_name)
            raw = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
            handle = symm_mem.rendezvous(raw, self.group)
        except Exception:  # no symmetric memory in this build / on this system: point-to-point instead
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device), None
        self._symm = handle
        ranks = [dist.get_group_rank(self.group, r) for r in self.peer_ranks]
        return raw, [raw if r == handle.rank else handle.get_buffer(r, (nbytes,), torch.uint8, 0) for r in ranks]

    def barrier(self) -> None:
        """Wait until every peer reached this point (device-side on CUDA symmetric memory)."""
        if self._symm is not None:
            self._symm.barrier(channel=0)
        elif self.group is not None:
            dist.barrier(group=self.group)

    def reset(self) -> None:
        """Release every dynamic allocation at once (the static ones stay)."""
        self.dynamic_offset = 0

    def allocate_peer_tensors(self, shape: Sequence[int], dtype: torch.dtype, channels_last: bool,
                              dynamic: bool) -> list[Tensor | None]:
        """Carve a tensor of ``shape`` and ``dtype`` out of every peer's block at one offset.

        Args:
            shape: the tensor's (logical) shape; 4 dims when ``channels_last``.
            dtype: any torch dtype (Apex: float16, float32, int32).
            channels_last: lay the tensor out NHWC in memory (shape stays NCHW, as torch's channels_last).
            dynamic: take it from the dynamic region (released by ``reset()``) instead of the static one.

        Returns:
            one tensor per rank of ``peer_ranks`` (in that order); entry ``i`` lives in rank
            ``peer_ranks[i]``'s memory. The contents are whatever the memory held. On a ``"local"`` pool
            the entries of the other ranks are ``None``.

        Raises:
            RuntimeError: when the region has no room left (``reset()`` the dynamic region each step).
        """
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
        shape = [int(s) for s in shape]
        if any(s < 0 for s in shape):
            raise ValueError(f"shape must have sizes >= 0, got {shape}")
        if channels_last and len(shape) != 4:
            raise ValueError(f"channels_last needs a 4-d shape, got shape {shape}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        region, size, offset = ("dynamic", self.dynamic_size, self.dynamic_offset) if dynamic else \
            ("static", self.static_size, self.static_offset)
        start = _round_up(offset, _ALIGNMENT)
        if start + nbytes > size:
            raise RuntimeError(f"{region} peer memory pool exhausted: {nbytes} bytes requested at offset {start} "
                               f"of a {size}-byte region")
        if dynamic:
            self.dynamic_offset = start + nbytes
            start += self.static_size
        else:
            self.static_offset = start + nbytes
        return [None if raw is None else self._view(raw, start, nbytes, shape, dtype, channels_last)
                for raw in self.peer_raw]

    @staticmethod
    def _view(raw: Tensor, start: int, nbytes: int, shape: list[int], dtype: torch.dtype,
              channels_last: bool) -> Tensor:
        flat = raw[start:start + nbytes].view(dtype)
        if channels_last:
            n, c, h, w = shape
            return flat.view(n, h, w, c).permute(0, 3, 1, 2)
        return flat.view(shape)
