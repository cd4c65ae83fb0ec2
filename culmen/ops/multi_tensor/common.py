"""Shared pieces of the multi-tensor kernels: launch tables and the Triton helpers that read them.

A multi-tensor op updates ``L`` lists of ``T`` tensors (``tensor_lists[l][t]``; tensors with the same
``t`` have the same number of elements) in **one launch per group** (a group is the set of indices
``t`` whose tensors share a device and a dtype per list). Each program of the launch handles one
*chunk*: ``CHUNK`` consecutive elements of one tensor. What a program needs to find its data is in
one int64 device buffer, the *table*::

    [ addresses L*T | numels T | first chunk of each tensor T+1 | chunk -> tensor C | chunk -> index in tensor C ]

Addresses of 16-byte-aligned tensors are stored divided by 16 (``SHIFT=4``): multiplying back by a
constant tells Triton the pointer is aligned, so loads of full chunks vectorize to 128 bits. Element
offsets are ``chunk_index * CHUNK`` (int64, so tensors beyond 2^31 elements work) and only the last
chunk of a tensor is masked.

Tables are cached by (device, dtypes, addresses, sizes, chunk): an optimizer that steps the same
parameters reuses its table, copied to the device once, and a CUDA-graph capture after one eager
step replays it without any host work. A cache miss copies the table from pinned memory without
blocking.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from culmen.ops.backend import device_guard

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the reference path still works
    triton = None
    tl = None

_CACHE_SIZE = 64
_CACHE: OrderedDict = OrderedDict()
# Tables used while a CUDA graph is captured: the graph reads them at every replay, so they are
# never evicted (the LRU above may drop an entry; this keeps the memory alive).
_CAPTURED: dict = {}

# torch dtype -> the Triton element type the kernels cast table addresses to.
if tl is not None:
    TL_DTYPE = {
        torch.float32: tl.float32,
        torch.float16: tl.float16,
        torch.bfloat16: tl.bfloat16,
        torch.float64: tl.float64,
        torch.int32: tl.int32,
        torch.uint8: tl.uint8,
    }
else:  # pragma: no cover
    TL_DTYPE = {}


@dataclass
class Group:
    """One launch: the indices ``t`` it covers and its device table."""

    device: torch.device
    dtypes: tuple[torch.dtype, ...]
    indices: list[int]
    table: torch.Tensor
    num_tensors: int
    num_chunks: int
    shift: int
    tensor_lists: list[list[torch.Tensor]]  # the (contiguous) tensors the table points to


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
    return n


def check_sizes(tensor_lists, op: str) -> None:
    """Tensors at the same position of every list must have the same number of elements and device.

    Written with list comprehensions compared as whole lists: this runs on every optimizer step over
    every parameter, and per-element Python loops cost milliseconds for a few hundred tensors.
    """
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


def _contiguous(tensor_lists, written: tuple[int, ...]):
    """Contiguous stand-ins for non-contiguous tensors, and the (copy, original) pairs to write back."""
    copy_back = []
    out = []
    for i, lst in enumerate(tensor_lists):
        if all([x.is_contiguous() for x in lst]):
            out.append(lst)
            continue
        new = list(lst)
        for t, x in enumerate(lst):
            if not x.is_contiguous():
                c = x.contiguous()
                new[t] = c
                if i in written:
                    copy_back.append((c, x))
        out.append(new)
    return out, copy_back


def _build_table(ptrs: np.ndarray, numels: np.ndarray, chunk: int, shift: int) -> tuple[np.ndarray, int]:
    nchunks = (numels + chunk - 1) // chunk
    first = np.zeros(len(numels) + 1, dtype=np.int64)
    np.cumsum(nchunks, out=first[1:])
    c = int(first[-1])
    chunk_tensor = np.repeat(np.arange(len(numels), dtype=np.int64), nchunks)
    chunk_index = np.arange(c, dtype=np.int64) - np.repeat(first[:-1], nchunks)
    table = np.concatenate([(ptrs >> shift).reshape(-1), numels, first, chunk_tensor, chunk_index])
    return table, c


def _upload(table: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The table on ``device``, and the pinned host buffer it was copied from (kept alive with it)."""
    host = torch.from_numpy(table)
    if device.type != "cuda":
        return host.to(device), None
    # Pinned + non_blocking: no host sync, and legal while a CUDA graph is being captured (the copy is
    # captured as a node that reads this buffer at every replay, hence it lives as long as the entry).
    pinned = torch.empty(host.shape, dtype=torch.int64, pin_memory=True)
    pinned.copy_(host)
    with device_guard(device):
        dev = pinned.to(device, non_blocking=True)
    return dev, pinned


def plan(tensor_lists, written: tuple[int, ...], chunk: int, op: str) -> tuple[list[Group], list]:
    """Split ``tensor_lists`` into launch groups with device tables.

    Returns the groups and the (contiguous copy, original) pairs that the caller must copy back after
    launching (non-contiguous tensors of the lists in ``written``). Zero-element tensors are kept in
    the tables (they own no chunk) so per-tensor outputs keep their positions.
    """
    lists, copy_back = _contiguous(tensor_lists, written)
    dtypes = [[x.dtype for x in lst] for lst in lists]
    devices = [x.device for x in lists[0]]
    if all(d.count(d[0]) == len(d) for d in dtypes) and devices.count(devices[0]) == len(devices):
        parts = {(devices[0], tuple(d[0] for d in dtypes)): None}  # the common case: one group, no re-listing
    else:
        parts = {}
        for t in range(len(devices)):
            parts.setdefault((devices[t], tuple(d[t] for d in dtypes)), []).append(t)
    groups = []
    for (device, gdtypes), idx in parts.items():
        glists = lists if idx is None else [[lst[t] for t in idx] for lst in lists]
        ptrs = tuple([x.data_ptr() for lst in glists for x in lst])
        numels = tuple([x.numel() for x in glists[0]])
        key = (device, gdtypes, chunk, ptrs, numels)
        entry = _CACHE.get(key)
        if entry is None:
            p = np.asarray(ptrs, dtype=np.int64)
            shift = 4 if not (p & 15).any() else 0
            table, c = _build_table(p, np.asarray(numels, dtype=np.int64), chunk, shift)
            dev_table, pinned = _upload(table, device)
            entry = (dev_table, c, shift, pinned)
            _CACHE[key] = entry
            if len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
        else:
            _CACHE.move_to_end(key)
        if device.type == "cuda" and key not in _CAPTURED and torch.cuda.is_current_stream_capturing():
            _CAPTURED[key] = entry
        dev_table, c, shift, _ = entry
        indices = list(range(len(devices))) if idx is None else idx
        groups.append(Group(device, gdtypes, indices, dev_table, len(indices), c, shift, glists))
    return groups, copy_back


def finish(copy_back) -> None:
    """Write results computed in contiguous stand-ins back into the caller's non-contiguous tensors."""
    for c, x in copy_back:
        x.copy_(c)


def flag_on(noop_flag: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The noop flag as a kernel on ``device`` reads it (a copy when it lives on another device)."""
    return noop_flag if noop_flag.device == device else noop_flag.to(device)


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


def bias_corrections(beta1: float, beta2: float, step, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(1 - beta1^step, 1 - beta2^step)``: in fp32 on the device for a tensor ``step`` (as the kernels
    compute them), in double on the host for a number (as the launchers pass them)."""
    if isinstance(step, torch.Tensor):
        s = step.reshape(-1)[0].to(device=device, dtype=torch.float32)
        b1 = torch.tensor(beta1, dtype=torch.float32, device=device)
        b2 = torch.tensor(beta2, dtype=torch.float32, device=device)
        return 1.0 - torch.pow(b1, s), 1.0 - torch.pow(b2, s)
    return scalar_f32(1.0 - beta1 ** step, device), scalar_f32(1.0 - beta2 ** step, device)


def clear_cache() -> None:
    """Drop every cached launch table (tests; or to free device memory)."""
    _CACHE.clear()


def noop_pointer(noop_flag: torch.Tensor, op: str) -> torch.Tensor:
    """Check the noop flag argument: a one-element int32 tensor (Apex's convention) or a float ``found_inf``."""
    if not isinstance(noop_flag, torch.Tensor):
        raise TypeError(f"{op}: noop_flag must be a torch.Tensor, got {type(noop_flag).__name__}")
    if noop_flag.numel() < 1:
        raise ValueError(f"{op}: noop_flag must have at least one element")
    if noop_flag.dtype.is_complex:
        raise TypeError(f"{op}: noop_flag must be an int32 (or a real found_inf) tensor, got {noop_flag.dtype}")
    return noop_flag


if triton is not None:

    @triton.jit
    def chunk_coords(table, T, C, L: tl.constexpr):
        """(tensor index, element offset of this program's chunk, tensor numel) for program_id(0)."""
        c = tl.program_id(0).to(tl.int64)
        base = L * T + 2 * T + 1
        t = tl.load(table + base + c)
        j = tl.load(table + base + C + c)
        n = tl.load(table + L * T + t)
        return t, j, n

    @triton.jit
    def tensor_ptr(table, T, t, i: tl.constexpr, DT: tl.constexpr, SHIFT: tl.constexpr):
        """Pointer (element type ``DT``) to tensor ``t`` of list ``i``; 16-byte aligned when SHIFT=4."""
        a = tl.load(table + i * T + t)
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


def launch_group(launcher, group: Group, args: tuple, meta: dict, num_warps: int) -> None:
    """Launch one program per chunk of ``group`` (nothing when it has no chunk)."""
    if group.num_chunks == 0:
        return
    with device_guard(group.device):
        launcher((group.num_chunks,), args, meta, num_warps=num_warps)


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
