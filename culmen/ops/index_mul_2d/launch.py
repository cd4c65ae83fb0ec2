"""Call plans of ``index_mul_2d``: validate once, then allocate and launch.

An ``IndexMulPlan`` holds everything ``index_mul_2d`` derives from one call signature (shapes, strides,
dtypes and device of ``in1``, ``in2`` and the index): the checks passed, the per-call conversions still
needed (only for a feature dim that is not contiguous, or an index that is not a contiguous
int32/int64 vector), the blocks, grids and bound ``Launch`` of each kernel. A cached forward costs one
key, one dict lookup, one allocation and one launch. Row strides are kernel arguments: row-padded
views need no copy.

The gradient of ``in1`` is a scatter-add over repeated indices: the sorted segmented sum (a stable
sort of the indices, the start of each run, one kernel writing both gradients; bitwise reproducible)
or, with ``TUNING["scatter"] = "atomic"`` outside deterministic mode, fp32 atomics.
``TUNING`` holds the block rules so a sweep can change them at run time (every change drops the plans).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import check_values_on, choose_backend, deterministic_enabled
from culmen.ops.common.launch import Launch, PlanTuning, cdiv, next_pow2, stream_getter, traceable_kernels
from culmen.ops.common.plans import PlanCache, clear_plans
from culmen.ops.index_mul_2d.kernels import (
    _index_mul_2d_bwd_bwd_kernel,
    _index_mul_2d_bwd_kernel,
    _index_mul_2d_bwd_segment_kernel,
    _index_mul_2d_fwd_kernel,
)
from culmen.ops.index_mul_2d.reference import (
    index_mul_2d_bwd_bwd_ref,
    index_mul_2d_bwd_ref,
    index_mul_2d_fwd_ref,
)

TUNING = PlanTuning({
    # Elements of one (rows x features) tile, and the widest feature block.
    "tile": 4096,
    "max_block_f": 256,
    "num_warps": 4,
    # Cache hints of the forward (in1 kept in L2, in2 / out streamed).
    "fwd_hints": True,
    # Scatter of grad_in1: "segment" (sorted segmented sums, deterministic) or "atomic" (fp32 atomics,
    # only outside deterministic mode).
    "scatter": "segment",
    # Segmented sum: elements per (in1 rows x features) tile (the rows walk their index runs in
    # lockstep), widest feature block, warps.
    "segment_tile": 4096,
    "segment_block_f": 256,
    "segment_warps": 4,
}, clear_plans)

PLANS = PlanCache("index_mul_2d")

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_args(in1, in2, idx1) -> None:
    """The checks of ``index_mul_2d``'s arguments (errors name them)."""
    for name, t in (("in1", in1), ("in2", in2)):
        if not isinstance(t, Tensor) or t.dtype not in _FLOATS:
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(f"index_mul_2d: {name} must be a float16/bfloat16/float32/float64 tensor, got {got}")
    if in1.dtype != in2.dtype:
        raise TypeError(f"index_mul_2d: in1 and in2 must share a dtype, got {in1.dtype} and {in2.dtype}")
    if not isinstance(idx1, Tensor) or idx1.dtype.is_floating_point or idx1.dtype.is_complex or \
            idx1.dtype == torch.bool:
        got = idx1.dtype if isinstance(idx1, Tensor) else type(idx1).__name__
        raise TypeError(f"index_mul_2d: idx1 must be an integer tensor, got {got}")
    if in1.dim() != 2 or in2.dim() != 2:
        raise ValueError(f"index_mul_2d: in1 and in2 must be 2-D, got shapes {tuple(in1.shape)} and "
                         f"{tuple(in2.shape)}")
    if idx1.dim() != 1:
        raise ValueError(f"index_mul_2d: idx1 must be 1-D, got shape {tuple(idx1.shape)}")
    if in2.shape[0] != idx1.shape[0]:
        raise ValueError(f"index_mul_2d: in2 has {in2.shape[0]} rows but idx1 has {idx1.shape[0]} indices")
    if in1.shape[1] != in2.shape[1]:
        raise ValueError(f"index_mul_2d: in1 and in2 must have the same number of columns (no broadcast), got "
                         f"{in1.shape[1]} and {in2.shape[1]}")
    if not (in1.device == in2.device == idx1.device):
        raise ValueError(f"index_mul_2d: in1, in2 and idx1 must be on one device, got {in1.device}, {in2.device} "
                         f"and {idx1.device}")


def rows_ok(t: Tensor) -> bool:
    """Whether the kernels can read ``t`` (2-D) as it is: a contiguous feature dim, any row stride."""
    return (t.stride(1) == 1 or t.shape[1] <= 1) and t.stride(0) >= 0


def _acc_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _cap(n) -> int:
    # A symbolic size (torch.compile) takes no part in the block choice.
    return next_pow2(max(n, 1)) if isinstance(n, int) else 1 << 30


class IndexMulPlan:
    """Everything ``index_mul_2d`` derives from one call signature. Holds no tensors.

    Built from example tensors (real in eager mode, fake under ``torch.compile``: ``traced``, where the
    row counts may be symbolic).
    """

    __slots__ = ("M", "N", "F", "dtype", "device", "copy1", "copy2", "s1", "s2", "fix_idx", "check_values",
                 "use_kernel", "stream", "like", "acc", "fwd", "_bwd", "_seg", "_bwd_bwd", "atomic_ok", "grid", "meta",
                 "no_rows", "no_out", "no_gin1")

    def __init__(self, in1: Tensor, in2: Tensor, idx: Tensor, traced: bool = False) -> None:
        check_args(in1, in2, idx)
        self.M, self.F = in1.shape
        self.N = in2.shape[0]
        self.dtype, self.device = in2.dtype, in2.device
        self.copy1, self.copy2 = not rows_ok(in1), not rows_ok(in2)
        # Row strides of what the kernels read (a copy is contiguous).
        self.s1 = self.F if self.copy1 else in1.stride(0)
        self.s2 = self.F if self.copy2 else in2.stride(0)
        self.fix_idx = not (idx.dtype in (torch.int32, torch.int64) and idx.is_contiguous())
        self.stream = stream_getter(in2.device)
        # Values are checked where that costs no device sync (CPU tensors whose kernels really run), or
        # anywhere with ``set_check_values(True)``.
        self.check_values = not traced and (check_values_on() or (in2.device.type == "cpu" and self.stream() is None))
        self.use_kernel = choose_backend(in2.device) == "triton" and (not traced or traceable_kernels())
        self.like = not traced and in2.is_contiguous()
        self.acc = _acc_dtype(in2)
        self.atomic_ok = TUNING["scatter"] == "atomic"
        # Empty problems (known only for concrete sizes): no launch.
        static = isinstance(self.N, int) and isinstance(self.M, int)
        self.no_out = static and self.N * self.F == 0
        self.no_rows = static and self.N == 0
        self.no_gin1 = static and self.M * self.F == 0
        self._bwd: dict = {}
        self._seg: dict = {}
        self._bwd_bwd: dict = {}
        if self.use_kernel:
            bf = min(TUNING["max_block_f"], next_pow2(max(self.F, 1)))
            bn = max(1, min(TUNING["tile"] // bf, _cap(self.N)))
            self.grid = (cdiv(self.N, bn), cdiv(self.F, bf))
            self.meta = dict(ACC=self._tl_acc(), BLOCK_N=bn, BLOCK_F=bf)
            self.fwd = Launch(_index_mul_2d_fwd_kernel, self.grid, dict(self.meta, HINTS=TUNING["fwd_hints"]),
                              TUNING["num_warps"], device=self.device)

    def _tl_acc(self):
        import triton.language as tl

        return tl.float64 if self.acc == torch.float64 else tl.float32

    def prepare(self, in1: Tensor, in2: Tensor, idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The call's tensors as the kernels read them (converted only where the plan says so), after the
        value check of the index when it is on."""
        if self.copy1:
            in1 = in1.contiguous()
        if self.copy2:
            in2 = in2.contiguous()
        if self.fix_idx:
            idx = idx.contiguous() if idx.dtype in (torch.int32, torch.int64) else idx.to(torch.int64)
        if self.check_values and idx.numel():
            lo, hi = (int(v) for v in torch.aminmax(idx))
            if lo < 0 or hi >= self.M:
                raise ValueError(f"index_mul_2d: idx1 must be in [0, {self.M}) (the rows of in1), got values in "
                                 f"[{lo}, {hi}]")
        return in1, in2, idx

    def _stream(self, traced: bool):
        return None if traced else self.stream()

    def _go(self, la: Launch, traced: bool, args: tuple, *tensors) -> None:
        if traced:
            la.traced(*args)
            return
        p = 0
        for t in tensors:
            if t is not None:
                p |= t.data_ptr()
        la(self.stream(), p & 15 == 0, *args)

    # ------------------------------------------------------------------------------ forward
    def forward(self, in1: Tensor, in2: Tensor, idx: Tensor, traced: bool = False) -> Tensor:
        """``in1[idx] * in2``: ``(N, F)`` contiguous, in the inputs' dtype."""
        if not self.use_kernel:
            return index_mul_2d_fwd_ref(in1, in2, idx)
        out = torch.empty_like(in2) if self.like else torch.empty((self.N, self.F), dtype=self.dtype,
                                                                   device=self.device)
        if self.no_out:
            return out
        self._go(self.fwd, traced, (out, in1, in2, idx, self.N, self.M, self.F, self.F, self.s1, self.s2), in1, in2,
                 idx)
        return out

    # ----------------------------------------------------------------------------- backward
    def _sorted_segments(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        """Stable sort permutation of ``idx`` and the ``(M + 1,)`` start of each value's run. The sort key
        is int32 (half the radix passes of int64); int64 indices are clamped to ``[-1, M]`` first, so an
        out-of-range index stays out of range instead of wrapping around."""
        M = self.M
        key = idx
        if idx.dtype != torch.int32 and (not isinstance(M, int) or M < 2**31 - 1):
            key = idx.clamp(-1, M).to(torch.int32)
        vals, perm = torch.sort(key, stable=True)
        starts = torch.searchsorted(vals, torch.arange(M + 1, device=idx.device, dtype=vals.dtype))
        return perm, starts

    def _segment(self, need1: bool, need2: bool) -> Launch:
        la = self._seg.get((need1, need2))
        if la is None:
            bf = min(TUNING["segment_block_f"], next_pow2(max(self.F, 1)))
            bm = max(1, min(TUNING["segment_tile"] // bf, _cap(self.M)))
            la = self._seg[need1, need2] = Launch(
                _index_mul_2d_bwd_segment_kernel, (cdiv(self.M, bm), cdiv(self.F, bf)),
                dict(ACC=self.meta["ACC"], NEED_GIN1=need1, NEED_GIN2=need2, BLOCK_M=bm, BLOCK_F=bf),
                TUNING["segment_warps"], device=self.device)
        return la

    def segment_mul_add(self, a: Tensor, b: Tensor, idx: Tensor, out_dtype: torch.dtype,
                        traced: bool = False) -> Tensor:
        """``zeros(M, F).index_add_(0, idx, a * b)`` in ``out_dtype`` (``a``/``b`` ``(N, F)`` row-addressable),
        bitwise reproducible: each row adds its products in increasing ``n`` (fp32, fp64 for fp64)."""
        out = torch.empty((self.M, self.F), device=self.device, dtype=out_dtype)
        if self.no_gin1:
            return out
        if self.no_rows:
            return out.zero_()
        perm, starts = self._sorted_segments(idx)
        args = (out, None, a, b, b, perm, starts, self.N, self.M, self.F, self.F, 0, a.stride(0), b.stride(0),
                b.stride(0))
        self._go(self._segment(True, False), traced, args, a, b)
        return out

    def backward(self, gout: Tensor, in1: Tensor, in2: Tensor, idx: Tensor, need1: bool, need2: bool,
                 traced: bool = False) -> tuple[Tensor | None, Tensor | None]:
        """``(gin1, gin2)`` of ``out = in1[idx] * in2`` for ``gout`` ``(N, F)`` (row-addressable); ``None``
        where not needed. ``gin1`` by the sorted segmented sum unless the atomic scatter is chosen
        (``TUNING``) and deterministic mode is off."""
        if not self.use_kernel:
            return index_mul_2d_bwd_ref(gout, in1, in2, idx, need1, need2)
        if not gout.is_contiguous():  # our output's gradient: contiguous as a rule
            gout = gout.contiguous()
        N, M, F, dev = self.N, self.M, self.F, self.device
        gin2 = torch.empty_like(in2) if (need2 and self.like) else (
            torch.empty((N, F), device=dev, dtype=self.dtype) if need2 else None)
        sg2 = F if need2 else 0
        atomic = need1 and self.atomic_ok and not deterministic_enabled()
        if need1 and not atomic:
            # One pass writes both gradients (each gout / in2 / in1 row read once, gin1 written once).
            gin1 = torch.empty((M, F), device=dev, dtype=self.dtype)
            if self.no_gin1:
                return gin1, gin2
            if self.no_rows:
                return gin1.zero_(), gin2
            perm, starts = self._sorted_segments(idx)
            args = (gin1, gin2, gout, in1, in2, perm, starts, N, M, F, F, sg2, F, self.s1, self.s2)
            self._go(self._segment(True, need2), traced, args, gout, in1, in2)
            return gin1, gin2
        gin1 = torch.zeros((M, F), device=dev, dtype=self.acc) if atomic else None
        if (need2 or atomic) and not self.no_out:
            la = self._bwd.get((atomic, need1, need2))
            if la is None:
                la = self._bwd[atomic, need1, need2] = Launch(
                    _index_mul_2d_bwd_kernel, self.grid,
                    dict(self.meta, ATOMIC=atomic, NEED_GIN1=need1, NEED_GIN2=need2), TUNING["num_warps"], device=dev)
            args = (gin1, gin2, gout, in1, in2, idx, N, M, F, F if atomic else 0, sg2, F, self.s1, self.s2)
            self._go(la, traced, args, gout, in1, in2, idx)
        if atomic and gin1.dtype != self.dtype:
            gin1 = gin1.to(self.dtype)
        return gin1, gin2

    def backward_backward(self, gg1: Tensor | None, gg2: Tensor | None, gout: Tensor, in1: Tensor, in2: Tensor,
                          idx: Tensor, need_ggout: bool, need1: bool, need2: bool
                          ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """``(ggout, gin1, gin2)``: the double backward given the grads ``gg1`` / ``gg2`` of ``(gin1, gin2)``
        (row-addressable or ``None``: zeros); eager only."""
        if not self.use_kernel:
            return index_mul_2d_bwd_bwd_ref(gg1, gg2, gout, in1, in2, idx, need_ggout, need1, need2)
        gg1 = gg1 if gg1 is None or rows_ok(gg1) else gg1.contiguous()
        gg2 = gg2 if gg2 is None or rows_ok(gg2) else gg2.contiguous()
        if not rows_ok(gout):
            gout = gout.contiguous()
        N, M, F, dev = self.N, self.M, self.F, self.device
        ggout = torch.empty((N, F), device=dev, dtype=gout.dtype) if need_ggout else None
        gin2 = torch.empty((N, F), device=dev, dtype=self.dtype) if need2 else None
        scatter = need1 and gg2 is not None
        atomic = scatter and self.atomic_ok and not deterministic_enabled()
        gin1 = torch.zeros((M, F), device=dev, dtype=self.acc) if atomic else None
        if not self.no_out and (need_ggout or need2 or atomic):
            flags = (atomic, gg1 is not None, gg2 is not None, need_ggout, need1, need2)
            la = self._bwd_bwd.get(flags)
            if la is None:
                la = self._bwd_bwd[flags] = Launch(
                    _index_mul_2d_bwd_bwd_kernel, self.grid,
                    dict(self.meta, ATOMIC=atomic, HAS_GG1=flags[1], HAS_GG2=flags[2], NEED_GGOUT=need_ggout,
                         NEED_GIN1=need1, NEED_GIN2=need2), TUNING["num_warps"], device=dev)

            def s0(t):
                return t.stride(0) if t is not None else 0

            args = (ggout, gin1, gin2, gout, gg1, gg2, in1, in2, idx, N, M, F, s0(ggout), s0(gin1), s0(gin2),
                    gout.stride(0), s0(gg1), s0(gg2), self.s1, self.s2)
            self._go(la, False, args, gout, gg1, gg2, in1, in2, idx)
        if need1:
            if not scatter:
                gin1 = torch.zeros((M, F), device=dev, dtype=self.dtype)
            elif not atomic:
                gin1 = self.segment_mul_add(gg2, gout, idx, self.dtype)
            elif gin1.dtype != self.dtype:
                gin1 = gin1.to(self.dtype)
        return ggout, gin1, gin2


def index_mul_2d_bwd(gout: Tensor, in1: Tensor, in2: Tensor, idx: Tensor, need_gin1: bool, need_gin2: bool,
                     deterministic: bool) -> tuple[Tensor | None, Tensor | None]:
    """``(gin1, gin2)`` of ``out = in1[idx] * in2`` with an uncached plan (tests, sweeps): ``deterministic``
    forces the sorted segmented sum."""
    plan = IndexMulPlan(in1, in2, idx)
    plan.check_values = False  # tests pass out-of-range indices on purpose
    if deterministic:
        plan.atomic_ok = False
    return plan.backward(gout, *plan.prepare(in1, in2, idx), need_gin1, need_gin2)
