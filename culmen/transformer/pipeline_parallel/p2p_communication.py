"""Point-to-point exchange of activations and their gradients between pipeline stages.

Apex's ``apex.transformer.pipeline_parallel.p2p_communication``, on ``torch.distributed``
``isend``/``irecv`` (``batch_isend_irecv`` when ``batch_p2p_comm``, the default). Every function
returns ``None`` for what the stage does not receive (``recv_forward`` on the first stage,
``recv_backward`` on the last ...). Received tensors are fresh leaves with ``requires_grad=True``
of ``tensor_shape`` and ``dtype`` (float32 when ``dtype`` is ``None``, as Apex).

- ``async_comm=True``: received tensors come back as ``FutureTensor``; ``.get()`` waits.
- ``overlap_p2p_comm=True`` (the ``*_recv_forward``/``*_recv_backward`` pairs used by the
  interleaved schedule): the functions also return the list of outstanding requests; wait on them
  before reading the received tensors.

Tensors live where the pipeline group's backend communicates: host memory for gloo, the current
CUDA device otherwise (nccl, ucc). A tensor to send is moved there if it is elsewhere.

Message matching: when a stage's previous and next stage are the same rank (2 stages, interleaved
schedule), an activation and a gradient can travel between the same two ranks in one exchange.
Activations (``send_next`` -> ``recv_prev``) and gradients (``send_prev`` -> ``recv_next``) carry
different tags, and every rank posts its operations in the order send-next, recv-prev, send-prev,
recv-next, so a backend that ignores tags (NCCL matches in posting order) pairs them right as well.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import reduce
from operator import mul
from typing import Any

import torch
import torch.distributed as dist

from culmen.transformer import parallel_state
from culmen.transformer.pipeline_parallel._timers import _Timers
from culmen.transformer.pipeline_parallel.utils import Shape

__all__ = [
    "FutureTensor",
    "recv_backward",
    "recv_forward",
    "send_backward",
    "send_backward_recv_backward",
    "send_backward_recv_forward",
    "send_forward",
    "send_forward_backward_recv_forward_backward",
    "send_forward_recv_backward",
    "send_forward_recv_forward",
]

# Tags of the two directions of travel (see the module docstring).
_TAG_ACTIVATION = 11
_TAG_GRADIENT = 12


class FutureTensor:
    """A tensor whose receive may still be in flight; ``get()`` waits for it once and returns it."""

    def __init__(self, tensor: torch.Tensor, waitfunc: Callable[[], Any] | None):
        self.tensor = tensor
        self.waitfunc = waitfunc

    def get(self) -> torch.Tensor:
        """Wait for the transfer (first call only) and return the received tensor."""
        if self.waitfunc is not None:
            res = self.waitfunc()
            if isinstance(res, torch.Tensor):
                self.tensor = res
            self.waitfunc = None
        return self.tensor


# Per process group: the device its tensors live on.
_GROUP_DEVICE: dict[Any, torch.device] = {}
# Requests of asynchronous sends nobody waits on: kept alive until they complete, since a backend
# may cancel (or free the buffer of) a transfer whose request object is destroyed.
_PENDING_SENDS: list = []


def _comm_device(group) -> torch.device:
    dev = _GROUP_DEVICE.get(group)
    if dev is None:
        if dist.get_backend(group) == "gloo" or not torch.cuda.is_available():
            dev = torch.device("cpu")
        else:
            dev = torch.device("cuda", torch.cuda.current_device())
        if len(_GROUP_DEVICE) > 64:  # groups re-created many times (tests): drop the stale ones
            _GROUP_DEVICE.clear()
        _GROUP_DEVICE[group] = dev
    return dev


def _outgoing(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # A detached alias keeps the storage alive even if the schedule later swaps the output's `.data`
    # (deallocate_pipeline_outputs) while an asynchronous send is still reading it.
    t = t.detach()
    if t.device != device:
        t = t.to(device)
    return t.contiguous()


def _run_p2pops(
    tensor_send_prev: torch.Tensor | None,
    tensor_send_next: torch.Tensor | None,
    tensor_recv_prev: torch.Tensor | None,
    tensor_recv_next: torch.Tensor | None,
    async_comm: bool = False,
    overlap_p2p_comm: bool = False,
    batch_p2p_comm: bool = True,
):
    """Post the sends/receives; wait for them unless ``async_comm`` or ``overlap_p2p_comm``.

    Returns ``(send_prev_req, recv_prev_req, send_next_req, recv_next_req, wait_handles)``: the
    per-operation requests with ``async_comm``, the list of all requests with ``overlap_p2p_comm``,
    ``None`` otherwise.
    """
    group = parallel_state.get_pipeline_model_parallel_group()
    cuda = tensor_send_prev is not None and tensor_send_prev.is_cuda or \
        tensor_send_next is not None and tensor_send_next.is_cuda or \
        tensor_recv_prev is not None and tensor_recv_prev.is_cuda or \
        tensor_recv_next is not None and tensor_recv_next.is_cuda
    # (tensor, peer is next?, is send?, tag), in the fixed posting order.
    plan = []
    if tensor_send_next is not None:
        plan.append((tensor_send_next, True, True, _TAG_ACTIVATION))
    if tensor_recv_prev is not None:
        plan.append((tensor_recv_prev, False, False, _TAG_ACTIVATION))
    if tensor_send_prev is not None:
        plan.append((tensor_send_prev, False, True, _TAG_GRADIENT))
    if tensor_recv_next is not None:
        plan.append((tensor_recv_next, True, False, _TAG_GRADIENT))
    if not plan:
        return None, None, None, None, None

    if cuda and group is not None:
        default_group = parallel_state.get_model_parallel_group()
        if dist.get_backend(group) != dist.get_backend(default_group):
            # Another backend's stream does not order itself after the compute stream.
            torch.cuda.synchronize()

    next_rank = parallel_state.get_pipeline_model_parallel_next_rank()
    prev_rank = parallel_state.get_pipeline_model_parallel_prev_rank()
    if batch_p2p_comm:
        ops = [dist.P2POp(dist.isend if send else dist.irecv, t, next_rank if to_next else prev_rank,
                          group, tag) for t, to_next, send, tag in plan]
        reqs = list(dist.batch_isend_irecv(ops))
    else:
        # Unbatched NCCL sends block until the peer posts the matching receive, and a rank's operations
        # run in posting order: odd pipeline ranks post receive-first so neighbours never both wait on a
        # send (with two stages prev == next, and an identical order on both ranks deadlocks).
        if parallel_state.get_pipeline_model_parallel_rank() % 2 == 1:
            # send_next, recv_prev, send_prev, recv_next -> recv_prev, send_next, recv_next, send_prev
            plan = sorted(plan, key=lambda op: (op[3], op[2]))
        reqs = []
        for t, to_next, send, tag in plan:
            peer = next_rank if to_next else prev_rank
            if send:
                reqs.append(dist.isend(t, dst=peer, group=group, tag=tag))
            else:
                reqs.append(dist.irecv(t, src=peer, group=group, tag=tag))

    if overlap_p2p_comm:
        return None, None, None, None, reqs
    if async_comm:
        by_key: dict[tuple[bool, bool], Any] = {}
        if len(reqs) == len(plan):
            for (_, to_next, send, _), req in zip(plan, reqs):
                by_key[(to_next, send)] = req
        elif len(reqs) == 1:
            # A coalesced batch (NCCL) completes as one request.
            for _, to_next, send, _ in plan:
                by_key[(to_next, send)] = reqs[0]
        else:
            raise RuntimeError(f"batch_isend_irecv returned {len(reqs)} requests for {len(plan)} operations")
        return (by_key.get((False, True)), by_key.get((False, False)),
                by_key.get((True, True)), by_key.get((True, False)), None)
    for req in reqs:
        req.wait()
    return None, None, None, None, None


def _communicate(
    tensor_send_next: torch.Tensor | None,
    tensor_send_prev: torch.Tensor | None,
    recv_prev: bool,
    recv_next: bool,
    tensor_shape: Shape | None = None,
    override_scatter_gather_tensors_in_pipeline: bool = False,
    dtype_: torch.dtype | None = None,
    *,
    scatter_gather_tensors_in_pipeline: bool = True,
    params_dtype: torch.dtype | None = None,
    fp32_residual_connection: bool = False,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    sync_batch_comm: bool = True,
    overlap_p2p_comm: bool = False,
    batch_p2p_comm: bool = True,
) -> tuple[Any, Any, list | None]:
    """Exchange tensors with the previous and/or next pipeline stage.

    Args:
        tensor_send_next: activation to send to the next stage, or ``None``.
        tensor_send_prev: gradient to send to the previous stage, or ``None``.
        recv_prev: receive an activation from the previous stage.
        recv_next: receive a gradient from the next stage.
        tensor_shape: shape of the received tensors, usually ``(seq_length, micro_batch_size,
            hidden_size)``; required.
        override_scatter_gather_tensors_in_pipeline, scatter_gather_tensors_in_pipeline: accepted
            for Apex compatibility; Apex forces the scatter-gather optimization off and so does culmen.
        dtype_: dtype of the received tensors; else ``params_dtype`` or float32
            (float32 whenever ``fp32_residual_connection``).
        async_comm: return ``FutureTensor``s instead of waiting.
        sequence_parallel_enabled: accepted for Apex compatibility (the caller divides the shape).
        sync_batch_comm: on CUDA, synchronize the device after a waited exchange.
        overlap_p2p_comm: return the outstanding requests instead of waiting.
        batch_p2p_comm: post the operations through ``torch.distributed.batch_isend_irecv``.

    Returns:
        ``(tensor_recv_prev, tensor_recv_next, wait_handles)``; the tensors are ``None`` when not
        received, ``FutureTensor`` with ``async_comm``; ``wait_handles`` is the request list with
        ``overlap_p2p_comm``, else ``None``.
    """
    if async_comm and sequence_parallel_enabled:
        warnings.warn("The combination of `async_comm` and `sequence_parallel_enabled` is not well tested.",
                      UserWarning, stacklevel=3)
    if tensor_shape is None:
        raise RuntimeError(
            "`tensor_shape` must be specified. Common `tensor_shape` is `(seq_length, micro_batch_size, hidden_size)`")
    tensor_shape = tuple(int(s) for s in tensor_shape)

    dtype = params_dtype or torch.float
    if fp32_residual_connection:
        dtype = torch.float
    if dtype_ is not None:
        dtype = dtype_

    group = parallel_state.get_pipeline_model_parallel_group()
    device = _comm_device(group)
    tensor_recv_prev = torch.empty(tensor_shape, requires_grad=True, device=device, dtype=dtype) if recv_prev else None
    tensor_recv_next = torch.empty(tensor_shape, requires_grad=True, device=device, dtype=dtype) if recv_next else None
    for name, t in (("tensor_send_next", tensor_send_next), ("tensor_send_prev", tensor_send_prev)):
        if t is not None and t.numel() != reduce(mul, tensor_shape, 1):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, which does not match tensor_shape={tensor_shape}")
    send_next = None if tensor_send_next is None else _outgoing(tensor_send_next, device)
    send_prev = None if tensor_send_prev is None else _outgoing(tensor_send_prev, device)

    # The receive buffers are leaves that require grad; the transport writes into their storage.
    recv_prev_buf = None if tensor_recv_prev is None else tensor_recv_prev.detach()
    recv_next_buf = None if tensor_recv_next is None else tensor_recv_next.detach()
    send_prev_req, recv_prev_req, send_next_req, recv_next_req, wait_handles = _run_p2pops(
        send_prev, send_next, recv_prev_buf, recv_next_buf, async_comm, overlap_p2p_comm, batch_p2p_comm)

    if async_comm and not overlap_p2p_comm:
        cuda = device.type == "cuda"

        def waiter(req):
            def wait():
                req.wait()
                if cuda:
                    torch.cuda.synchronize()
            return wait

        fut_prev = None if tensor_recv_prev is None else FutureTensor(
            tensor_recv_prev, None if recv_prev_req is None else waiter(recv_prev_req))
        fut_next = None if tensor_recv_next is None else FutureTensor(
            tensor_recv_next, None if recv_next_req is None else waiter(recv_next_req))
        if _PENDING_SENDS:
            _PENDING_SENDS[:] = [r for r in _PENDING_SENDS if not r.is_completed()]
        for req in (send_prev_req, send_next_req):
            if req is not None and req is not recv_prev_req and req is not recv_next_req:
                _PENDING_SENDS.append(req)
        return fut_prev, fut_next, None
    if sync_batch_comm and not overlap_p2p_comm and device.type == "cuda":
        torch.cuda.synchronize()
    return tensor_recv_prev, tensor_recv_next, wait_handles


def recv_forward(
    tensor_shape: Shape,
    override_scatter_gather_tensors_in_pipeline: bool = False,
    *,
    dtype: torch.dtype | None = None,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    sync_batch_comm: bool = True,
    batch_p2p_comm: bool = True,
    timers: _Timers | None = None,
) -> torch.Tensor | FutureTensor | None:
    """Receive the activation from the previous stage (``None`` on the first stage)."""
    if parallel_state.is_pipeline_first_stage():
        return None
    input_tensor, _, _ = _communicate(
        None, None, True, False, tensor_shape, override_scatter_gather_tensors_in_pipeline, dtype,
        async_comm=async_comm, sequence_parallel_enabled=sequence_parallel_enabled,
        sync_batch_comm=sync_batch_comm, batch_p2p_comm=batch_p2p_comm)
    return input_tensor


def recv_backward(
    tensor_shape: Shape = None,
    *,
    dtype: torch.dtype | None = None,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    sync_batch_comm: bool = True,
    batch_p2p_comm: bool = True,
    timers: _Timers | None = None,
) -> torch.Tensor | FutureTensor | None:
    """Receive the output gradient from the next stage (``None`` on the last stage)."""
    if parallel_state.is_pipeline_last_stage():
        return None
    _, output_tensor_grad, _ = _communicate(
        None, None, False, True, tensor_shape, dtype_=dtype,
        async_comm=async_comm, sequence_parallel_enabled=sequence_parallel_enabled,
        sync_batch_comm=sync_batch_comm, batch_p2p_comm=batch_p2p_comm)
    return output_tensor_grad


def send_forward(
    output_tensor: torch.Tensor,
    override_scatter_gather_tensors_in_pipeline: bool = False,
    tensor_shape: Shape = None,
    *,
    dtype: torch.dtype | None = None,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    sync_batch_comm: bool = True,
    batch_p2p_comm: bool = True,
    timers: _Timers | None = None,
) -> None:
    """Send the activation to the next stage (nothing on the last stage)."""
    if parallel_state.is_pipeline_last_stage():
        return
    _communicate(
        output_tensor, None, False, False, tensor_shape, override_scatter_gather_tensors_in_pipeline, dtype,
        async_comm=async_comm, sequence_parallel_enabled=sequence_parallel_enabled,
        sync_batch_comm=sync_batch_comm, batch_p2p_comm=batch_p2p_comm)


def send_backward(
    input_tensor_grad: torch.Tensor,
    tensor_shape: Shape,
    *,
    dtype: torch.dtype | None = None,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    sync_batch_comm: bool = True,
    batch_p2p_comm: bool = True,
    timers: _Timers | None = None,
) -> None:
    """Send the input gradient to the previous stage (nothing on the first stage)."""
    if parallel_state.is_pipeline_first_stage():
        return
    _communicate(
        None, input_tensor_grad, False, False, tensor_shape, dtype_=dtype,
        async_comm=async_comm, sequence_parallel_enabled=sequence_parallel_enabled,
        sync_batch_comm=sync_batch_comm, batch_p2p_comm=batch_p2p_comm)


def send_forward_recv_backward(
    output_tensor: torch.Tensor,
    tensor_shape: Shape,
    *,
    dtype: torch.dtype | None = None,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    sync_batch_comm: bool = True,
    batch_p2p_comm: bool = True,
    timers: _Timers | None = None,
) -> torch.Tensor | FutureTensor | None:
    """Send the activation to the next stage and receive its output gradient (``None`` on the last stage)."""
    if parallel_state.is_pipeline_last_stage():
        return None
    _, output_tensor_grad, _ = _communicate(
        output_tensor, None, False, True, tensor_shape, dtype_=dtype,
        async_comm=async_comm, sequence_parallel_enabled=sequence_parallel_enabled,
        sync_batch_comm=sync_batch_comm, batch_p2p_comm=batch_p2p_comm)
    return output_tensor_grad


def send_backward_recv_forward(
    input_tensor_grad: torch.Tensor,
    tensor_shape: Shape,
    *,
    dtype: torch.dtype | None = None,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    sync_batch_comm: bool = True,
    batch_p2p_comm: bool = True,
    timers: _Timers | None = None,
) -> torch.Tensor | FutureTensor | None:
    """Send the input gradient to the previous stage and receive its next activation (``None`` on the first stage)."""
    if parallel_state.is_pipeline_first_stage():
        return None
    input_tensor, _, _ = _communicate(
        None, input_tensor_grad, True, False, tensor_shape, dtype_=dtype,
        async_comm=async_comm, sequence_parallel_enabled=sequence_parallel_enabled,
        sync_batch_comm=sync_batch_comm, batch_p2p_comm=batch_p2p_comm)
    return input_tensor


def send_forward_recv_forward(
    output_tensor: torch.Tensor | None,
    recv_prev: bool,
    tensor_shape: Shape,
    *,
    dtype: torch.dtype | None = None,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    sync_batch_comm: bool = True,
    overlap_p2p_comm: bool = False,
    batch_p2p_comm: bool = True,
    timers: _Timers | None = None,
) -> Any:
    """Send ``output_tensor`` (if any) to the next stage; receive from the previous one if ``recv_prev``.

    Returns the received activation (or ``None``), plus the request list with ``overlap_p2p_comm``.
    """
    input_tensor, _, wait_handles = _communicate(
        output_tensor, None, recv_prev, False, tensor_shape, dtype_=dtype,
        async_comm=async_comm, sequence_parallel_enabled=sequence_parallel_enabled,
        sync_batch_comm=sync_batch_comm, overlap_p2p_comm=overlap_p2p_comm, batch_p2p_comm=batch_p2p_comm)
    if overlap_p2p_comm:
        return input_tensor, wait_handles
    return input_tensor


def send_backward_recv_backward(
    input_tensor_grad: torch.Tensor | None,
    recv_next: bool,
    tensor_shape: Shape,
    *,
    dtype: torch.dtype | None = None,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    sync_batch_comm: bool = True,
    overlap_p2p_comm: bool = False,
    batch_p2p_comm: bool = True,
    timers: _Timers | None = None,
) -> Any:
    """Send ``input_tensor_grad`` (if any) to the previous stage; receive from the next one if ``recv_next``.

    Returns the received gradient (or ``None``), plus the request list with ``overlap_p2p_comm``.
    """
    _, output_tensor_grad, wait_handles = _communicate(
        None, input_tensor_grad, False, recv_next, tensor_shape, dtype_=dtype,
        async_comm=async_comm, sequence_parallel_enabled=sequence_parallel_enabled,
        sync_batch_comm=sync_batch_comm, overlap_p2p_comm=overlap_p2p_comm, batch_p2p_comm=batch_p2p_comm)
    if overlap_p2p_comm:
        return output_tensor_grad, wait_handles
    return output_tensor_grad


def send_forward_backward_recv_forward_backward(
    output_tensor: torch.Tensor | None,
    input_tensor_grad: torch.Tensor | None,
    recv_prev: bool,
    recv_next: bool,
    tensor_shape: Shape,
    *,
    dtype: torch.dtype | None = None,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    sync_batch_comm: bool = True,
    overlap_p2p_comm: bool = False,
    batch_p2p_comm: bool = True,
    timers: _Timers | None = None,
) -> Any:
    """Both directions at once: send the activation forward and the gradient backward, receive either.

    Returns ``(input_tensor, output_tensor_grad)`` (``None`` where not received), plus the request
    list with ``overlap_p2p_comm``.
    """
    input_tensor, output_tensor_grad, wait_handles = _communicate(
        output_tensor, input_tensor_grad, recv_prev, recv_next, tensor_shape, dtype_=dtype,
        async_comm=async_comm, sequence_parallel_enabled=sequence_parallel_enabled,
        sync_batch_comm=sync_batch_comm, overlap_p2p_comm=overlap_p2p_comm, batch_p2p_comm=batch_p2p_comm)
    if overlap_p2p_comm:
        return input_tensor, output_tensor_grad, wait_handles
    return input_tensor, output_tensor_grad
