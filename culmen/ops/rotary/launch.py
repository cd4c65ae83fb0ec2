"""Call plans of the rotary embedding: validate once, then allocate and launch.

A ``RotaryPlan`` holds everything ``rotary`` derives from one call signature (shapes, strides, dtypes
and devices of x, the tables and the index tensors; the flags): the checks passed, how the kernel
addresses x (batch-first, seq-first, packed, or Q and K as two head groups), what to allocate, and the
bound ``Launch`` of the forward and of each backward gradient layout. A cached call costs: one key,
one dict lookup, one allocation, one launch.

``TUNING`` holds the tile rules so a sweep can change them at run time (every change drops the plans).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import choose_backend
from culmen.ops.common.launch import Launch, PlanTuning, cdiv, next_pow2, stream_getter
from culmen.ops.common.plans import PlanCache, clear_plans
from culmen.ops.rotary.kernels import _rotary_kernel
from culmen.ops.rotary.reference import rotary_fwd_ref

TUNING = PlanTuning({
    # Elements (of x) a program aims to rotate: several heads and positions per program amortize the
    # cos/sin loads and the index math.
    "elems": 4096,
    # Elements per thread before another warp is added, and the warp cap.
    "elems_per_thread": 8,
    "max_warps": 8,
}, clear_plans)

PLANS = PlanCache("rotary")

LAYOUTS = ("like", "contiguous", "swap01")
"""Output layouts: ``like`` = ``empty_like(x)``; ``contiguous`` in x's dim order; ``swap01``
contiguous with dims 0 and 1 swapped (Apex's sbhd output seen through a bshd view)."""

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTS = (torch.int32, torch.int64)


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def rotary_blocks(seqlen, nheads: int, half: int, rest: int) -> tuple[int, int, int, int, int]:
    """``(BLOCK_S, BLOCK_H, BLOCK_K, BLOCK_P, num_warps)`` for ``half`` pairs and ``rest`` copied columns.
    ``seqlen`` may be symbolic (``torch.compile`` with dynamic shapes): it then caps nothing."""
    block_k = next_pow2(half)
    block_p = next_pow2(rest)
    row = 2 * block_k + (block_p if rest > 0 else 0)
    target = TUNING["elems"]
    # tl.arange needs powers of two: a row of rest columns makes ``row`` odd-sized, so round down.
    block_h = min(next_pow2(nheads), _floor_pow2(max(1, target // row)))
    block_s = _floor_pow2(max(1, target // (row * block_h)))
    if isinstance(seqlen, int):
        block_s = min(next_pow2(seqlen), block_s)
    warps = next_pow2(block_s * block_h * row // (32 * TUNING["elems_per_thread"]))
    return block_s, block_h, block_k, block_p, max(1, min(TUNING["max_warps"], warps))


def _static(n) -> int:
    """A size the kernel specializes on (head count, head dim): a plain int, also under torch.compile."""
    return n if isinstance(n, int) else int(n)


# ------------------------------------------------------------------------------------------- checks


def _check_table(name: str, t, x: Tensor, table_dim: int) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.dim() < 2 or any(n != 1 for i, n in enumerate(t.shape[:-1]) if i != table_dim):
        raise ValueError(f"{name} must be 2-D (positions, columns), got shape {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def _check_pair(cname: str, sname: str, c, s, x: Tensor, table_dim: int) -> None:
    _check_table(cname, c, x, table_dim)
    _check_table(sname, s, x, table_dim)
    if c.shape != s.shape:
        raise ValueError(f"{cname} and {sname} must have the same shape, got {tuple(c.shape)} and {tuple(s.shape)}")


def _check_index(name: str, t: Tensor, n: int, x: Tensor) -> None:
    if t.dtype not in _INTS:
        raise TypeError(f"{name} must be an int32/int64 tensor, got {t.dtype}")
    if tuple(t.shape) != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def rotary_dim_of(W: int, full_table: bool, D: int) -> int:
    """The columns a ``(rows, W)`` cos/sin table rotates (``W`` with Apex's full tables, else ``2 W``), checked
    against the head dim ``D``."""
    if full_table and W % 2:
        raise ValueError(f"the rotary dim (cos.shape[1] = {W}) must be even")
    rotary_dim = W if full_table else 2 * W
    if rotary_dim > D:
        raise ValueError(f"rotary_dim ({rotary_dim}) must be <= headdim ({D})")
    return rotary_dim


def check_offset_rows(offset: int, S: int, rows: int) -> None:
    """Positions ``offset .. offset + S`` must be rows of the tables."""
    if offset < 0 or offset + S > rows:
        raise ValueError(f"positions seqlen_offsets + seqlen ({offset} + {S}) must lie within the {rows} rows of "
                         f"cos/sin")


def _contiguous_strides(shape) -> list:
    """Row-major strides of ``shape`` (as ``torch.empty`` gives them: empty dims count as 1)."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc = acc * (max(n, 1) if isinstance(n, int) else n)
    return out[::-1]


def _unit(t: Tensor | None) -> bool:
    """Whether the kernel can read ``t`` along its last dim with unit stride."""
    return t is None or t.shape[-1] <= 1 or t.stride(-1) == 1


class RotaryPlan:
    """Everything ``rotary`` derives from one call signature. Holds no tensors.

    Built from example arguments (real tensors in eager mode, fake ones under ``torch.compile``, where
    sizes may be symbolic); valid for every call with the same signature. Arguments as ``rotary``;
    ``cos2``/``sin2`` are the column tables of the 2-D form (``img_w > 0``) or else the tables of the
    K heads (group 1 of a 5-D x, or the heads from ``nheads_q`` on); ``table_dim`` is the dim of the
    tables that indexes positions (all their other dims but the last have size 1); ``round_ops`` rounds
    the tables, each product and the sum to x's dtype when it is fp16/bf16 (Apex's numerics; the
    default is fp32 math, flash_attn's).
    """

    def __init__(self, x, cos, sin, cos2=None, sin2=None, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None,
                 interleaved=False, inplace=False, conjugate=False, full_table=False, img_w=0, out_layout="like",
                 seq_first=False, nheads_q=None, table_dim=0, round_ops=False) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _FLOATS:
            raise TypeError(f"x must be a floating-point tensor (float16/bfloat16/float32/float64), got {x.dtype}")
        if out_layout not in LAYOUTS:
            raise ValueError(f"out_layout must be one of {LAYOUTS}, got {out_layout!r}")
        _check_pair("cos", "sin", cos, sin, x, table_dim)
        img_w = int(img_w)
        two_d = img_w > 0
        varlen = cu_seqlens is not None
        groups = x.dim() == 5 or (nheads_q is not None and cos2 is not None)
        if varlen:
            if seq_first:
                raise ValueError("seq_first does not apply to packed sequences (cu_seqlens)")
            if x.dim() != 3:
                raise ValueError(f"with cu_seqlens, x must be (total_seqlen, nheads, headdim), got shape "
                                 f"{tuple(x.shape)}")
            if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype not in _INTS or cu_seqlens.dim() != 1:
                raise TypeError(f"cu_seqlens must be a 1-D int32/int64 tensor, got "
                                f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}")
            if cu_seqlens.numel() < 1 or cu_seqlens.device != x.device:
                raise ValueError(f"cu_seqlens must hold batch + 1 >= 1 entries on {x.device}, got "
                                 f"{cu_seqlens.numel()} on {cu_seqlens.device}")
            if max_seqlen is None or max_seqlen < 0:
                raise ValueError(f"cu_seqlens needs max_seqlen (a non-negative int), got {max_seqlen!r}")
            B, S = cu_seqlens.shape[0] - 1, max_seqlen
            H = H2 = _static(x.shape[1])
        elif x.dim() == 5:
            if seq_first or two_d or x.shape[2] != 2:
                raise ValueError(f"a 5-D x must be (batch, seqlen, 2, nheads, headdim) (Q and K of a packed qkv), "
                                 f"got shape {tuple(x.shape)}")
            B, S = x.shape[0], x.shape[1]
            H = H2 = _static(x.shape[3])
        else:
            if x.dim() != 4:
                dims = "seqlen, batch" if seq_first else "batch, seqlen"
                raise ValueError(f"x must be ({dims}, nheads, headdim), got shape {tuple(x.shape)}")
            B, S = (x.shape[1], x.shape[0]) if seq_first else (x.shape[0], x.shape[1])
            H = H2 = _static(x.shape[2])
            if nheads_q is not None and not 0 < nheads_q < H:
                raise ValueError(f"nheads_q must lie in [1, nheads) = [1, {H}), got {nheads_q}")
            if groups:
                H, H2 = int(nheads_q), H - int(nheads_q)
        D = _static(x.shape[-1])
        W = _static(cos.shape[-1])
        full_table = bool(full_table)
        rotary_dim = rotary_dim_of(W, full_table, D)
        offs_t = seqlen_offsets if isinstance(seqlen_offsets, Tensor) else None
        if offs_t is not None:
            if offs_t.dtype not in _INTS:
                raise TypeError(f"seqlen_offsets must be an int or an int32/int64 tensor, got {offs_t.dtype}")
            if tuple(offs_t.shape) != (B,):
                raise ValueError(f"seqlen_offsets must have shape (batch,) = ({B},), got {tuple(offs_t.shape)}")
            if offs_t.device != x.device:
                raise ValueError(f"seqlen_offsets is on {offs_t.device} but x is on {x.device}")
        elif not isinstance(seqlen_offsets, (int, torch.SymInt)):
            int(seqlen_offsets)  # a TypeError naming the type for non-numbers
        if two_d:
            if cos2 is None or sin2 is None:
                raise ValueError("the 2-D form (img_w > 0) needs cos2 and sin2")
            _check_pair("cos2", "sin2", cos2, sin2, x, table_dim)
            if cos2.shape[-1] != W or 2 * rotary_dim != D:
                raise ValueError(f"the 2-D form rotates headdim/2 columns per axis: need cos/cos2 widths equal to "
                                 f"{D // 2 if full_table else D // 4}, got {W} and {cos2.shape[-1]}")
        elif cos2 is not None or sin2 is not None:
            if not groups:
                raise ValueError("cos_k/sin_k (the K heads' tables) need a 5-D x or nheads_q")
            if cos2 is None or sin2 is None:
                raise ValueError("cos_k and sin_k must be given together")
            _check_pair("cos_k", "sin_k", cos2, sin2, x, table_dim)
            if cos2.shape[-1] != W:
                raise ValueError(f"cos_k must have cos's width {W}, got {cos2.shape[-1]}")
        self.x_shape, self.dtype, self.device = x.shape, x.dtype, x.device
        self.B, self.S, self.table_dim = B, S, table_dim
        self.interleaved, self.conjugate, self.full_table = bool(interleaved), bool(conjugate), full_table
        self.round_ops = bool(round_ops) and x.dtype in (torch.float16, torch.bfloat16)
        self.inplace, self.layout, self.seq_first = bool(inplace), out_layout, bool(seq_first)
        self.img_w, self.varlen, self.groups = img_w, varlen, groups
        self.nheads = (H, H2)
        self.half = W // 2 if full_table else W
        self.D = D
        self.has_offsets = offs_t is not None
        # Checked per call: an int offset keeps every position inside the tables.
        self.rows = cos.shape[table_dim] if cos2 is None else min(cos.shape[table_dim], cos2.shape[table_dim])
        self.check_rows = not two_d and offs_t is None
        # Plain ints go to the kernel as they are; anything else (a bool, a NumPy integer) as ``int(...)``.
        self.cast_offset = offs_t is None and type(seqlen_offsets) is not int and not isinstance(
            seqlen_offsets, torch.SymInt)
        tables = (cos, sin, cos2, sin2)
        # The kernel reads one row stride for both tables of a pair, unit column strides and unit-stride
        # index vectors: anything else is copied per call (rare).
        self.fix_tables = not all(_unit(t) for t in tables) or cos.stride(table_dim) != sin.stride(table_dim) or (
            cos2 is not None and cos2.stride(table_dim) != sin2.stride(table_dim))
        self.fix_index = any(t is not None and t.shape[0] > 1 and t.stride(0) != 1 for t in (offs_t, cu_seqlens))
        self.fix = self.fix_tables or self.fix_index
        self.extra_ptrs = any(t is not None for t in (cos2, offs_t, cu_seqlens))
        # A new output: ``empty_like(x)`` when that is the layout asked for (the cheapest allocation),
        # else one strided allocation (contiguous in x's dim order, or with dims 0 and 1 swapped).
        shape = x.shape
        swapped = (shape[1], shape[0], *shape[2:]) if out_layout == "swap01" else shape
        strides = list(_contiguous_strides(swapped))
        if out_layout == "swap01":
            strides[0], strides[1] = strides[1], strides[0]
        self.out_strides = tuple(strides)
        self.alloc_like = out_layout == "like" or (out_layout == "contiguous" and x.is_contiguous())
        self.empty = x.numel() == 0
        self.use_kernel = choose_backend(x.device) == "triton" and x.dtype != torch.float64 and not self.empty
        self.stream = stream_getter(x.device)
        self._tab_ints = self._table_ints(cos, cos2)
        self._fwd = None
        self._bwd: dict = {}

    # --------------------------------------------------------------------------- per-call pieces
    def _table_ints(self, cos, cos2) -> tuple:
        td = self.table_dim
        rows2 = cos2.shape[td] if cos2 is not None else 0
        if self.fix_tables:  # contiguous copies: rows of W columns
            return cos.shape[td], rows2, cos.shape[-1], cos.shape[-1]
        return cos.shape[td], rows2, cos.stride(td), cos2.stride(td) if cos2 is not None else 0

    def fixed(self, tabs: tuple) -> tuple:
        """``tabs`` = ``(cos, sin, cos2, sin2, offsets, cu_seqlens)`` as the kernel reads them (only for
        plans with ``fix``: strided tables or index vectors)."""
        cos, sin, cos2, sin2, offs, cu = tabs
        if self.fix_tables:
            cos, sin = cos.contiguous(), sin.contiguous()
            if cos2 is not None:
                cos2, sin2 = cos2.contiguous(), sin2.contiguous()
        if self.fix_index:
            offs = offs.contiguous() if offs is not None else None
            cu = cu.contiguous() if cu is not None else None
        return cos, sin, cos2, sin2, offs, cu

    def check_offset(self, offset: int) -> None:
        check_offset_rows(offset, self.S, self.rows)

    def _strides(self, t: Tensor) -> tuple:
        """``(batch, seq, group, head, dim)`` strides of x or a tensor laid out like it, as the kernel sees it."""
        st = t.stride()
        if self.varlen:
            return 0, st[0], 0, st[1], st[2]
        if len(st) == 5:
            return st
        if self.seq_first:
            return st[1], st[0], 0, st[2], st[3]
        return st[0], st[1], self.nheads[0] * st[2] if self.groups else 0, st[2], st[3]

    def _launch(self, x: Tensor, out: Tensor, conjugate: bool, copy_rest: bool) -> tuple[Launch, tuple]:
        """The bound launch rotating ``x`` into ``out`` and its integer arguments."""
        H, H2 = self.nheads
        half, D, two_d = self.half, self.D, self.img_w > 0
        rest = 0 if (two_d or not copy_rest) else D - 2 * half
        bs, bh, bk, bp, warps = rotary_blocks(self.S, max(H, H2), half, rest)
        n_s, n_h = cdiv(self.S, bs), cdiv(H, bh)
        n_h2 = cdiv(H2, bh) if self.groups else 0
        rows, rows2, st, st2 = self._tab_ints
        total = x.shape[0] if self.varlen else 0
        ints = (self.S, total, H, H2, D, half, rows, rows2, self.img_w, n_s, n_h, n_h2, *self._strides(x),
                *self._strides(out), st, st2)
        meta = dict(INTERLEAVED=self.interleaved, FULL_TABLE=self.full_table, CONJUGATE=conjugate,
                    ROUND=self.round_ops, IS_VARLEN=self.varlen, HAS_OFFSETS=self.has_offsets, TWO_D=two_d,
                    HEAD_GROUPS=self.groups,
                    SPLIT_TABLES=self.groups and rows2 != 0, COPY_REST=rest > 0, BLOCK_S=bs, BLOCK_H=bh,
                    BLOCK_K=bk, BLOCK_P=bp)
        return Launch(_rotary_kernel, (self.B * n_s * (n_h + n_h2),), meta, warps, device=self.device), ints

    def _alloc(self, x: Tensor) -> Tensor:
        if self.alloc_like:
            return torch.empty_like(x)
        return torch.empty_strided(self.x_shape, self.out_strides, dtype=self.dtype, device=self.device)

    # ----------------------------------------------------------------------------------- passes
    def forward(self, x: Tensor, tabs: tuple, offset, traced: bool = False) -> Tensor:
        """Rotate ``x`` (into itself for an in-place plan, else into a new tensor in the plan's layout) and
        return the result. ``tabs`` = ``(cos, sin, cos2, sin2, offsets tensor or None, cu_seqlens)`` as the
        kernel reads them; ``offset`` the int position offset (0 with an offsets tensor)."""
        out = x if self.inplace else self._alloc(x)
        if self.empty:
            return out
        if not self.use_kernel:
            self._reference(x, out, tabs, offset, self.conjugate, not self.inplace)
            return out
        if traced:
            la, ints = self._launch(x, out, self.conjugate, not self.inplace)
            la.traced(x, out, *tabs, *ints, offset)
            return out
        fwd = self._fwd
        if fwd is None:
            fwd = self._fwd = self._launch(x, out, self.conjugate, not self.inplace)
        la, ints = fwd
        cos, sin, cos2, sin2, offs, cu = tabs
        bits = x.data_ptr() | cos.data_ptr() | sin.data_ptr()  # out is x or our own (aligned) allocation
        if self.extra_ptrs:
            for t in (cos2, sin2, offs, cu):
                if t is not None:
                    bits |= t.data_ptr()
        la(self.stream(), bits & 15 == 0, x, out, cos, sin, cos2, sin2, offs, cu, *ints, offset)
        return out

    def backward(self, dy: Tensor, tabs: tuple, offset, traced: bool = False) -> Tensor:
        """The gradient of x: the transposed rotation of ``dy`` into a new tensor (columns past the rotary
        ones copied), also for in-place plans."""
        dx = torch.empty_like(dy)
        if self.empty:
            return dx
        conjugate = not self.conjugate
        if not self.use_kernel:
            self._reference(dy, dx, tabs, offset, conjugate, True)
            return dx
        if traced:
            la, ints = self._launch(dy, dx, conjugate, True)
            la.traced(dy, dx, *tabs, *ints, offset)
            return dx
        key = dy.stride()
        bwd = self._bwd.get(key)
        if bwd is None:
            bwd = self._bwd[key] = self._launch(dy, dx, conjugate, True)
        la, ints = bwd
        cos, sin, cos2, sin2, offs, cu = tabs
        bits = dy.data_ptr() | cos.data_ptr() | sin.data_ptr()
        if self.extra_ptrs:
            for t in (cos2, sin2, offs, cu):
                if t is not None:
                    bits |= t.data_ptr()
        la(self.stream(), bits & 15 == 0, dy, dx, cos, sin, cos2, sin2, offs, cu, *ints, offset)
        return dx

    # -------------------------------------------------------------------------------- reference
    def _reference(self, x: Tensor, out: Tensor, tabs: tuple, offset, conjugate: bool, copy_rest: bool) -> None:
        """The PyTorch reference (CPU, fp64, ``reference`` backend; traceable by ``torch.compile``)."""
        cos, sin, cos2, sin2, offs, cu = tabs
        W = cos.shape[-1]
        cos, sin = cos.reshape(-1, W), sin.reshape(-1, W)
        if cos2 is not None:
            cos2, sin2 = cos2.reshape(-1, W), sin2.reshape(-1, W)
        if self.seq_first:
            x, out = x.transpose(0, 1), out.transpose(0, 1)
        S = self.S
        flags = (self.interleaved, conjugate, self.full_table)
        if not self.groups:
            rotary_fwd_ref(x, out, cos, sin, cos2, sin2, offs, cu, offset, S, *flags, self.img_w, copy_rest,
                           self.round_ops)
            return
        if x.dim() == 5:
            parts = [(x[:, :, g], out[:, :, g]) for g in range(2)]
        else:
            hq = self.nheads[0]
            parts = [(x[:, :, :hq], out[:, :, :hq]), (x[:, :, hq:], out[:, :, hq:])]
        for (xg, og), (c, s) in zip(parts, ((cos, sin), (cos2 if cos2 is not None else cos,
                                                        sin2 if sin2 is not None else sin))):
            rotary_fwd_ref(xg, og, c, s, None, None, offs, cu, offset, S, *flags, 0, copy_rest, self.round_ops)
