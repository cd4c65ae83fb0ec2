"""Shared pieces of the multi-tensor ops: cached call plans, launch tables and the Triton helpers that read them.

A multi-tensor op updates ``L`` lists of ``T`` tensors (``tensor_lists[l][t]``; tensors with the same
``t`` have the same number of elements) in **one launch per group** (a group is the set of indices
``t`` whose tensors share a device and a dtype per list). Each program of a launch handles one
*chunk*: ``CHUNK`` consecutive elements of one tensor. A program finds its data in two int64 device
tables of its group:

* the *geometry* ``[numels T | first chunk of each tensor T+1 | chunk -> tensor C | chunk -> index C]``,
  fixed by the tensors' sizes: built once per call signature;
* the *addresses* ``[list 0: T | list 1: T | ...]``, one table per set of data pointers seen (a fused
  optimizer whose gradients are re-allocated every step at the same few addresses reuses its tables;
  a new address set costs one small pinned host-to-device copy, no sync).

Addresses of 16-byte-aligned tensors are stored divided by 16 (``SHIFT=4``): multiplying back by a
constant tells Triton the pointer is aligned, so loads of full chunks vectorize to 128 bits. Element
offsets are ``chunk_index * CHUNK`` (int64, so tensors beyond 2^31 elements work) and only the last
chunk of a tensor is masked.

Call path (DESIGN.md): every amp_C entry point keys a ``PLANS`` entry by the call signature (list
lengths, per-tensor dtypes and sizes, contiguity, the first tensor's device, the op's flags); building
the plan runs every check and lays out the groups, a hit costs a few C-level passes over the tensors
(``map`` over ``data_ptr`` / ``numel`` / ``dtype``: no Python frame per tensor) and one launch per group.
"""

from __future__ import annotations

import operator
from itertools import chain

import numpy as np
import torch

from culmen.ops.common.launch import Launch, stream_getter
from culmen.ops.common.plans import PlanCache

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the reference path still works
    triton = None
    tl = None

PLANS = PlanCache("multi_tensor")


class _Generation(PlanCache):
    """Counts ``clear_plans`` calls: plans kept outside a ``PlanCache`` (a fused optimizer's per-group
    plans) compare the count they were built under, so a backend switch or a tuning change reaches them."""

    value = 0

    def clear(self) -> None:
        super().clear()
        self.value += 1


GENERATION = _Generation("multi_tensor.generation", maxsize=1)

# C-level accessors for ``map``: a pass over N tensors costs N C calls and no Python frame.
PTR = torch.Tensor.data_ptr
NUMEL = torch.Tensor.numel
CONTIG = torch.Tensor.is_contiguous
DTYPE = operator.attrgetter("dtype")

# Tables used while a CUDA graph was captured: the graph reads them at every replay, so they are
# kept alive for the life of the process even when their plan is dropped.
_CAPTURED: list = []
_PTR_TABLES_PER_PLAN = 16

# torch dtype -> the Triton element type the kernels cast table addresses to.
if tl is not None:
    TL_DTYPE = {
        torch.float32: tl.float32,
        torch.float16: tl.float16,
        torch.bfloat16: tl.bfloat16,
        torch.float64: tl.float64,
        torch.int32: tl.int32,
        torch.int16: tl.int16,
        torch.uint8: tl.uint8,
    }
else:  # pragma: no cover
    TL_DTYPE = {}


# ------------------------------------------------------------------------------------------- checks


def check_chunk(chunk_size, op: str) -> None:
    """Apex's ``chunk_size`` argument: a positive int (culmen picks its own chunking)."""
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"{op}: chunk_size must be a positive int, got {chunk_size!r}")


def check_lists(tensor_lists, num_lists: int | tuple[int, ...], op: str) -> int:
    """Validate the list-of-lists argument of an amp_C op; return the number of tensors per list."""
    if not isinstance(tensor_lists, (list, tuple)) or not all(isinstance(lst, (list, tuple)) for lst in tensor_lists):
        raise TypeError(f"{op}: tensor_lists must be a list of lists of tensors, got {type(tensor_lists).__name__}")
    allowed = (num_lists,) if isinstance(num_lists, int) else num_lists
    if len(tensor_lists) not in allowed:
        raise ValueError(f"{op}: expected {' or '.join(map(str, allowed))} tensor lists, got {len(tensor_lists)}")
    n = len(tensor_lists[0])
    for i, lst in enumerate(tensor_lists):
        if len(lst) != n:
            raise ValueError(f"{op}: tensor_lists[{i}] has {len(lst)} tensors but tensor_lists[0] has {n}")
        for t, x in enumerate(lst):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{op}: tensor_lists[{i}][{t}] must be a torch.Tensor, got {type(x).__name__}")
            if x.layout != torch.strided:
                raise RuntimeError(f"{op}: tensor_lists[{i}][{t}] is {x.layout}; only dense tensors are supported")
    return n


def check_sizes(tensor_lists, op: str) -> None:
    """Tensors at the same position of every list must have the same number of elements and device."""
    first = tensor_lists[0]
    numels = [x.numel() for x in first]
    devices = [x.device for x in first]
    for i, lst in enumerate(tensor_lists[1:], 1):
        if [x.numel() for x in lst] != numels:
            t = next(t for t, (a, b) in enumerate(zip(first, lst)) if a.numel() != b.numel())
            raise ValueError(f"{op}: tensor_lists[{i}][{t}] has {lst[t].numel()} elements but tensor_lists[0][{t}] "
                             f"has {first[t].numel()}")
        if [x.device for x in lst] != devices:
            t = next(t for t, (a, b) in enumerate(zip(first, lst)) if a.device != b.device)
            raise ValueError(f"{op}: tensor_lists[{i}][{t}] is on {lst[t].device} but tensor_lists[0][{t}] is on "
                             f"{first[t].device}")


def noop_pointer(noop_flag: torch.Tensor, op: str) -> torch.Tensor:
    """Check the noop flag argument: a one-element int32 tensor (Apex's convention) or a float ``found_inf``."""
    if not isinstance(noop_flag, torch.Tensor):
        raise TypeError(f"{op}: noop_flag must be a torch.Tensor, got {type(noop_flag).__name__}")
    if noop_flag.numel() < 1:
        raise ValueError(f"{op}: noop_flag must have at least one element")
    if noop_flag.dtype.is_complex:
        raise TypeError(f"{op}: noop_flag must be an int32 (or a real found_inf) tensor, got {noop_flag.dtype}")
    return noop_flag


def signature(tensor_lists) -> tuple[list, tuple]:
    """``(all tensors in list order, the part of a plan key that describes them)``: list lengths, every
    tensor's dtype and size, whether all are contiguous, the first tensor's device. C-level passes only;
    raises ``TypeError`` / ``AttributeError`` on malformed input (the plan's checks then explain it)."""
    flat = list(chain.from_iterable(tensor_lists))
    return flat, (tuple(map(len, tensor_lists)), tuple(map(DTYPE, flat)), tuple(map(NUMEL, flat)),
                  all(map(CONTIG, flat)), flat[0].device if flat else None)


def cached_plan(key, build):
    """The ``PLANS`` entry under ``key``, built by ``build()`` on a miss (``key`` ``None``: uncached)."""
    if key is None:
        return build()
    plan = PLANS.get(key)
    if plan is None:
        plan = PLANS.put(key, build())
    return plan


# --------------------------------------------------------------------------------------- tables


def _geometry(numels: np.ndarray, chunk: int) -> tuple[np.ndarray, int]:
    nchunks = (numels + chunk - 1) // chunk
    first = np.zeros(len(numels) + 1, dtype=np.int64)
    np.cumsum(nchunks, out=first[1:])
    c = int(first[-1])
    chunk_tensor = np.repeat(np.arange(len(numels), dtype=np.int64), nchunks)
    chunk_index = np.arange(c, dtype=np.int64) - np.repeat(first[:-1], nchunks)
    return np.concatenate([numels, first, chunk_tensor, chunk_index]), c


def upload(table: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``table`` (int64) on ``device``, and the pinned host buffer it was copied from.

    Pinned + ``non_blocking``: no host sync, and legal while a CUDA graph is captured (the copy becomes
    a graph node that reads the pinned buffer at every replay, hence the buffer lives with the table).
    """
    host = torch.from_numpy(np.ascontiguousarray(table, dtype=np.int64))
    if device.type != "cuda":
        return host.to(device), None
    pinned = host.pin_memory()
    return pinned.to(device, non_blocking=True), pinned


class Group:
    """One launch: the positions ``t`` it covers, its device and its geometry table."""

    __slots__ = ("device", "dtypes", "indices", "T", "C", "geo", "first", "pos", "stream", "_host")

    def __init__(self, device: torch.device, dtypes: tuple, indices: list[int] | None, numels: np.ndarray,
                 chunk: int) -> None:
        self.device = device
        self.dtypes = dtypes
        self.indices = indices  # None: every position, in order
        self.T = len(numels)
        geo, self.C = _geometry(numels, chunk)
        self.geo, self._host = upload(geo, device)
        self.first = self.geo[self.T:]  # first chunk of each tensor, for the per-tensor reductions
        self.pos = None if indices is None else torch.tensor(indices, dtype=torch.int64, device=device)
        self.stream = stream_getter(device)


class Tables:
    """Launch groups of one tensor-list signature, their geometry tables, and address tables per pointer set.

    ``static`` lists (a fused optimizer's params and states) have fixed addresses for the life of the
    tables (their owner rebuilds the tables when they change); the addresses of the other, *volatile*
    lists are the key of ``ptrs``.
    """

    def __init__(self, tensor_lists, chunk: int, static: tuple[int, ...] = ()) -> None:
        L, n = len(tensor_lists), len(tensor_lists[0])
        self.L, self.n = L, n
        self.volatile = tuple(i for i in range(L) if i not in static)
        self.devices = [x.device for x in tensor_lists[0]]
        dtypes = [[x.dtype for x in lst] for lst in tensor_lists]
        numels = np.fromiter(map(NUMEL, tensor_lists[0]), dtype=np.int64, count=n)
        devices = self.devices
        if all(d.count(d[0]) == n for d in dtypes) and devices.count(devices[0]) == n:
            parts = {(devices[0], tuple(d[0] for d in dtypes)): None}  # the common case: one group
        else:
            parts = {}
            for t in range(n):
                parts.setdefault((devices[t], tuple(d[t] for d in dtypes)), []).append(t)
        self.groups = [Group(dev, dts, idx, numels if idx is None else numels[idx], chunk)
                       for (dev, dts), idx in parts.items()]
        self.cuda = any(g.device.type == "cuda" for g in self.groups)
        self._static = np.zeros((L, n), dtype=np.int64)
        for i in static:
            self._static[i] = np.fromiter(map(PTR, tensor_lists[i]), dtype=np.int64, count=n)
        self._ptrs: dict = {}

    def ptrs(self, key: tuple, cache: bool = True) -> tuple:
        """``(address table, SHIFT)`` per group for the volatile lists' data pointers ``key`` (in list
        order). A new pointer set costs one host-to-device copy per group."""
        ent = self._ptrs.get(key)
        if ent is None:
            ent = self._build_ptrs(key)
            if cache:
                if len(self._ptrs) >= _PTR_TABLES_PER_PLAN:
                    self._ptrs.clear()
                self._ptrs[key] = ent
        if self.cuda and torch.cuda.is_current_stream_capturing():
            _CAPTURED.append((self, ent))
        return ent

    def _build_ptrs(self, key: tuple) -> tuple:
        addr = self._static.copy()
        if self.volatile:
            addr[list(self.volatile)] = np.fromiter(key, dtype=np.int64, count=len(key)).reshape(-1, self.n)
        out = []
        for g in self.groups:
            sub = addr if g.indices is None else addr[:, g.indices]
            shift = 0 if (sub & 15).any() else 4
            table, pinned = upload((sub >> shift).reshape(-1), g.device)
            out.append((table, shift, pinned))
        return tuple(out)

    def same_devices(self, tensor_lists) -> bool:
        """Whether the volatile lists' tensors are on this signature's devices (checked on a pointer-table
        miss: plan keys name only the first tensor's device)."""
        devs = self.devices
        return all([x.device for x in tensor_lists[i]] == devs for i in self.volatile)


def contiguous_copies(tensor_lists, written: tuple[int, ...]):
    """Contiguous stand-ins for non-contiguous tensors, and ``(copy, original)`` pairs: the original is
    written back by ``finish`` (``None`` for read-only lists: the pair only keeps the copy alive until the
    kernels that read it are launched)."""
    copy_back = []
    out = []
    for i, lst in enumerate(tensor_lists):
        if all(map(CONTIG, lst)):
            out.append(lst)
            continue
        new = list(lst)
        for t, x in enumerate(lst):
            if not x.is_contiguous():
                c = x.contiguous()
                new[t] = c
                copy_back.append((c, x if i in written else None))
        out.append(new)
    return out, copy_back


def finish(copy_back) -> None:
    """Write results computed in contiguous stand-ins back into the caller's non-contiguous tensors."""
    for c, x in copy_back:
        if x is not None:
            x.copy_(c)


class ListPlan:
    """What an amp_C op derives once per call signature: the checks passed, the backend, the launch
    groups and tables, and one bound ``Launch`` per (group, kernel, SHIFT).

    Subclasses add their own checks and ``meta(group, kernel)`` (the kernel's constexprs but SHIFT).
    """

    chunk = 8192
    num_warps = 8
    options: dict = {}  # Triton compile options of every launch (``Launch.options``)

    def __init__(self, op: str, tensor_lists, num_lists, written: tuple[int, ...], static: tuple[int, ...] = ()):
        self.op = op
        self.n = check_lists(tensor_lists, num_lists, op)
        self.num_lists = len(tensor_lists)
        self.written = written
        self.static = static
        if self.n:
            check_sizes(tensor_lists, op)
        from culmen.ops.backend import choose_backend

        # The kernels only where every device of the lists runs them (a list mixing CUDA and CPU tensors
        # takes the reference path: a Triton launch cannot address host memory).
        self.use_kernel = self.n > 0 and all(choose_backend(d) == "triton" for d in {x.device for x in tensor_lists[0]})
        self.contiguous = all(all(map(CONTIG, lst)) for lst in tensor_lists)
        self.tables = Tables(tensor_lists, self.chunk, static) if self.use_kernel else None
        self._la: dict = {}

    def single_group(self, device: torch.device | None = None) -> bool:
        """Whether the plan launches one group (on ``device`` when given)."""
        groups = self.tables.groups if self.tables is not None else ()
        return len(groups) == 1 and (device is None or groups[0].device == device)

    def launch(self, g: int, kernel, shift: int | None, grid: tuple | None = None, num_warps: int | None = None,
               variant=None) -> Launch:
        """The bound launch of ``kernel`` for group ``g``, ``SHIFT`` (``None``: the kernel has none) and the
        subclass's ``variant``, created on first use."""
        key = (g, kernel, shift, variant)
        la = self._la.get(key)
        if la is None:
            grp = self.tables.groups[g]
            meta = self.meta(grp, kernel, variant)
            if shift is not None:
                meta["SHIFT"] = shift
            la = self._la[key] = Launch(kernel, grid or (grp.C,), meta, num_warps or self.num_warps,
                                        device=grp.device, options=self.options)
        return la

    def meta(self, group: Group, kernel, variant) -> dict:  # pragma: no cover - every subclass defines it
        """The constexprs of ``kernel`` for ``group`` but ``SHIFT`` (a new dict)."""
        raise NotImplementedError

    def pointers(self, tensor_lists, flat=None) -> tuple[tuple, list]:
        """Address tables for this call's tensors (every list volatile) and the copy-back pairs of
        non-contiguous tensors (whose contiguous copies the kernels then address)."""
        if not self.contiguous:
            lists, copy_back = contiguous_copies(tensor_lists, self.written)
            return self.tables.ptrs(tuple(map(PTR, chain.from_iterable(lists))), cache=False), copy_back
        key = tuple(map(PTR, chain.from_iterable(tensor_lists) if flat is None else flat))
        if key not in self.tables._ptrs and not self.tables.same_devices(tensor_lists):
            # Plan keys name the first tensor's device only: the same sizes on other devices
            check_sizes(tensor_lists, self.op)
            tables = Tables(tensor_lists, self.chunk, self.static)
            from culmen.ops.backend import choose_backend

            bad = [g.device for g in tables.groups if choose_backend(g.device) != "triton"]
            if bad:
                raise RuntimeError(f"{self.op}: the tensors are on {bad[0]} (with others on "
                                   f"{tables.groups[0].device}), where these same tensor sizes ran the Triton "
                                   "kernels before; call the op once per device")
            self.tables = tables
            self._la.clear()
        return self.tables.ptrs(key), ()


def flag_on(noop_flag: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The noop flag as a kernel on ``device`` reads it (a copy when it lives on another device)."""
    return noop_flag if noop_flag.device == device else noop_flag.to(device)


class with_noop_on:
    """Context manager yielding an int32 noop flag on ``device``, merged back into ``noop_flag`` on exit.

    Kernels write the flag of their own device; when the caller's flag lives elsewhere (tensors on
    several devices) or has another dtype, a temporary is used and OR-ed back.
    """

    def __init__(self, noop_flag: torch.Tensor, device: torch.device):
        self.noop_flag = noop_flag
        self.device = device
        self.tmp = None

    def __enter__(self) -> torch.Tensor:
        f = self.noop_flag
        if f.device == self.device and f.dtype == torch.int32:
            return f
        self.tmp = f.reshape(-1)[:1].to(device=self.device, dtype=torch.int32)
        return self.tmp

    def __exit__(self, *exc) -> None:
        if self.tmp is not None and exc[0] is None:
            raised = self.tmp.to(self.noop_flag.device) != 0
            self.noop_flag.reshape(-1)[:1].masked_fill_(raised, 1)


# ---- shared by the pure-PyTorch references (tensor ops only, so no host sync on device flags)


def scalar_f32(x, device: torch.device) -> torch.Tensor:
    """A 0-dim fp32 tensor on ``device`` from a number or the first element of a tensor."""
    if isinstance(x, torch.Tensor):
        return x.reshape(-1)[0].to(device=device, dtype=torch.float32)
    return torch.tensor(float(x), dtype=torch.float32, device=device)


def ref_skip(noop_flag: torch.Tensor, device: torch.device, found_inf: torch.Tensor | None = None) -> torch.Tensor:
    """0-dim bool on ``device``: the update is skipped (noop flag, or ``found_inf``, non-zero)."""
    s = noop_flag.reshape(-1)[0].to(device) != 0
    if found_inf is not None:
        s = s | (found_inf.reshape(-1)[0].to(device).float() != 0)
    return s


def clear_cache() -> None:
    """Drop every cached multi-tensor plan and its tables (tests; or to free device memory)."""
    PLANS.clear()


if triton is not None:

    @triton.jit
    def chunk_coords(geo, T, C):
        """(tensor index, element offset of this program's chunk, tensor numel) for program_id(0)."""
        c = tl.program_id(0).to(tl.int64)
        base = 2 * T + 1
        t = tl.load(geo + base + c)
        j = tl.load(geo + base + C + c)
        n = tl.load(geo + t)
        return t, j, n

    @triton.jit
    def tensor_ptr(ptrs, T, t, i: tl.constexpr, DT: tl.constexpr, SHIFT: tl.constexpr):
        """Pointer (element type ``DT``) to tensor ``t`` of list ``i``; 16-byte aligned when SHIFT=4."""
        a = tl.load(ptrs + i * T + t)
        if SHIFT == 4:
            a = a * 16
        return a.to(tl.pointer_type(DT))

    @triton.jit
    def load_f32(ptr, offs, n, MASKED: tl.constexpr):
        if MASKED:
            return tl.load(ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        return tl.load(ptr + offs).to(tl.float32)

    @triton.jit
    def store(ptr, offs, n, x, MASKED: tl.constexpr):
        if MASKED:
            tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=offs < n)
        else:
            tl.store(ptr + offs, x.to(ptr.dtype.element_ty))

    @triton.jit
    def block_offsets(start, i, BLOCK: tl.constexpr):
        offs = start + i + tl.arange(0, BLOCK)
        return tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
