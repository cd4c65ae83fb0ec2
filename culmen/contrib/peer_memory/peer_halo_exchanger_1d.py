"""``PeerHaloExchanger1d``: Apex's in-place halo exchange between neighbouring ranks of a spatial split.

A spatially parallel convolution splits H (or W) of an activation over the ranks of a group; each rank's
slab carries ``half_halo`` extra rows on both sides. The exchange fills them in place: a rank's low input
halo receives the low neighbour's last ``half_halo`` inner rows, its high input halo the high
neighbour's first ``half_halo`` inner rows. The first rank's low halo and the last rank's high halo have
no neighbour and are zeroed (no wrap-around), as Apex's ``push_pull_halos_1d`` does.

Two transports, chosen once per exchanger:

* **peer memory** (``peer_pool.is_symmetric``: CUDA symmetric memory, or shared memory between CPU
  processes): each rank copies its two outgoing halos into its own block of the pool, a barrier
  (device-side on CUDA), then each rank copies its neighbours' halos straight out of their blocks, and a
  second barrier so nobody overwrites a buffer a peer is still reading;
* **send/recv** (``peer_pool`` is ``None`` or not symmetric): ``torch.distributed.batch_isend_irecv``
  with the neighbours (NCCL point-to-point on GPUs, gloo on CPU).

``numSM`` (the CTA count of Apex's CUDA kernel) and ``diagnostics`` are accepted for compatibility and
have no effect: the copies are ordinary PyTorch copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from culmen.contrib.peer_memory.peer_memory import PeerMemoryPool

__all__ = ["PeerHaloExchanger1d"]


class PeerHaloExchanger1d:
    """Exchange the halos of a tensor split along H or W over ``ranks``, in place.

    Args:
        ranks: the global ranks of the spatial group, in split order (``ranks[0]`` holds the top/left slab).
        rank_in_group: this rank's index in ``ranks``.
        peer_pool: a ``PeerMemoryPool`` whose ``peer_ranks`` equal ``ranks`` (peer-memory transport), or
            ``None`` (culmen extension: send/recv transport).
        half_halo: rows (or columns) of halo on each side of a slab, >= 1.
    """

    def __init__(self, ranks: Sequence[int], rank_in_group: int, peer_pool: PeerMemoryPool | None,
                 half_halo: int) -> None:
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or not ranks:
            raise ValueError(f"ranks must be a non-empty sequence of global ranks, got {ranks!r}")
        ranks = [int(r) for r in ranks]
        if isinstance(rank_in_group, bool) or not isinstance(rank_in_group, int) or \
                not 0 <= rank_in_group < len(ranks):
            raise ValueError(f"rank_in_group must be an index into ranks (0..{len(ranks) - 1}), got {rank_in_group!r}")
        if isinstance(half_halo, bool) or not isinstance(half_halo, int) or half_halo < 1:
            raise ValueError(f"half_halo must be an int >= 1, got {half_halo!r}")
        if peer_pool is not None:
            if not isinstance(peer_pool, PeerMemoryPool):
                raise TypeError(f"peer_pool must be a PeerMemoryPool or None, got {type(peer_pool).__name__}")
            if list(peer_pool.peer_ranks) != ranks:
                raise ValueError(f"peer_pool.peer_ranks {peer_pool.peer_ranks} must equal ranks {ranks}")
        if dist.is_initialized() and dist.get_rank() != ranks[rank_in_group]:
            raise ValueError(f"ranks[rank_in_group] = {ranks[rank_in_group]} is not this process's rank "
                             f"({dist.get_rank()})")
        self.ranks = ranks
        self.peer_group_size = len(ranks)
        self.peer_rank = rank_in_group
        self.low_neighbor = (rank_in_group - 1) % len(ranks)
        self.high_neighbor = (rank_in_group + 1) % len(ranks)
        self.low_zero = rank_in_group == 0
        self.high_zero = rank_in_group == len(ranks) - 1
        self.peer_pool = peer_pool
        self.half_halo = half_halo
        self._peer = peer_pool is not None and peer_pool.is_symmetric

    def _halos(self, y: Tensor, H_split: bool, explicit_nhwc: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(low_out, low_inp, high_out, high_inp) views of ``y``."""
        if y.dim() != 4:
            raise ValueError(f"y must be 4-d (N,C,H,W, or N,H,W,C with explicit_nhwc), got shape {tuple(y.shape)}")
        dim = (1 if explicit_nhwc else 2) if H_split else (2 if explicit_nhwc else 3)
        hh = self.half_halo
        full = y.shape[dim]
        inner = full - 2 * hh
        if inner < hh:
            raise ValueError(f"y has {full} rows along dim {dim}: needs at least 3 * half_halo = {3 * hh}")
        return (y.narrow(dim, hh, hh), y.narrow(dim, 0, hh), y.narrow(dim, inner, hh),
                y.narrow(dim, inner + hh, hh))

    def __call__(self, y: Tensor, H_split: bool = True, explicit_nhwc: bool = False, numSM: int = 0,
                 diagnostics: bool = False) -> None:
        """Fill ``y``'s halos in place from the neighbours.

        Args:
            y: ``(N, C, Hs, W)`` (contiguous or channels_last) for ``H_split``, ``(N, C, H, Ws)`` otherwise;
                with ``explicit_nhwc`` the dims are ``(N, Hs, W, C)`` / ``(N, H, Ws, C)``. ``Hs`` (``Ws``)
                counts both halos. Any dtype; every rank passes the same shape and dtype.
            H_split: split along H (else along W).
            explicit_nhwc: ``y``'s dims are ordered N, H, W, C.
            numSM, diagnostics: Apex's kernel tuning / debug switches; no effect.
        """
        if not isinstance(y, Tensor):
            raise TypeError(f"y must be a Tensor, got {type(y).__name__}")
        low_out, low_inp, high_out, high_inp = self._halos(y, bool(H_split), bool(explicit_nhwc))
        if self._peer:
            self._exchange_peer(low_out, low_inp, high_out, high_inp)
        else:
            self._exchange_p2p(low_out, low_inp, high_out, high_inp)

    def _exchange_peer(self, low_out: Tensor, low_inp: Tensor, high_out: Tensor, high_inp: Tensor) -> None:
        pool = self.peer_pool
        low_tx = pool.allocate_peer_tensors(list(low_out.shape), low_out.dtype, False, True)
        high_tx = pool.allocate_peer_tensors(list(high_out.shape), high_out.dtype, False, True)
        me = self.peer_rank
        low_tx[me].copy_(low_out)
        high_tx[me].copy_(high_out)
        pool.barrier()
        if self.low_zero:
            low_inp.zero_()
        else:
            low_inp.copy_(high_tx[self.low_neighbor])
        if self.high_zero:
            high_inp.zero_()
        else:
            high_inp.copy_(low_tx[self.high_neighbor])
        pool.barrier()

    def _exchange_p2p(self, low_out: Tensor, low_inp: Tensor, high_out: Tensor, high_inp: Tensor) -> None:
        ops, recvs = [], []
        for zero, neighbor, out, inp in ((self.low_zero, self.low_neighbor, low_out, low_inp),
                                         (self.high_zero, self.high_neighbor, high_out, high_inp)):
            if zero:
                continue
            peer = self.ranks[neighbor]
            buf = torch.empty(inp.shape, dtype=inp.dtype, device=inp.device)
            ops.append(dist.P2POp(dist.isend, out.contiguous(), peer))
            ops.append(dist.P2POp(dist.irecv, buf, peer))
            recvs.append((inp, buf))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for inp, buf in recvs:
            inp.copy_(buf)
        if self.low_zero:
            low_inp.zero_()
        if self.high_zero:
            high_inp.zero_()
