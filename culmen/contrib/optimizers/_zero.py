"""The ZeRO machinery shared by :class:`DistributedFusedAdam` and :class:`DistributedFusedLAMB`.

Layout. The params that require grad are laid out back to back, in reverse registration order (the
order in which backward usually produces their gradients), in a flat index space cut into buckets of
``bucket_size`` elements (the last one shorter). Each bucket is split into ``D`` equal shards, ``D`` the
size of the distributed (sharding) process group; rank ``r`` of that group owns shard ``r`` of every
bucket: the optimizer state (fp32 moments, master params) exists only for it. A param may straddle
buckets; each piece of a param in one bucket is a :class:`Fragment`.

Gradients. After a param's gradient is accumulated (``register_post_accumulate_grad_hook``) it is copied
into its bucket's buffer (in ``grad_sync_dtype``) and ``param.grad`` is dropped; when every param of a
bucket has arrived, the bucket is reduce-scattered asynchronously (``overlap_grad_sync``), so
communication runs while backward goes on. ``grad_sync()`` finishes every bucket; the reduced shard is
accumulated, in the state dtype, into the bucket's ``grad_shard``, then all-reduced across the
redundant group (the replicas of the shard), if any.

Params. After the local update each rank holds its shard of every bucket in ``param_sync_dtype``;
``all_gather_into_tensor`` rebuilds the buckets and the fragments are copied back into the params. With
``overlap_param_sync`` the all-gathers are launched at the end of ``step()`` and finished lazily, by a
module forward pre-hook the first time a module that owns one of the params runs, or by
``param_sync()``.

Everything is plain ``torch.distributed``: NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from culmen.ops.common.collectives import all_gather_single, reduce_scatter_single
from culmen.ops.multi_tensor.adam import rem_master, rem_split

_ALIGN = 16  # shard sizes are multiples of this many elements (aligned vector access on GPUs)
_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _dtype_arg(owner: str, name: str, value: Any, default: torch.dtype) -> torch.dtype:
    if value is None:
        return default
    if not isinstance(value, torch.dtype) or value not in _FLOATS:
        raise TypeError(f"{owner}: {name} must be a floating torch.dtype (float32, float16, bfloat16, float64), "
                        f"got {value!r}")
    return value


class Fragment:
    """The piece ``[param_start, param_end)`` (flat) of param ``param_id`` lying at ``[bucket_start,
    bucket_end)`` of bucket ``bucket_id``; ``shard_start/shard_end`` (within the local shard) and
    ``local_start/local_end`` (within the param) describe the part this rank owns (empty: ``None``)."""

    __slots__ = ("param_id", "group_id", "bucket_id", "param_start", "param_end", "bucket_start", "bucket_end",
                 "shard_start", "shard_end", "local_start", "local_end")

    def __init__(self, param_id: int, group_id: int, bucket_id: int, param_start: int, param_end: int,
                 bucket_start: int, shard_lo: int, shard_size: int) -> None:
        self.param_id, self.group_id, self.bucket_id = param_id, group_id, bucket_id
        self.param_start, self.param_end = param_start, param_end
        self.bucket_start = bucket_start
        self.bucket_end = bucket_start + (param_end - param_start)
        lo, hi = max(self.bucket_start, shard_lo), min(self.bucket_end, shard_lo + shard_size)
        if lo < hi:
            self.shard_start, self.shard_end = lo - shard_lo, hi - shard_lo
            self.local_start = param_start + (lo - self.bucket_start)
            self.local_end = self.local_start + (hi - lo)
        else:
            self.shard_start = self.shard_end = self.local_start = self.local_end = None

    @property
    def in_local_shard(self) -> bool:
        return self.shard_start is not None


class Bucket:
    """One bucket: its fragments, local optimizer state (shards) and communication buffers."""

    def __init__(self, index: int, size: int, shard_size: int) -> None:
        self.index, self.size, self.shard_size = index, size, shard_size
        self.fragments: list[Fragment] = []
        self.param_ids: set[int] = set()
        self.pending: set[int] = set()  # params whose gradient has not reached the buffer this round
        self.state: dict[str, Tensor] = {}  # local shards: exp_avg, exp_avg_sq, params / remainders ...
        self.grad_buffer: Tensor | None = None  # the whole bucket, grad_sync_dtype, while filling / syncing
        self.filled = False
        self.rs_out: Tensor | None = None
        self.work = None  # async reduce-scatter handle
        self.grad_shard: Tensor | None = None  # reduced local shard, state dtype
        self.param_out: Tensor | None = None  # gathered bucket, param_sync_dtype
        self.param_work = None  # async all-gather handle
        self.params_stale = False  # gathered but not yet copied into the params


def _group_size(group) -> int:
    return dist.get_world_size(group)


class ZeroBase(torch.optim.Optimizer):
    """Sharded-state optimizer base: layout, gradient reduce-scatter, parameter all-gather, norms, state dicts.

    Subclasses implement ``_local_step(grad_scale_inv, noop)`` over the local fragments and name the
    per-element state they keep in ``_state_names``.
    """

    _state_names: tuple[str, ...] = ("exp_avg", "exp_avg_sq")

    def _zero_init(self, *, dtype, grad_sync_dtype, param_sync_dtype, device, process_group,
                   distributed_process_group, redundant_process_group, average_grad_sync, overlap_grad_sync,
                   overlap_param_sync, bucket_cap_mb, pipeline_size, contiguous_param_buffer, contiguous_grad_buffer,
                   store_params, store_param_remainders, with_scaled_states) -> None:
        owner = type(self).__name__
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{owner} needs an initialized torch.distributed process group "
                               "(torch.distributed.init_process_group)")
        self.dtype = _dtype_arg(owner, "dtype", dtype, torch.float32)
        self.grad_sync_dtype = _dtype_arg(owner, "grad_sync_dtype", grad_sync_dtype, self.dtype)
        self.param_sync_dtype = _dtype_arg(owner, "param_sync_dtype", param_sync_dtype, self.dtype)
        if not isinstance(bucket_cap_mb, (int, float)) or isinstance(bucket_cap_mb, bool) or not bucket_cap_mb > 0:
            raise ValueError(f"{owner}: bucket_cap_mb must be a number > 0, got {bucket_cap_mb!r}")
        if isinstance(pipeline_size, bool) or not isinstance(pipeline_size, int) or pipeline_size < 1:
            raise ValueError(f"{owner}: pipeline_size must be an int >= 1, got {pipeline_size!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.distributed_process_group = (distributed_process_group if distributed_process_group is not None
                                          else self.process_group)
        self.redundant_process_group = redundant_process_group
        self.process_group_size = _group_size(self.process_group)
        self.distributed_size = _group_size(self.distributed_process_group)
        self.distributed_rank = dist.get_rank(self.distributed_process_group)
        self.redundant_size = 1 if redundant_process_group is None else _group_size(redundant_process_group)
        if self.distributed_size * self.redundant_size != self.process_group_size:
            raise ValueError(f"{owner}: the distributed group ({self.distributed_size} ranks) times the redundant "
                             f"group ({self.redundant_size} ranks) must equal the process group "
                             f"({self.process_group_size} ranks)")
        self.average_grad_sync = bool(average_grad_sync)
        self.overlap_grad_sync = bool(overlap_grad_sync)
        self.overlap_param_sync = bool(overlap_param_sync)
        self.pipeline_size = pipeline_size
        self.contiguous_param_buffer = bool(contiguous_param_buffer)
        self.contiguous_grad_buffer = bool(contiguous_grad_buffer)
        self.store_params = bool(store_params)
        self.store_param_remainders = bool(store_param_remainders)
        self.with_scaled_states = bool(with_scaled_states)
        if self.store_param_remainders:
            if self.dtype != torch.float32 or self.param_sync_dtype != torch.bfloat16:
                raise ValueError(f"{owner}: store_param_remainders needs dtype=torch.float32 and "
                                 f"param_sync_dtype=torch.bfloat16, got dtype={self.dtype}, "
                                 f"param_sync_dtype={self.param_sync_dtype}")
            self.store_params = False
        if self.with_scaled_states and self.store_param_remainders:
            raise ValueError(f"{owner}: with_scaled_states and store_param_remainders cannot be combined")
        elem = torch.empty((), dtype=self.grad_sync_dtype).element_size()
        unit = self.distributed_size * _ALIGN
        self.bucket_size = max(unit, int(bucket_cap_mb * 2 ** 20 / elem) // unit * unit)
        self._require_grad_sync = True
        self._grad_scale = self._unit_grad_scale()
        self._grad_norm: Tensor | None = None
        self._unscaled_by_user = False
        self._inflight: list[Bucket] = []
        self._stale_buckets = 0  # buckets gathered by the last step but not yet copied into the params
        self._hooks: list = []
        self._inplace_gather = dist.get_backend(self.distributed_process_group) == "nccl"
        self._build_layout()

    # ------------------------------------------------------------------------------------ layout

    def _build_layout(self) -> None:
        owner = type(self).__name__
        self._params: list[Tensor] = []
        self._param_group_of: list[int] = []
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                if p.device != self.device:
                    raise ValueError(f"{owner}: params must be on device={self.device}, got one on {p.device}")
                if p.dtype not in _FLOATS:
                    raise TypeError(f"{owner}: params must be floating point, got {p.dtype}")
                if self.store_param_remainders and p.dtype != torch.bfloat16:
                    raise ValueError(f"{owner}: store_param_remainders needs bfloat16 params, got {p.dtype}")
                self._params.append(p)
                self._param_group_of.append(gi)
        self._param_index = {id(p): i for i, p in enumerate(self._params)}
        D, B = self.distributed_size, self.bucket_size
        total = sum(p.numel() for p in self._params)
        unit = D * _ALIGN
        self.buckets: list[Bucket] = []
        nb = max(1, math.ceil(total / B))
        for b in range(nb):
            size = B if b < nb - 1 else max(unit, math.ceil((total - b * B) / unit) * unit)
            self.buckets.append(Bucket(b, size, size // D))
        self._fragments: list[list[Fragment]] = [[] for _ in self._params]
        offset = 0
        for pi in reversed(range(len(self._params))):
            n = self._params[pi].numel()
            placed = 0
            while placed < n:
                b = offset // B
                bucket = self.buckets[b]
                start = offset - b * B
                take = min(n - placed, bucket.size - start)
                frag = Fragment(pi, self._param_group_of[pi], b, placed, placed + take, start,
                                self.distributed_rank * bucket.shard_size, bucket.shard_size)
                bucket.fragments.append(frag)
                bucket.param_ids.add(pi)
                self._fragments[pi].append(frag)
                placed += take
                offset += take
        self._local_frags = [f for b in self.buckets for f in b.fragments if f.in_local_shard]
        self._init_buffers()
        self._init_state()
        self._register_hooks()
        for b in self.buckets:
            b.pending = set(b.param_ids)

    def _init_buffers(self) -> None:
        dev = self.device
        self._flat_grad = self._flat_param = None
        if self.contiguous_grad_buffer:
            self._flat_grad = torch.zeros(sum(b.size for b in self.buckets), dtype=self.grad_sync_dtype, device=dev)
        if self.contiguous_param_buffer:
            self._flat_param = torch.zeros(sum(b.size for b in self.buckets), dtype=self.param_sync_dtype,
                                           device=dev)
        off = 0
        for b in self.buckets:
            if self._flat_grad is not None:
                b.grad_buffer = self._flat_grad[off:off + b.size]
            if self._flat_param is not None:
                b.param_out = self._flat_param[off:off + b.size]
            off += b.size
        if self._flat_param is not None:
            # Params of the sync dtype that lie in one bucket become views of the gathered buffer: the
            # all-gather then writes them directly.
            with torch.no_grad():
                for pi, p in enumerate(self._params):
                    frags = self._fragments[pi]
                    if len(frags) == 1 and p.dtype == self.param_sync_dtype:
                        f = frags[0]
                        view = self.buckets[f.bucket_id].param_out[f.bucket_start:f.bucket_end]
                        view.copy_(p.detach().reshape(-1))
                        p.data = view.view_as(p)

    def _frag_param(self, f: Fragment) -> Tensor:
        """The local part of fragment ``f`` of its param (a flat view)."""
        return self._params[f.param_id].detach().reshape(-1)[f.local_start:f.local_end]

    def _init_state(self) -> None:
        """Local state shards, the master params from the params' current values."""
        dev, dt = self.device, self.dtype
        sdt = torch.float16 if self.with_scaled_states else dt
        for b in self.buckets:
            S = b.shard_size
            for name in self._state_names:
                b.state[name] = torch.zeros(S, dtype=sdt, device=dev)
            if self.store_params:
                b.state["params"] = torch.zeros(S, dtype=sdt, device=dev)
            if self.store_param_remainders:
                b.state["param_remainders"] = torch.zeros(S, dtype=torch.int16, device=dev)
            if self.with_scaled_states:
                n = len(b.fragments)
                for name in self._state_names + (("params",) if self.store_params else ()):
                    b.state[name + "_scale"] = torch.ones(n, dtype=torch.float32, device=dev)
        with torch.no_grad():
            for f in self._local_frags:
                b = self.buckets[f.bucket_id]
                src = self._frag_param(f)
                if self.store_params:
                    if self.with_scaled_states:
                        self._store_scaled(b, "params", f, src.to(torch.float32))
                    else:
                        b.state["params"][f.shard_start:f.shard_end].copy_(src)
                # remainders start at 0: the master is exactly the bf16 param

    # ----------------------------------------------------------------------------- scaled states

    def _frag_index(self, b: Bucket, f: Fragment) -> int:
        return b.fragments.index(f)

    def _load_scaled(self, b: Bucket, name: str, f: Fragment) -> Tensor:
        scale = b.state[name + "_scale"][self._frag_index(b, f)]
        return b.state[name][f.shard_start:f.shard_end].to(torch.float32) * scale

    def _store_scaled(self, b: Bucket, name: str, f: Fragment, value: Tensor) -> None:
        # Per-fragment scale so that the largest magnitude sits well inside fp16's range.
        amax = value.abs().amax() if value.numel() else value.new_zeros(())
        scale = torch.where(amax > 0, amax / 16384.0, torch.ones_like(amax))
        b.state[name + "_scale"][self._frag_index(b, f)] = scale
        b.state[name][f.shard_start:f.shard_end].copy_(value / scale)

    # ------------------------------------------------------------------------------------ hooks

    def _register_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for pi, p in enumerate(self._params):
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(pi)))
        if self.overlap_param_sync:
            self._param_owner = {id(p) for p in self._params}
            self._hooks.append(torch.nn.modules.module.register_module_forward_pre_hook(self._forward_pre_hook))

    def _make_grad_hook(self, pi: int):
        def hook(param: Tensor) -> None:
            if self._require_grad_sync and self.overlap_grad_sync:
                self._stage_grad(pi)
        return hook

    def _unit_grad_scale(self) -> Tensor:
        """The lazy gradient scale of a fresh round: ``1 / process_group_size`` when averaging (the shards hold
        the reduce-scatter's sum; the update and the norms apply the scale), else 1."""
        unit = 1.0 / self.process_group_size if self.average_grad_sync else 1.0
        return torch.full((), unit, dtype=torch.float32, device=self.device)

    def _forward_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        if not self._stale_buckets:  # every module's forward runs this: free once the params are in place
            return
        # Wait only for the gathers of this module's params: the later buckets keep arriving while the
        # first layers compute.
        for p in module.parameters(recurse=False):
            pi = self._param_index.get(id(p))
            if pi is not None:
                for f in self._fragments[pi]:
                    b = self.buckets[f.bucket_id]
                    if b.params_stale:
                        self._sync_bucket(b)

    # ------------------------------------------------------------------------------- grad sync

    def _bucket_buffer(self, b: Bucket) -> Tensor:
        if b.grad_buffer is None:
            b.grad_buffer = torch.zeros(b.size, dtype=self.grad_sync_dtype, device=self.device)
        return b.grad_buffer

    def _stage_grad(self, pi: int) -> None:
        """Move param ``pi``'s gradient into its buckets; launch every bucket that became complete."""
        p = self._params[pi]
        g = p.grad
        if g is None:
            return
        flat = g.detach().reshape(-1)
        for f in self._fragments[pi]:
            b = self.buckets[f.bucket_id]
            if b.work is not None:  # still syncing the previous round: finish it first
                self._finish_bucket(b)
            buf = self._bucket_buffer(b)
            piece = flat[f.param_start:f.param_end]
            dst = buf[f.bucket_start:f.bucket_end]
            if pi in b.pending:
                dst.copy_(piece)
            else:  # a second gradient of the same param in this round (e.g. staged by grad_sync before)
                dst.add_(piece)
            b.filled = True
        p.grad = None
        for f in self._fragments[pi]:
            b = self.buckets[f.bucket_id]
            b.pending.discard(pi)
            if not b.pending and b.work is None and self.overlap_grad_sync:
                self._launch_bucket(b)

    def _launch_bucket(self, b: Bucket) -> None:
        while len(self._inflight) >= self.pipeline_size:
            self._finish_bucket(self._inflight[0])
        buf = self._bucket_buffer(b)
        b.rs_out = torch.empty(b.shard_size, dtype=self.grad_sync_dtype, device=self.device)
        b.work = reduce_scatter_single(b.rs_out, buf, group=self.distributed_process_group, async_op=True)
        self._inflight.append(b)

    def _finish_bucket(self, b: Bucket) -> None:
        if b.work is None:
            return
        b.work.wait()
        b.work = None
        self._inflight.remove(b)
        out = b.rs_out
        b.rs_out = None
        if self.redundant_size > 1:
            dist.all_reduce(out, group=self.redundant_process_group)
        out = out.to(self.dtype)  # averaging is folded into the lazy gradient scale (_unit_grad_scale)
        if b.grad_shard is None:
            b.grad_shard = out
        else:
            b.grad_shard.add_(out)
        if self.contiguous_grad_buffer:
            b.grad_buffer.zero_()
        else:
            b.grad_buffer = None
        b.filled = False
        b.pending = set(b.param_ids)
        self._grad_norm = None

    def grad_sync(self) -> None:
        """Reduce-scatter every gradient not yet synchronized and wait for all of them.

        Gradients still in ``param.grad`` (no hook ran: ``overlap_grad_sync=False``, or they were
        accumulated under :meth:`no_sync`) are moved into the buckets first; params without a gradient
        count as zero gradients.
        """
        for pi, p in enumerate(self._params):
            if p.grad is not None:
                self._stage_grad(pi)
        for b in self.buckets:
            if b.work is None and b.filled:
                self._launch_bucket(b)
        while self._inflight:
            self._finish_bucket(self._inflight[0])
        for b in self.buckets:
            if b.grad_shard is None:
                b.grad_shard = torch.zeros(b.shard_size, dtype=self.dtype, device=self.device)

    @contextlib.contextmanager
    def no_sync(self, greedy_grad_copy: bool = False) -> Iterator[None]:
        """Inside, backward leaves gradients in ``param.grad`` (accumulating, no communication); the first
        backward or :meth:`grad_sync` after it synchronizes the sum. ``greedy_grad_copy`` is accepted
        for Apex's signature (gradients stay in ``param.grad`` either way)."""
        old = self._require_grad_sync
        self._require_grad_sync = False
        try:
            yield
        finally:
            self._require_grad_sync = old

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient: the synchronized shards, pending bucket data and ``param.grad``."""
        while self._inflight:
            self._finish_bucket(self._inflight[0])
        for b in self.buckets:
            b.grad_shard = None
            b.filled = False
            b.pending = set(b.param_ids)
            if self.contiguous_grad_buffer:
                b.grad_buffer.zero_()
            else:
                b.grad_buffer = None
        for p in self._params:
            p.grad = None
        self._grad_scale = self._unit_grad_scale()
        self._grad_norm = None
        self._unscaled_by_user = False

    def grad_buffer_view(self, param: Tensor) -> Tensor:
        """The gradient buffer of ``param`` (shape of ``param``, ``grad_sync_dtype``); needs
        ``contiguous_grad_buffer`` (the buckets are then views of one persistent flat buffer)."""
        if self._flat_grad is None:
            raise RuntimeError(f"{type(self).__name__}.grad_buffer_view needs contiguous_grad_buffer=True")
        pi = self._param_index.get(id(param))
        if pi is None:
            raise ValueError(f"{type(self).__name__}.grad_buffer_view: the param is not managed by this optimizer")
        f0 = self._fragments[pi][0]
        start = sum(b.size for b in self.buckets[:f0.bucket_id]) + f0.bucket_start
        return self._flat_grad[start:start + param.numel()].view_as(param)

    # ------------------------------------------------------------------------------ param sync

    def _local_param_out(self, b: Bucket) -> Tensor:
        """The local shard of bucket ``b``'s gather buffer (where the update writes the new params)."""
        if b.param_out is None:
            b.param_out = torch.zeros(b.size, dtype=self.param_sync_dtype, device=self.device)
        r = self.distributed_rank
        return b.param_out[r * b.shard_size:(r + 1) * b.shard_size]

    def _launch_param_sync(self) -> None:
        for b in reversed(self.buckets):  # forward uses the last bucket (first layers) first
            local = self._local_param_out(b)
            # NCCL gathers in place (the input is this rank's slice of the output); other backends get a copy
            src = local if self._inplace_gather else local.clone()
            b.param_work = all_gather_single(b.param_out, src, group=self.distributed_process_group, async_op=True)
            b.params_stale = True
        self._stale_buckets = len(self.buckets)

    def _sync_bucket(self, b: Bucket) -> None:
        """Wait for bucket ``b``'s all-gather and copy it into the params that are not views of it."""
        if b.param_work is not None:
            b.param_work.wait()
            b.param_work = None
        if not b.params_stale:
            return
        b.params_stale = False
        self._stale_buckets -= 1
        with torch.no_grad():
            for f in b.fragments:
                p = self._params[f.param_id]
                src = b.param_out[f.bucket_start:f.bucket_end]
                dst = p.detach().reshape(-1)[f.param_start:f.param_end]
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)
        if not self.contiguous_param_buffer:
            b.param_out = None

    def param_sync(self) -> None:
        """Finish the parameter all-gathers (launched by ``step()``) and copy the buckets into the params."""
        if not self._stale_buckets:
            return
        for b in reversed(self.buckets):
            self._sync_bucket(b)

    def _after_update(self) -> None:
        self._launch_param_sync()
        if not self.overlap_param_sync:
            self.param_sync()

    # ----------------------------------------------------------------------------------- norms

    def _local_frags_of(self, parameters: Iterable[Tensor] | None) -> list[Fragment]:
        if parameters is None:
            return self._local_frags
        ids = set()
        for p in parameters:
            pi = self._param_index.get(id(p))
            if pi is None:
                raise ValueError(f"{type(self).__name__}: a param in `parameters` is not managed by this optimizer")
            ids.add(pi)
        return [f for f in self._local_frags if f.param_id in ids]

    def _raw_grad_norm(self, parameters: Iterable[Tensor] | None = None, norm_type: float = 2.0) -> Tensor:
        """Norm of the synchronized gradients (before the pending scale): 0-dim fp32, all ranks equal."""
        norm_type = float(norm_type)
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"{type(self).__name__}: norm_type must be 2.0 or inf, got {norm_type!r}")
        self.grad_sync()
        frags = self._local_frags_of(parameters)
        pieces = [self.buckets[f.bucket_id].grad_shard[f.shard_start:f.shard_end] for f in frags]
        if norm_type == 2.0:
            acc = torch.zeros((), dtype=torch.float32, device=self.device)
            if pieces:
                acc = torch.stack([x.float().square().sum() for x in pieces]).sum()
            dist.all_reduce(acc, group=self.distributed_process_group)
            return acc.sqrt()
        acc = torch.zeros((), dtype=torch.float32, device=self.device)
        if pieces:
            acc = torch.stack([x.float().abs().amax() if x.numel() else acc for x in pieces]).amax()
        dist.all_reduce(acc, op=dist.ReduceOp.MAX, group=self.distributed_process_group)
        return acc

    def grad_norm(self, parameters: Iterable[Tensor] | None = None, norm_type: float = 2.0,
                  force: bool = False) -> Tensor:
        """Norm of the (unscaled, clipped so far) gradients over all ranks: a 0-dim fp32 tensor.

        Synchronizes gradients first. The full-model 2-norm is cached until the gradients change
        (``force`` recomputes it).
        """
        if parameters is not None or float(norm_type) != 2.0:
            return self._raw_grad_norm(parameters, norm_type) * self._grad_scale
        if force or self._grad_norm is None:
            self._grad_norm = self._raw_grad_norm()
        return self._grad_norm * self._grad_scale

    def clip_grad_norm(self, max_norm: float, parameters: Iterable[Tensor] | None = None,
                       norm_type: float = 2.0) -> Tensor:
        """Scale the gradients so their norm is at most ``max_norm`` (``torch.nn.utils.clip_grad_norm_``'s
        rule, coefficient ``max_norm / (norm + 1e-6)`` capped at 1); returns the norm before clipping.
        The scaling is applied lazily, inside the next step."""
        if parameters is not None:
            raise ValueError(f"{type(self).__name__}.clip_grad_norm clips all params together; "
                             "parameters must be None")
        norm = self.grad_norm(norm_type=norm_type)
        coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
        self._grad_scale = self._grad_scale * coef
        return norm

    def unscale_grads(self, inv_scale: Tensor, *args: Any) -> dict[torch.device, Tensor]:
        """Multiply the gradients by ``inv_scale`` (lazily; overflow is checked in ``step()``); for
        gradient scalers that call it instead of unscaling ``param.grad``."""
        self._grad_scale = self._grad_scale * inv_scale.reshape(()).to(self._grad_scale)
        self._unscaled_by_user = True
        return {self.device: torch.zeros(1, dtype=torch.float32, device=self.device)}

    # ------------------------------------------------------------------------------------ step

    def _begin(self, closure, grad_scaler):
        """Common start of ``step``: closure, sync, GradScaler; returns (loss, inv grad scale, noop flag)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.param_sync()
        self.grad_sync()
        self._fill_param_outs_from_params()  # a skipped update must gather the params unchanged
        scaler_state = None
        if grad_scaler is not None and grad_scaler.is_enabled():
            from torch.amp.grad_scaler import OptState

            scaler_state = grad_scaler._per_optimizer_states[id(self)]
            if scaler_state["stage"] is OptState.READY or not self._unscaled_by_user:
                self._grad_scale = self._grad_scale / grad_scaler._get_scale_async().reshape(()).float()
        elif getattr(self, "grad_scale", None) is not None:  # torch's attribute contract
            self._grad_scale = self._grad_scale / self.grad_scale.reshape(()).float()
        found_inf = None
        if scaler_state is not None or getattr(self, "grad_scale", None) is not None:
            # Any inf/NaN anywhere makes the global norm non-finite; all ranks see the same value.
            found_inf = torch.logical_not(torch.isfinite(self.grad_norm())).float().reshape(1)
            if scaler_state is not None:
                scaler_state["found_inf_per_device"] = {found_inf.device: found_inf}
        noop = torch.zeros(1, dtype=torch.int32, device=self.device) if found_inf is None else found_inf.to(torch.int32)
        return loss, self._grad_scale.reshape(1), noop, found_inf

    def _end(self) -> None:
        self._grad_norm = None  # the update unscaled the gradient shards in place
        self._grad_scale = self._unit_grad_scale()
        self._unscaled_by_user = False
        self._after_update()

    # -------------------------------------------------------------------------- local fragments

    def _group_frags(self) -> dict[int, list[Fragment]]:
        out: dict[int, list[Fragment]] = {}
        for f in self._local_frags:
            out.setdefault(f.group_id, []).append(f)
        return out

    def _master_views(self, frags: list[Fragment]) -> tuple[list[Tensor], Any]:
        """fp32 master fragments for the update and a function writing them back after it."""
        if self.store_params and not self.with_scaled_states:
            return [self.buckets[f.bucket_id].state["params"][f.shard_start:f.shard_end] for f in frags], None
        if self.store_params:  # scaled fp16 masters
            tmp = [self._load_scaled(self.buckets[f.bucket_id], "params", f) for f in frags]

            def back() -> None:
                for f, t in zip(frags, tmp):
                    self._store_scaled(self.buckets[f.bucket_id], "params", f, t)
            return tmp, back
        if self.store_param_remainders:
            rems = self._remainder_views(frags)
            tmp = [rem_master(self._frag_param(f), r) for f, r in zip(frags, rems)]

            def back() -> None:
                for f, t, r in zip(frags, tmp, rems):
                    hi, low = rem_split(t)
                    r.copy_(low)
                    # the gathered bf16 value must be the one the remainder was taken against
                    self._local_param_out(self.buckets[f.bucket_id])[f.shard_start:f.shard_end].copy_(hi)
            return tmp, back
        # no stored copy: start from the params themselves
        return [self._frag_param(f).to(self.dtype) for f in frags], None

    def _remainder_views(self, frags: list[Fragment]) -> list[Tensor]:
        """The int16 remainders of ``frags`` (``store_param_remainders``): with the bf16 values in the gather
        buffer's local shard they make the fp32 masters (``culmen.ops.multi_tensor.adam.rem_master``)."""
        return [self.buckets[f.bucket_id].state["param_remainders"][f.shard_start:f.shard_end] for f in frags]

    def _param_outs(self, frags: list[Fragment]) -> list[Tensor]:
        return [self._local_param_out(self.buckets[f.bucket_id])[f.shard_start:f.shard_end] for f in frags]

    def _state_views(self, frags: list[Fragment], name: str) -> tuple[list[Tensor], Any]:
        if not self.with_scaled_states:
            return [self.buckets[f.bucket_id].state[name][f.shard_start:f.shard_end] for f in frags], None
        tmp = [self._load_scaled(self.buckets[f.bucket_id], name, f) for f in frags]

        def back() -> None:
            for f, t in zip(frags, tmp):
                self._store_scaled(self.buckets[f.bucket_id], name, f, t)
        return tmp, back

    def _grad_views(self, frags: list[Fragment]) -> list[Tensor]:
        return [self.buckets[f.bucket_id].grad_shard[f.shard_start:f.shard_end] for f in frags]

    # ------------------------------------------------------------------------------ state dicts

    def _fill_param_outs_from_params(self) -> None:
        """Keep the gather buffers' local shards equal to the params (frozen fragments, skipped steps)."""
        for f in self._local_frags:
            dst = self._local_param_out(self.buckets[f.bucket_id])[f.shard_start:f.shard_end]
            src = self._frag_param(f)
            if dst.data_ptr() != src.data_ptr():  # params that are views of the gather buffer are in place
                dst.copy_(src)

    def _full_master(self, f: Fragment) -> Tensor:
        masters, _ = self._master_views([f])
        return masters[0].to(torch.float32)

    def _gathered_state(self, gather_on_root: bool) -> dict | None:
        """Format 2: per-param full tensors (independent of the number of ranks)."""
        self.param_sync()
        names = self._state_names
        per_param: dict[int, dict[str, Tensor]] = {}
        for pi, p in enumerate(self._params):
            per_param[pi] = {n: torch.zeros(p.numel(), dtype=torch.float32, device=self.device)
                             for n in names + ("param",)}
        for f in self._local_frags:
            b = self.buckets[f.bucket_id]
            st = per_param[f.param_id]
            for n in names:
                views, _ = self._state_views([f], n)
                st[n][f.local_start:f.local_end] = views[0].float()
            st["param"][f.local_start:f.local_end] = self._full_master(f)
            del b
        # Every element is owned by exactly one rank of the distributed group: a sum gathers them.
        flat = torch.cat([t for pi in range(len(self._params)) for t in per_param[pi].values()]) \
            if self._params else torch.zeros(0, device=self.device)
        root = dist.get_global_rank(self.distributed_process_group, 0) \
            if self.distributed_process_group is not dist.group.WORLD else 0
        if gather_on_root:
            dist.reduce(flat, root, group=self.distributed_process_group)
            if dist.get_rank(self.distributed_process_group) != 0:
                return None
        else:
            dist.all_reduce(flat, group=self.distributed_process_group)
        state: dict[int, dict[str, Tensor]] = {}
        off = 0
        for pi, p in enumerate(self._params):
            state[pi] = {}
            for n in names + ("param",):
                state[pi][n] = flat[off:off + p.numel()].view_as(p).cpu().clone()
                off += p.numel()
        return {"format": 2, "state": state, "param_groups": self._groups_for_save()}

    def _groups_for_save(self) -> list[dict]:
        out = []
        index = 0
        ids = {id(p): i for i, p in enumerate(self._params)}
        for g in self.param_groups:
            d = {k: (v.cpu().clone() if isinstance(v, Tensor) else v) for k, v in g.items() if k != "params"}
            d["params"] = [ids.get(id(p), -1 - index - k) for k, p in enumerate(g["params"])]
            index += len(g["params"])
            out.append(d)
        return out

    def _sharded_state(self) -> dict:
        """Format 1: this rank's shards as they are (same layout and ranks needed to load)."""
        self.param_sync()
        return {"format": 1, "param_groups": self._groups_for_save(),
                "layout": {"bucket_sizes": [b.size for b in self.buckets], "distributed_size": self.distributed_size,
                           "distributed_rank": self.distributed_rank,
                           "numels": [p.numel() for p in self._params]},
                "buckets": [{k: v.cpu().clone() for k, v in b.state.items()} for b in self.buckets]}

    def state_dict(self, *, state_dict_format: int | None = None, gather_on_root: bool | None = None) -> dict | None:
        """The optimizer state. Every rank must call it (it communicates).

        ``state_dict_format=2`` (default): full per-param tensors (``exp_avg`` ..., fp32 ``param``
        masters) keyed by param index, loadable on any number of ranks; with ``gather_on_root`` (default
        True) only rank 0 of the distributed group gets it (the others get ``None``), else every rank.
        ``state_dict_format=1``: this rank's shards as stored (load on the same world size and layout).
        """
        fmt = 2 if state_dict_format is None else state_dict_format
        if fmt == 1:
            return self._sharded_state()
        if fmt == 2:
            return self._gathered_state(True if gather_on_root is None else bool(gather_on_root))
        raise ValueError(f"{type(self).__name__}.state_dict: state_dict_format must be 1 or 2, got {fmt!r}")

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a dict of :meth:`state_dict` (format 2 on any world size, format 1 on the same layout)."""
        owner = type(self).__name__
        fmt = state_dict.get("format")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"{owner}.load_state_dict: {len(groups)} param groups saved, {len(self.param_groups)} "
                             "in this optimizer")
        for g, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v.to(self.device) if isinstance(v, Tensor) else v
        self.param_sync()
        with torch.no_grad():
            if fmt == 1:
                lay = state_dict["layout"]
                mine = {"bucket_sizes": [b.size for b in self.buckets], "distributed_size": self.distributed_size,
                        "distributed_rank": self.distributed_rank, "numels": [p.numel() for p in self._params]}
                if lay != mine:
                    raise ValueError(f"{owner}.load_state_dict: a format-1 (sharded) state dict needs the layout it "
                                     f"was saved with: saved {lay}, here {mine}; save with state_dict_format=2")
                for b, saved in zip(self.buckets, state_dict["buckets"]):
                    for k, v in saved.items():
                        b.state[k].copy_(v)
            elif fmt == 2:
                state = state_dict["state"]
                if len(state) != len(self._params):
                    raise ValueError(f"{owner}.load_state_dict: {len(state)} params saved, {len(self._params)} here")
                for f in self._local_frags:
                    b = self.buckets[f.bucket_id]
                    st = state[f.param_id]
                    for n in self._state_names:
                        val = st[n].reshape(-1)[f.local_start:f.local_end].to(self.device, torch.float32)
                        if self.with_scaled_states:
                            self._store_scaled(b, n, f, val)
                        else:
                            b.state[n][f.shard_start:f.shard_end].copy_(val)
                    master = st["param"].reshape(-1)[f.local_start:f.local_end].to(self.device, torch.float32)
                    if self.store_params:
                        if self.with_scaled_states:
                            self._store_scaled(b, "params", f, master)
                        else:
                            b.state["params"][f.shard_start:f.shard_end].copy_(master)
                    elif self.store_param_remainders:
                        bits = master.view(torch.int32).to(torch.int64)
                        hi = (bits + 0x8000) >> 16
                        rem = (bits - (hi << 16)).to(torch.int16)
                        b.state["param_remainders"][f.shard_start:f.shard_end].copy_(rem)
                        self._frag_param(f).copy_(hi.to(torch.int16).view(torch.bfloat16))
                    if not self.store_param_remainders:
                        self._frag_param(f).copy_(master)
                # params: every rank wrote its own fragments; gather the rest
                self._fill_param_outs_from_params()
                self._after_update()
            else:
                raise ValueError(f"{owner}.load_state_dict: unknown state dict format {fmt!r}")
