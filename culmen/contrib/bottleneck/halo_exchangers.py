"""Apex's halo exchangers (``apex.contrib.bottleneck.halo_exchangers``) on ``torch.distributed``.

A spatially parallel convolution splits the image along H across the ranks of a group; before a 3x3
convolution each rank needs one row (a halo) from each neighbour. ``left_right_halo_exchange(left_output_halo,
right_output_halo, left_input_halo=None, right_input_halo=None)`` sends this rank's first rows
(``left_output_halo``) to the left neighbour and its last rows (``right_output_halo``) to the right neighbour, and
receives the left neighbour's last rows (``left_input_halo``) and the right neighbour's first rows
(``right_input_halo``). The first rank's left input and the last rank's right input are zeros (the image
border). With ``left_input_halo`` / ``right_input_halo`` given, the results are written into them and ``None``
is returned; otherwise ``(left_input_halo, right_input_halo)`` is returned.

Differences from Apex: every exchanger runs on ``torch.distributed`` (gloo on CPU, NCCL on GPUs) on the current
stream: ``HaloExchangerSendRecv`` through ``batch_isend_irecv`` on the default group instead of a second NCCL
communicator, ``HaloExchangerPeer`` the same way (its ``peer_pool``, ``explicit_nhwc`` and ``numSM`` are kept
but not needed: NCCL already moves neighbour data over NVLink), ``HaloExchangerAllGather`` gathers halos of
any shape (Apex's needs explicit-NHWC halos). The ``stream1..3`` attributes exist (created on first use, CUDA
only) for code that reads them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from culmen.ops.common.collectives import all_gather_raw

__all__ = ["HaloExchanger", "HaloExchangerAllGather", "HaloExchangerNoComm", "HaloExchangerPeer",
           "HaloExchangerSendRecv", "HaloPadder", "halo_pad"]


class HaloExchanger:
    """Base of the exchangers: the neighbours of ``rank_in_group`` in ``ranks`` (global ranks of the spatial
    group, in image order). ``left_rank`` / ``right_rank`` are -1 at the borders, where ``left_zero`` /
    ``right_zero`` say the received halo is zeros."""

    def __init__(self, ranks: Sequence[int], rank_in_group: int) -> None:
        ranks = list(ranks) if isinstance(ranks, (list, tuple, range)) else ranks
        if not isinstance(ranks, list) or not ranks or not all(isinstance(r, int) and r >= 0 for r in ranks) \
                or len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks must be a non-empty sequence of distinct non-negative ints, got {ranks!r}")
        if not isinstance(rank_in_group, int) or not 0 <= rank_in_group < len(ranks):
            raise ValueError(f"rank_in_group must be in [0, {len(ranks)}), got {rank_in_group!r}")
        self.group_size = len(ranks)
        self.ranks = ranks
        self.rank_in_group = rank_in_group
        self.wrap_around_left_rank_in_group = (rank_in_group + self.group_size - 1) % self.group_size
        self.wrap_around_right_rank_in_group = (rank_in_group + 1) % self.group_size
        self.left_rank = ranks[rank_in_group - 1] if rank_in_group > 0 else -1
        self.left_zero = rank_in_group == 0
        self.right_rank = ranks[rank_in_group + 1] if rank_in_group < self.group_size - 1 else -1
        self.right_zero = rank_in_group == self.group_size - 1
        self._streams: list | None = None

    def _stream(self, i: int):
        if self._streams is None:
            self._streams = [torch.cuda.Stream() for _ in range(3)] if torch.cuda.is_available() else [None] * 3
        return self._streams[i]

    stream1 = property(lambda self: self._stream(0))
    stream2 = property(lambda self: self._stream(1))
    stream3 = property(lambda self: self._stream(2))

    def left_right_halo_exchange(self, left_output_halo: Tensor, right_output_halo: Tensor,
                                 left_input_halo: Tensor | None = None, right_input_halo: Tensor | None = None):
        raise NotImplementedError

    def _deliver(self, left_in: Tensor, right_in: Tensor, left_input_halo, right_input_halo, zero: bool = True):
        """Zero the border halos, then return them or copy them into the caller's tensors."""
        if zero and self.left_zero:
            left_in = torch.zeros_like(left_in)
        if zero and self.right_zero:
            right_in = torch.zeros_like(right_in)
        if left_input_halo is None and right_input_halo is None:
            return left_in, right_in
        if left_input_halo is None or right_input_halo is None:
            raise ValueError("left_input_halo and right_input_halo must be given together")
        left_input_halo.copy_(left_in)
        right_input_halo.copy_(right_in)
        return None


def _check_halos(left: Tensor, right: Tensor) -> None:
    if not isinstance(left, Tensor) or not isinstance(right, Tensor):
        raise TypeError("left_output_halo and right_output_halo must be tensors, got "
                        f"{type(left).__name__} and {type(right).__name__}")
    if left.shape != right.shape or left.dtype != right.dtype:
        raise ValueError(f"left_output_halo {tuple(left.shape)} {left.dtype} and right_output_halo "
                         f"{tuple(right.shape)} {right.dtype} must have the same shape and dtype")


class HaloExchangerNoComm(HaloExchanger):
    """No communication: the left input is this rank's own right output and vice versa (no zeros at the
    borders). Apex's stand-in for performance tests only; the results are not a real exchange."""

    def __init__(self, ranks: Sequence[int], rank_in_group: int) -> None:
        super().__init__(ranks, rank_in_group)

    def left_right_halo_exchange(self, left_output_halo, right_output_halo, left_input_halo=None,
                                 right_input_halo=None):
        return self._deliver(right_output_halo, left_output_halo, left_input_halo, right_input_halo, zero=False)


class HaloExchangerAllGather(HaloExchanger):
    """Exchange through one all-gather of every rank's two halos over ``comm`` (the process group of exactly
    ``ranks``, e.g. ``torch.distributed.new_group(ranks)``; ``None``: the default group, which must then be
    ``ranks``)."""

    def __init__(self, ranks: Sequence[int], rank_in_group: int, comm=None) -> None:
        super().__init__(ranks, rank_in_group)
        self.comm = comm

    def left_right_halo_exchange(self, left_output_halo, right_output_halo, left_input_halo=None,
                                 right_input_halo=None):
        _check_halos(left_output_halo, right_output_halo)
        send = torch.stack([left_output_halo, right_output_halo])
        got, _ = all_gather_raw(send, self.comm)
        got = got.view(self.group_size, 2, *left_output_halo.shape)
        left_in = got[self.wrap_around_left_rank_in_group, 1]
        right_in = got[self.wrap_around_right_rank_in_group, 0]
        return self._deliver(left_in, right_in, left_input_halo, right_input_halo)


class HaloExchangerSendRecv(HaloExchanger):
    """Exchange through point-to-point sends and receives with the two neighbours (``batch_isend_irecv`` on
    the default process group, global ranks ``ranks[...]``)."""

    def __init__(self, ranks: Sequence[int], rank_in_group: int) -> None:
        super().__init__(ranks, rank_in_group)
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != self.ranks[rank_in_group]:
            raise ValueError(f"ranks[{rank_in_group}] = {self.ranks[rank_in_group]} is not this process's rank "
                             f"{dist.get_rank()}")

    def left_right_halo_exchange(self, left_output_halo, right_output_halo, left_input_halo=None,
                                 right_input_halo=None):
        _check_halos(left_output_halo, right_output_halo)
        left_in = torch.empty(right_output_halo.shape, dtype=right_output_halo.dtype, device=right_output_halo.device)
        right_in = torch.empty(left_output_halo.shape, dtype=left_output_halo.dtype, device=left_output_halo.device)
        ops = []
        if self.left_rank >= 0:
            ops.append(dist.P2POp(dist.isend, left_output_halo.contiguous(), self.left_rank))
            ops.append(dist.P2POp(dist.irecv, left_in, self.left_rank))
        if self.right_rank >= 0:
            ops.append(dist.P2POp(dist.isend, right_output_halo.contiguous(), self.right_rank))
            ops.append(dist.P2POp(dist.irecv, right_in, self.right_rank))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return self._deliver(left_in, right_in, left_input_halo, right_input_halo)


class HaloExchangerPeer(HaloExchangerSendRecv):
    """Apex's peer-memory exchanger; here the point-to-point exchange of ``HaloExchangerSendRecv``.
    ``peer_pool`` (Apex's ``PeerMemoryPool``), ``explicit_nhwc`` and ``numSM`` are accepted and kept."""

    def __init__(self, ranks: Sequence[int], rank_in_group: int, peer_pool=None, explicit_nhwc: bool = False,
                 numSM: int = 1) -> None:
        super().__init__(ranks, rank_in_group)
        self.diagnostics = False
        self.peer_pool = peer_pool
        self.explicit_nhwc = bool(explicit_nhwc)
        self.numSM = numSM


class _HaloPad(torch.autograd.Function):
    """``y`` ``(N, C, H, W)`` -> ``(N, C, H + 2, W)`` with the neighbours' rows above and below; the backward sends
    the halo rows' gradients back to the neighbours that own them."""

    @staticmethod
    def forward(ctx, y, exchanger):
        left_in, right_in = exchanger.left_right_halo_exchange(y[:, :, :1], y[:, :, -1:])
        N, C, H, W = y.shape
        fmt = torch.channels_last if y.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
        out = torch.empty((N, C, H + 2, W), dtype=y.dtype, device=y.device, memory_format=fmt)
        out[:, :, 1:H + 1].copy_(y)
        out[:, :, :1].copy_(left_in)
        out[:, :, H + 1:].copy_(right_in)
        ctx.exchanger = exchanger
        return out

    @staticmethod
    def backward(ctx, g):
        H = g.shape[2] - 2
        from_left, from_right = ctx.exchanger.left_right_halo_exchange(g[:, :, :1], g[:, :, H + 1:])
        dy = g[:, :, 1:H + 1].clone()
        dy[:, :, :1] += from_left
        dy[:, :, H - 1:] += from_right
        return dy, None


def halo_pad(y: Tensor, exchanger: HaloExchanger) -> Tensor:
    """``y`` ``(N, C, H, W)`` (a rank's slice of an image split along H) padded with one row from each neighbour
    (zeros at the image borders): ``(N, C, H + 2, W)``, differentiable (the gradient of a halo row goes back to
    the rank that owns the row). Every rank of the exchanger's group must call it."""
    if not isinstance(y, Tensor) or y.dim() != 4 or y.shape[2] < 1:
        raise ValueError(f"halo_pad: y must be a 4-D (N, C, H, W) tensor with H >= 1, got "
                         f"{tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__}")
    return _HaloPad.apply(y, exchanger)


class HaloPadder:
    """Apex's ``HaloPadder(halo_ex)``: ``padder(y, half_halo, explicit_nhwc, H_split)`` returns ``y`` padded with
    ``half_halo`` rows (``H_split``) or columns from each neighbour; ``wait()`` is a no-op here (the exchange
    runs on the current stream). Not differentiable (as in Apex)."""

    def __init__(self, halo_ex: HaloExchanger) -> None:
        self.halo_ex = halo_ex

    def __call__(self, y: Tensor, half_halo: int, explicit_nhwc: bool, H_split: bool) -> Tensor:
        if not isinstance(half_halo, int) or half_halo < 1:
            raise ValueError(f"half_halo must be a positive int, got {half_halo!r}")
        dim = (1 if H_split else 2) if explicit_nhwc else (2 if H_split else 3)
        n = y.shape[dim]
        if half_halo > n:
            raise ValueError(f"half_halo={half_halo} is larger than the split dim ({n})")
        left_in, right_in = self.halo_ex.left_right_halo_exchange(y.narrow(dim, 0, half_halo),
                                                                  y.narrow(dim, n - half_halo, half_halo))
        return torch.cat([left_in.to(y.dtype), y, right_in.to(y.dtype)], dim=dim)

    def wait(self) -> None:
        return None
