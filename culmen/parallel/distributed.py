"""Apex's ``DistributedDataParallel`` and ``Reducer`` on ``torch.distributed``.

How ``DistributedDataParallel`` works:

* At construction the parameter list is checked to be the same on every rank (count, names, shapes,
  dtypes, ``requires_grad``); a mismatch raises ``ValueError`` on every rank naming the first
  difference. Then every parameter is broadcast from the group's first rank.
* Each parameter that requires grad gets a post-accumulate-grad hook. The first backward (and the
  first after the set of parameters requiring grad changed) records the order in which gradients
  arrive; at its end the first rank's order is broadcast and every rank builds the same buckets from
  it: per dtype, a bucket is closed once it holds at least ``message_size`` elements (or when an
  ``allreduce_trigger_params`` parameter arrives). ``delay_allreduce=True`` uses one bucket per dtype.
* Each bucket owns one flat buffer; after a bucket's first reduction its parameters' ``.grad`` are
  views into it (gradient-as-bucket-view: later backward passes accumulate straight into the buffer,
  and the reduced values need no copy back). A grad that is not the view (``zero_grad(set_to_none=True)``
  made it a fresh tensor) is copied in, one multi-tensor copy per bucket.
* During backward, a full bucket is all-reduced asynchronously as soon as every bucket before it has
  been launched (launch order is identical on all ranks), overlapping the rest of backward. At the
  end of backward (an autograd engine callback) the remaining buckets are launched, every
  reduction is waited for (on NCCL this only orders the streams) and the post-division applied.
* Division, as Apex documents it: before the all-reduce ``grads *= 1/gradient_predivide_factor``;
  after it, when ``gradient_average``, ``grads *= gradient_predivide_factor/world_size``.
  ``allreduce_always_fp32`` reduces an fp32 copy of fp16/bf16 buckets.

Parameters that get no gradient in a backward (unused in forward): a parameter that got none in the
recording backward on the first rank is left out of the buckets and keeps ``grad=None`` (as in Apex).
A bucketed parameter that later gets no gradient, or an unbucketed one that gets one, makes
``backward()`` raise ``RuntimeError`` naming it, after this iteration's collectives completed (zeros
stand in), so that no rank is left waiting inside the iteration. ``find_unused_parameters=True`` (a
culmen extension) buckets every parameter and lets missing gradients count as zeros (or as whatever
``.grad`` holds from gradient accumulation) instead of raising.

Differences from Apex (deliberate): the recording backward builds the buckets first and reduces with
them (Apex reduced per dtype, same values); ``delay_allreduce`` reduces the recorded parameters every
iteration rather than whichever ``.grad`` happen to exist; gradients become views of the bucket buffers
(with or without ``retain_allreduce_buffers``, whose buffers are those same ones); extra streams are
extra process groups (an NCCL communicator owns its stream); ``gradient_average_split_factor`` warns
and acts as ``gradient_predivide_factor``; buffers are not broadcast (as in Apex); the wrapper cannot
be pickled. Failures of peers surface through ``torch.distributed``: gloo raises at once; with NCCL the
reductions run on the GPU, so set ``TORCH_NCCL_BLOCKING_WAIT=1`` to make ``backward()`` raise within the
process-group timeout when a peer is gone (the host then waits for each iteration's reductions at the
end of backward); without it PyTorch's NCCL watchdog is all that ends a stuck collective.
"""

from __future__ import annotations

import threading
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Variable
from torch.nn import Module

from culmen.ops.common.collectives import all_gather_single

ReduceOp = dist.ReduceOp

__all__ = ["DistributedDataParallel", "Reducer", "ReduceOp", "apply_flat_dist_call", "extract_tensors",
           "flat_dist_call", "flatten", "import_flatten_impl", "split_by_type", "split_half_float_double", "unflatten"]


# ---------------------------------------------------------------------------------------------
# Flat collectives (Apex's flat_dist_call)
# ---------------------------------------------------------------------------------------------


def _buckets(tensors: Iterable[Tensor], key) -> OrderedDict:
    """``tensors`` grouped by ``key(t)``, groups in order of first appearance."""
    buckets: OrderedDict = OrderedDict()
    for t in tensors:
        buckets.setdefault(key(t), []).append(t)
    return buckets


def _split_by_type(tensors: Iterable[Tensor]) -> OrderedDict:
    return _buckets(tensors, lambda t: (t.dtype, t.device))


def flat_dist_call(tensors: Sequence[Tensor], call, extra_args: tuple | None = None, group=None) -> None:
    """Apply a collective ``call`` (``dist.broadcast``, ``dist.all_reduce`` ...) to ``tensors`` in place,
    one flattened call per (dtype, device). After ``dist.all_reduce`` the result is divided by the
    group's size (Apex's convention: an average)."""
    for bucket in _split_by_type(tensors).values():
        _flat_call(bucket, call, extra_args, group)


def _flat_call(bucket: Sequence[Tensor], call, extra_args: tuple | None, group) -> None:
    """``call`` on ``bucket`` (one dtype and device) flattened, averaged after ``dist.all_reduce``, copied back."""
    flat = torch._utils._flatten_dense_tensors(bucket)
    call(flat, *(extra_args or ()), **({} if group is None else {"group": group}))
    if call is dist.all_reduce:
        flat.div_(dist.get_world_size(group))
    torch._foreach_copy_(list(bucket), list(torch._utils._unflatten_dense_tensors(flat, bucket)))


def flatten(bucket: Sequence[Tensor]) -> Tensor:
    """Apex's ``flatten``: the dense tensors of ``bucket`` (one dtype, one device) as one flat tensor."""
    return torch._utils._flatten_dense_tensors(bucket)


def unflatten(coalesced: Tensor, bucket: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """Apex's ``unflatten``: ``coalesced`` cut back into tensors shaped like ``bucket``'s (views of it)."""
    return torch._utils._unflatten_dense_tensors(coalesced, bucket)


def import_flatten_impl() -> None:
    """Apex's hook choosing between its C++ ``apex_C.flatten`` and torch's; culmen always uses torch's
    (``flatten`` / ``unflatten`` above), so there is nothing to choose."""


def apply_flat_dist_call(bucket: Sequence[Tensor], call, extra_args: tuple | None = None) -> None:
    """Apex's ``apply_flat_dist_call``: ``call(flat, *extra_args)`` on the flattened ``bucket`` (one dtype and
    device), divided by the world size after ``dist.all_reduce``, then copied back into ``bucket``."""
    _flat_call(bucket, call, extra_args, None)


def split_half_float_double(tensors: Iterable[Tensor]) -> list[list[Tensor]]:
    """Apex's ``split_half_float_double``: the CUDA half, float and double tensors of ``tensors``, one list per
    type that occurs, in that order (other tensors are left out, as in Apex)."""
    buckets = split_by_type(tensors)
    return [buckets[k] for k in ("torch.cuda.HalfTensor", "torch.cuda.FloatTensor", "torch.cuda.DoubleTensor")
            if k in buckets]


def split_by_type(tensors: Iterable[Tensor]) -> OrderedDict:
    """Apex's ``split_by_type``: ``tensors`` grouped by ``Tensor.type()`` (e.g. ``"torch.cuda.HalfTensor"``),
    in order of first appearance."""
    return _buckets(tensors, Tensor.type)


def extract_tensors(maybe_tensor: Any, tensor_list: list[Tensor]) -> None:
    """Append every tensor found in a (nested) iterable to ``tensor_list``."""
    if torch.is_tensor(maybe_tensor):
        tensor_list.append(maybe_tensor)
        return
    try:
        for item in maybe_tensor:
            extract_tensors(item, tensor_list)
    except TypeError:
        return


def _require_dist() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("culmen.parallel needs torch.distributed initialized first "
                           "(torch.distributed.init_process_group, e.g. under torchrun)")


def _first_rank(group) -> int:
    """Global rank of the group's first member (the broadcast source)."""
    if group is None or group is dist.group.WORLD:
        return 0
    return dist.get_global_rank(group, 0)


def _comm_device(group, params: Sequence[Tensor]) -> torch.device:
    if dist.get_backend(group) == "nccl":
        for p in params:
            if p.is_cuda:
                return p.device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _broadcast_params(params: Sequence[Tensor], group, chunk: int) -> None:
    """Broadcast ``params`` from the group's first rank, in flat chunks of about ``chunk`` elements."""
    src = _first_rank(group)
    with torch.no_grad():
        for bucket in _split_by_type(p.detach() for p in params).values():
            part, n = [], 0
            for t in bucket + [None]:
                if t is not None:
                    part.append(t)
                    n += t.numel()
                if part and (t is None or n >= chunk):
                    flat = torch._utils._flatten_dense_tensors(part)
                    dist.broadcast(flat, src, group=group)
                    torch._foreach_copy_(part, list(torch._utils._unflatten_dense_tensors(flat, part)))
                    part, n = [], 0


def _describe(named: Sequence[tuple[str, Tensor]]) -> list[str]:
    return [f"{name} {tuple(p.shape)} {str(p.dtype).replace('torch.', '')} requires_grad={p.requires_grad}"
            for name, p in named]


def _verify_same_params(named: Sequence[tuple[str, Tensor]], group, device: torch.device) -> None:
    """Raise ``ValueError`` on every rank when the parameter lists differ across ranks."""
    desc = _describe(named)
    sig = torch.tensor([len(desc), zlib.crc32("\n".join(desc).encode())], dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    allsig = torch.empty((world * 2,), dtype=torch.int64, device=device)
    all_gather_single(allsig, sig, group=group)
    allsig = allsig.view(world, 2)
    if bool((allsig == allsig[0]).all()):
        return
    descs: list = [None] * world
    dist.all_gather_object(descs, desc, group=group)
    msg = ["DistributedDataParallel: the model's parameters differ across ranks (every rank must build the same "
           "model before wrapping it):"]
    ref = descs[0]
    for r in range(1, world):
        other = descs[r]
        if other == ref:
            continue
        if len(other) != len(ref):
            msg.append(f"  rank {r} has {len(other)} parameters, rank 0 has {len(ref)}")
        for i, (a, b) in enumerate(zip(ref, other)):
            if a != b:
                msg.append(f"  parameter {i}: rank 0 has {a!r}, rank {r} has {b!r}")
                break
    raise ValueError("\n".join(msg))


def _dense_view(buf: Tensor, offset: int, p: Tensor) -> Tensor:
    """A view of ``buf[offset:offset+p.numel()]`` with ``p``'s shape, and ``p``'s strides when ``p`` is dense
    (channels_last weights keep their layout), so accumulation into it stays a plain elementwise add."""
    n = p.numel()
    if p.dim() > 0 and not p.is_contiguous():
        order = sorted(range(p.dim()), key=lambda d: p.stride(d))
        expect, dense = 1, True
        for d in order:
            if p.size(d) != 1 and p.stride(d) != expect:
                dense = False
                break
            expect *= p.size(d)
        if dense:
            return buf.as_strided(p.shape, p.stride(), buf.storage_offset() + offset)
    return buf[offset:offset + n].view(p.shape)


class _Bucket:
    """A flat buffer of one dtype and the parameters (module indices) whose gradients it holds."""

    __slots__ = ("index", "params", "numel", "dtype", "device", "buffer", "views", "ready", "work", "reduced")

    def __init__(self, index: int, params: list[int], tensors: Sequence[Tensor]):
        self.index = index
        self.params = params
        ps = [tensors[i] for i in params]
        self.dtype = ps[0].dtype
        self.device = ps[0].device
        self.numel = sum(p.numel() for p in ps)
        self.buffer = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        self.views: list[Tensor] = []
        off = 0
        for p in ps:
            self.views.append(_dense_view(self.buffer, off, p))
            off += p.numel()
        self.ready = 0
        self.work = None
        self.reduced: Tensor | None = None


class DistributedDataParallel(Module):
    """Data-parallel wrapper with Apex's arguments, overlapping gradient all-reduce with backward.

    Args:
        module: the network, on this process's device (CUDA for NCCL).
        message_size: minimum number of elements of a bucket (per dtype).
        delay_allreduce: all-reduce everything once at the end of backward (one bucket per dtype), no
            overlap.
        shared_param: obsolete in Apex; passing anything raises ``ValueError``.
        allreduce_trigger_params: parameters whose gradient's arrival closes the current bucket of its
            dtype (instead of ``message_size``); remaining gradients are reduced at the end of backward.
        retain_allreduce_buffers: keep the flat reduced buffers in ``self.allreduce_buffers`` (one per
            bucket, in bucket order); the parameters' ``.grad`` are views into them.
        allreduce_always_fp32: reduce fp16/bf16 gradients in fp32 (cast back afterwards).
        num_allreduce_streams: > 1 reduces buckets round-robin over that many process groups (each
            NCCL communicator has its own stream), created collectively at construction.
        allreduce_communicators: ``(process_groups, streams)`` to use instead of creating groups
            (needs ``num_allreduce_streams == len(process_groups) > 1``). culmen launches on each
            group's own NCCL stream, so the streams are checked but not used.
        gradient_average: divide the sum by the world size (see ``gradient_predivide_factor``).
        gradient_predivide_factor: ``f``: grads are multiplied by ``1/f`` before the all-reduce and, if
            ``gradient_average``, by ``f/world_size`` after it.
        gradient_average_split_factor: deprecated name of ``gradient_predivide_factor`` (FutureWarning).
        prof: annotate the DDP work with ``torch.profiler`` / NVTX ranges.
        process_group: (culmen extension) the data-parallel group; default the world.
        find_unused_parameters: (culmen extension) bucket every parameter and treat a missing gradient
            as zero instead of raising (see the module docstring).

    The forward is the module's. ``enable_allreduce()`` / ``disable_allreduce()`` switch the reduction
    on and off (gradient accumulation: disable for the accumulation steps, enable before the last
    backward). Gradients are fp32/fp16/bf16/fp64 tensors of the parameters' dtype.
    """

    def __init__(
        self,
        module: Module,
        message_size: int = 10000000,
        delay_allreduce: bool = False,
        shared_param: Any = None,
        allreduce_trigger_params: Iterable[Tensor] | None = None,
        retain_allreduce_buffers: bool = False,
        allreduce_always_fp32: bool = False,
        num_allreduce_streams: int = 1,
        allreduce_communicators: tuple[Sequence[Any], Sequence[Any]] | None = None,
        gradient_average: bool = True,
        gradient_predivide_factor: float = 1.0,
        gradient_average_split_factor: float | None = None,
        prof: bool = False,
        *,
        process_group: Any = None,
        find_unused_parameters: bool = False,
    ):
        super().__init__()
        if shared_param is not None:
            raise ValueError("shared_param is no longer supported (Apex removed it): overlapping communication "
                             "works with shared parameters. To reduce only at the end of backward, pass "
                             "delay_allreduce=True.")
        if gradient_average_split_factor is not None:
            warnings.warn("gradient_average_split_factor is deprecated; use gradient_predivide_factor "
                          "(gradient_average_split_factor is used as gradient_predivide_factor for now).",
                          FutureWarning, stacklevel=2)
            if gradient_predivide_factor == 1.0:
                gradient_predivide_factor = gradient_average_split_factor
        if not gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
        if int(message_size) < 0:
            raise ValueError(f"message_size must be >= 0, got {message_size}")
        if int(num_allreduce_streams) < 1:
            raise ValueError(f"num_allreduce_streams must be >= 1, got {num_allreduce_streams}")
        if num_allreduce_streams > 1 and delay_allreduce:
            raise ValueError("num_allreduce_streams > 1 may only be used with delay_allreduce=False")
        if allreduce_trigger_params is not None and delay_allreduce:
            raise ValueError("allreduce_trigger_params is only valid with delay_allreduce=False")
        if allreduce_communicators is not None:
            if num_allreduce_streams < 2:
                raise ValueError("allreduce_communicators needs num_allreduce_streams > 1")
            if len(allreduce_communicators) != 2 or len(allreduce_communicators[0]) != num_allreduce_streams \
                    or len(allreduce_communicators[1]) != num_allreduce_streams:
                raise ValueError("allreduce_communicators must be (process_groups, streams), each of length "
                                 "num_allreduce_streams")
        _require_dist()

        self.module = module
        self.message_size = int(message_size)
        self.delay_allreduce = bool(delay_allreduce)
        self.retain_allreduce_buffers = bool(retain_allreduce_buffers)
        self.allreduce_always_fp32 = bool(allreduce_always_fp32)
        self.num_allreduce_streams = int(num_allreduce_streams)
        self.allreduce_communicators = allreduce_communicators
        self.gradient_average = bool(gradient_average)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.prof = bool(prof)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.process_group = process_group
        self.world_size = float(dist.get_world_size(process_group))
        self.allreduce_buffers: list[Tensor] = []
        # Buckets of the last backward, and how many were launched before its end (overlapped).
        self.last_backward_stats: dict[str, int] = {}

        named = list(module.named_parameters())
        self._names = [n for n, _ in named]
        self._params: list[Tensor] = [p for _, p in named]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._backend = dist.get_backend(process_group)
        if self._backend == "nccl":
            for n, p in named:
                if not p.is_cuda:
                    raise ValueError(f"the NCCL backend needs every parameter on a GPU; {n} is on {p.device}")
        self._device = _comm_device(process_group, self._params)
        _verify_same_params(named, process_group, self._device)
        _broadcast_params(self._params, process_group, max(self.message_size, 1 << 24))

        self._trigger_idx: set[int] | None = None
        if allreduce_trigger_params is not None:
            self._trigger_idx = set()
            for p in allreduce_trigger_params:
                if id(p) not in self._index:
                    raise ValueError("allreduce_trigger_params must be parameters of the module")
                self._trigger_idx.add(self._index[id(p)])

        if allreduce_communicators is not None:
            self._groups = list(allreduce_communicators[0])
        elif self.num_allreduce_streams > 1:
            ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
            self._groups = [dist.new_group(ranks=ranks) for _ in range(self.num_allreduce_streams)]
        else:
            self._groups = [process_group]

        self._lock = threading.Lock()
        self._hooks: dict[int, Any] = {}
        self._rg_key: tuple[bool, ...] | None = None
        self._buckets: list[_Bucket] = []
        self._loc: dict[int, tuple[_Bucket, int]] = {}
        self._refresh = True
        self._disable_allreduce = False
        self._reset_iteration()
        self._sync_hooks()

    # ------------------------------------------------------------------------------- public API

    def enable_allreduce(self) -> None:
        """Reduce gradients in the following backward passes (the default)."""
        self._disable_allreduce = False

    def disable_allreduce(self) -> None:
        """Skip the reduction in the following backward passes (gradients accumulate locally)."""
        self._disable_allreduce = True

    @property
    def needs_refresh(self) -> bool:
        """True when the next backward re-records the gradient order and rebuilds the buckets."""
        return self._refresh

    @needs_refresh.setter
    def needs_refresh(self, value: bool) -> None:
        self._refresh = bool(value)

    @property
    def bucket_structure(self) -> list[list[str]]:
        """Names of the parameters of each bucket, in reduction order (empty before the first backward)."""
        return [[self._names[i] for i in b.params] for b in self._buckets]

    def forward(self, *inputs, **kwargs):
        """The wrapped module's forward; also notices parameters whose ``requires_grad`` changed."""
        with self._range("culmen.ddp.forward"):
            if self._queued:
                # A backward raised before its end-of-backward callback ran: drop its state.
                self._reset_iteration()
            key = tuple(p.requires_grad for p in self._params)
            if key != self._rg_key:
                self._sync_hooks()
        return self.module(*inputs, **kwargs)

    # ------------------------------------------------------------------------------- internals

    def _range(self, name: str):
        return torch.autograd.profiler.record_function(name) if self.prof else nullcontext()

    def _sync_hooks(self) -> None:
        self._rg_key = tuple(p.requires_grad for p in self._params)
        for i, p in enumerate(self._params):
            if p.requires_grad and i not in self._hooks:
                self._hooks[i] = p.register_post_accumulate_grad_hook(self._make_hook(i))
        self._refresh = True

    def _reset_iteration(self) -> None:
        self._fired = bytearray(len(self._params))
        self._order: list[int] = []
        self._stray: list[int] = []
        self._twice: list[int] = []
        self._queued = False
        self._next = 0
        self._launched: list[_Bucket] = []
        for b in self._buckets:
            b.ready = 0
            b.work = None
            b.reduced = None

    def _make_hook(self, i: int):
        def hook(p: Tensor) -> None:
            if self._disable_allreduce:
                return
            with self._range("culmen.ddp.allreduce_hook"), self._lock:
                if not self._queued:
                    Variable._execution_engine.queue_callback(self._end_of_backward)
                    self._queued = True
                if self._fired[i]:
                    loc = self._loc.get(i)
                    if loc is not None and loc[0].work is not None:
                        self._twice.append(i)
                    return
                self._fired[i] = 1
                if self._refresh:
                    self._order.append(i)
                    return
                loc = self._loc.get(i)
                if loc is None:
                    self._stray.append(i)
                    return
                if self.delay_allreduce:
                    return
                b = loc[0]
                b.ready += 1
                if b.ready == len(b.params) and b.index == self._next:
                    self._launch_ready()
        return hook

    def _launch_ready(self) -> None:
        while self._next < len(self._buckets):
            b = self._buckets[self._next]
            if b.ready < len(b.params):
                return
            self._launch(b)
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        """Gather the bucket's gradients into its buffer and start its all-reduce."""
        dst, src, zero = [], [], []
        for i, view in zip(b.params, b.views):
            p = self._params[i]
            g = p.grad
            if g is view:
                continue
            if g is None:
                zero.append(view)
            else:
                if g.is_sparse:
                    raise RuntimeError(f"DistributedDataParallel does not reduce sparse gradients ({self._names[i]})")
                dst.append(view)
                src.append(g)
            p.grad = view
        if dst:
            torch._foreach_copy_(dst, src)
        if zero:
            torch._foreach_zero_(zero)
        t = b.buffer
        if self.allreduce_always_fp32 and t.dtype in (torch.float16, torch.bfloat16):
            t = t.float()
        if self.gradient_predivide_factor != 1.0:
            t.mul_(1.0 / self.gradient_predivide_factor)
        b.reduced = t
        # delay_allreduce forbids extra streams, so ``self._groups`` is then ``[process_group]``.
        b.work = dist.all_reduce(t, group=self._groups[b.index % len(self._groups)], async_op=True)
        self._launched.append(b)

    def _build_buckets(self) -> None:
        """Broadcast the first rank's gradient order and build the same buckets on every rank."""
        n = len(self._params)
        order = torch.full((n,), -1, dtype=torch.int64, device=self._device)
        if self._order:
            order[:len(self._order)] = torch.tensor(self._order, dtype=torch.int64, device=order.device)
        dist.broadcast(order, _first_rank(self.process_group), group=self.process_group)
        ordered = [i for i in order.tolist() if i >= 0]
        if self.find_unused_parameters:
            seen = set(ordered)
            ordered += [i for i in reversed(range(n)) if self._params[i].requires_grad and i not in seen]
        groups: list[list[int]] = []
        if self.delay_allreduce:
            per_dtype: OrderedDict = OrderedDict()
            for i in sorted(ordered):
                per_dtype.setdefault(self._params[i].dtype, []).append(i)
            groups = list(per_dtype.values())
        else:
            open_: OrderedDict = OrderedDict()
            sizes: dict = {}
            for i in ordered:
                p = self._params[i]
                key = (p.dtype, p.device)
                open_.setdefault(key, []).append(i)
                sizes[key] = sizes.get(key, 0) + p.numel()
                if self._trigger_idx is not None:
                    ship = i in self._trigger_idx
                else:
                    ship = sizes[key] >= self.message_size
                if ship:
                    groups.append(open_.pop(key))
                    sizes[key] = 0
            groups += [g for g in open_.values() if g]
        old = {id(self._params[i]): (b, k) for b in self._buckets for k, i in enumerate(b.params)}
        self._buckets = [_Bucket(k, g, self._params) for k, g in enumerate(groups)]
        self._loc = {i: (b, k) for b in self._buckets for k, i in enumerate(b.params)}
        # Gradients that were views of the old buffers keep their values but not the aliasing.
        for b in self._buckets:
            for i in b.params:
                p = self._params[i]
                if p.grad is not None and id(p) in old:
                    ob, k = old[id(p)]
                    if p.grad is ob.views[k]:
                        p.grad = p.grad.clone()
        self._refresh = False

    def _end_of_backward(self) -> None:
        with self._range("culmen.ddp.end_of_backward"), self._lock:
            try:
                self._finish()
            finally:
                errors = self._errors()
                self._reset_iteration()
        if errors:
            raise RuntimeError(errors)

    def _finish(self) -> None:
        if self._refresh:
            self._build_buckets()
            # Sort the recorded gradients into the new buckets.
            self._stray = [i for i in self._order if i not in self._loc]
        # Launch every bucket not launched yet, in order (missing gradients count as zeros).
        self.last_backward_stats = {"buckets": len(self._buckets), "launched_during_backward": len(self._launched)}
        self._missing = []
        for b in self._buckets[self._next:]:
            self._missing += [i for i in b.params if not self._fired[i]]
            self._launch(b)
        self._next = len(self._buckets)
        for b in self._launched:
            b.work.wait()
        if self.gradient_average:
            scale = self.gradient_predivide_factor / self.world_size
            if scale != 1.0:
                torch._foreach_mul_([b.reduced for b in self._launched], scale)
        casts = [b for b in self._launched if b.reduced is not b.buffer]
        if casts:
            torch._foreach_copy_([b.buffer for b in casts], [b.reduced for b in casts])
        if self.retain_allreduce_buffers:
            self.allreduce_buffers = [b.buffer for b in self._buckets]

    def _errors(self) -> str:
        msg = []
        missing = getattr(self, "_missing", [])
        self._missing = []
        if missing and not self.find_unused_parameters:
            names = ", ".join(self._names[i] for i in missing[:10]) + (" ..." if len(missing) > 10 else "")
            msg.append(f"DistributedDataParallel: {len(missing)} parameter(s) that are reduced got no gradient in "
                       f"this backward: {names}. Zeros were reduced in their place so the other ranks are not "
                       "left waiting. If the forward does not always use every parameter, pass "
                       "find_unused_parameters=True (missing gradients then count as zero); if the set of used "
                       "parameters changed for good, set ddp.needs_refresh = True.")
        if self._stray:
            names = ", ".join(self._names[i] for i in self._stray[:10])
            msg.append(f"DistributedDataParallel: parameter(s) {names} got a gradient but were unused in the first "
                       "backward (on the first rank), so they are not reduced. Pass find_unused_parameters=True, "
                       "or set ddp.needs_refresh = True before a backward that uses every parameter.")
        if self._twice:
            names = ", ".join(self._names[i] for i in self._twice[:10])
            msg.append(f"DistributedDataParallel: parameter(s) {names} received a gradient again after their bucket "
                       "was sent (e.g. a weight used in two separately-backpropagated parts); this iteration's "
                       "reduced gradient is wrong. Use delay_allreduce=True.")
        return "\n".join(msg)

    def __getstate__(self):
        raise TypeError("culmen.parallel.DistributedDataParallel cannot be pickled; pickle ddp.module instead")


class Reducer:
    """All-reduce (average) gradients when you call ``reduce()``, e.g. every few iterations.

    Args:
        module_or_grads_list: a module (its parameters are broadcast from rank 0 now, and
            ``reduce()`` averages the ``.grad`` of those that have one) or a (nested) iterable of
            tensors that ``reduce()`` averages in place.
        process_group: (culmen extension) the group to reduce over; default the world.
    """

    def __init__(self, module_or_grads_list: Module | Iterable[Tensor], *, process_group: Any = None):
        _require_dist()
        self.process_group = process_group
        if isinstance(module_or_grads_list, Module):
            self.module: Module | None = module_or_grads_list
            self.grads: list[Tensor] = []
            _broadcast_params(list(self.module.parameters()), process_group, 1 << 26)
        else:
            self.module = None
            self.grads = []
            extract_tensors(module_or_grads_list, self.grads)

    def reduce(self) -> None:
        """Average the gradients (or the given tensors) over the group, in place."""
        if self.module is not None:
            grads = [p.grad.data for p in self.module.parameters() if p.grad is not None]
        else:
            grads = self.grads
        with torch.no_grad():
            flat_dist_call(grads, dist.all_reduce, group=self.process_group)
