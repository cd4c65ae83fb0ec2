"""Launchers of the activation kernels: pick the 2-D view, allocate, choose blocks, launch.

Host cost decides the wall time of these ops: a bf16 fwd+bwd of 16384x4096 is ~0.2 ms on an H100, about
what one Python ``autograd.Function`` round trip costs on the lent GPU machines. So everything that
depends only on the call's geometry (shapes, strides, dtypes, flags, ``TUNING``) is computed once into a
plan (``_PLANS``): views, strides, grids, constexprs and one ``BoundLaunch`` per kernel, which calls the
compiled kernel directly after the first launch. A repeated call costs the plan lookup, its output
allocations and one ``CompiledKernel.run`` per kernel.

``TUNING`` holds the block rules so a sweep on the GPU can change them at run time (a change drops the
cached plans).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.activations.kernels import (
    _act_bwd_dbias_kernel,
    _act_bwd_kernel,
    _act_fwd_kernel,
    _dbias_sum_kernel,
    _glu_bwd_kernel,
    _glu_fwd_kernel,
    _relu_mask_bwd_dbias_kernel,
    _relu_mask_bwd_kernel,
    _relu_mask_fwd_kernel,
)
from culmen.ops.backend import device_guard, num_programs_hint
from culmen.ops.common.launch import BoundLaunch, FastLauncher, PlanTuning, cdiv, next_pow2, raw_stream

ACT_CODES: dict[str, int] = {
    "none": 0, "relu": 1, "sigmoid": 2, "gelu": 3, "gelu_tanh": 4, "sqrelu": 5, "silu": 6, "relu_ge0": 7,
}

_fwd = FastLauncher(_act_fwd_kernel)
_bwd = FastLauncher(_act_bwd_kernel)
_bwd_dbias = FastLauncher(_act_bwd_dbias_kernel)
_dbias_sum = FastLauncher(_dbias_sum_kernel)
_glu_fwd = FastLauncher(_glu_fwd_kernel)
_glu_bwd = FastLauncher(_glu_bwd_kernel)
_mask_fwd = FastLauncher(_relu_mask_fwd_kernel)
_mask_bwd = FastLauncher(_relu_mask_bwd_kernel)
_mask_bwd_dbias = FastLauncher(_relu_mask_bwd_dbias_kernel)


_PLANS: dict = {}
_MAX_PLANS = 1024

TUNING = PlanTuning({
    # Elements per program of the elementwise kernels, and their warps.
    "block_elems": 4096,
    "warps": 4,
    # Widest column block of a 2-D (per-row) launch; a flat launch uses block_elems.
    "max_block_n": 1024,
    # The bias-grad kernel: tile of one loop step, warps, programs per multiprocessor, and whether each
    # program loads its next tile before computing the current one. H100 sweep (bf16 tanh-GELU
    # backward, 8192x16384 / 16384x4096 / 8192x4096): 8x128 tiles with 8 warps were 9-16% faster than
    # 32x128 with 4 (0.292 / 0.154 / 0.083 ms; the same pass without the bias grad: 0.274 / 0.140 / 0.073).
    # Loading the next tile first measured 0.994x (geomean of 6 shapes): off.
    "dbias_block_m": 8,
    "dbias_block_n": 128,
    "dbias_warps": 8,
    "dbias_programs_per_sm": 8,
    "dbias_prefetch": False,
    # The final sum of the bias-grad partials (one program per column block).
    "dbias_sum_block_n": 256,
    "dbias_sum_block_s": 8,
}, _PLANS.clear)


def _empty(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> Tensor:
    """Every output buffer comes from here (tests swap in a NaN-poisoning version)."""
    return torch.empty(shape, device=device, dtype=dtype)


def _aligned(*ts: Tensor | None) -> bool:
    """Whether every given tensor's data pointer is 16-byte aligned (``None`` entries are skipped)."""
    bits = 0
    for t in ts:
        if t is not None:
            bits |= t.data_ptr()
    return bits & 15 == 0


def _plan(key: tuple, build, *args):
    """Build and cache the plan of ``key`` (callers try ``_PLANS.get(key)`` first)."""
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    plan = _PLANS[key] = build(*args)
    return plan


# ------------------------------------------------------------------------------------- geometry


def _row_layout(t: Tensor, N: int) -> tuple[bool, int]:
    """``(copy, row stride)`` of ``t`` seen as ``(M, N)`` rows with unit-stride columns: a view when the
    strides allow (``copy`` False), else a contiguous copy per call (row stride ``N``)."""
    try:
        v = t.view(-1, N)
    except RuntimeError:
        return True, N
    if v.stride(-1) != 1 and N > 1:
        return True, N
    return False, v.stride(0)


def _geometry(tensors: list[Tensor], per_column: bool) -> tuple[int, int, list[bool], list[int]]:
    """``(M, N, copies, row strides)`` of the views the kernels run on: one flat row when every operand
    is contiguous and nothing is indexed by column; rows of the last dim otherwise. A one-row launch
    gets row stride 0, which lets Triton's specialization prove 16-byte alignment."""
    if not per_column and all(t.is_contiguous() for t in tensors):
        return 1, tensors[0].numel(), [False] * len(tensors), [0] * len(tensors)
    N = tensors[0].shape[-1] if tensors[0].dim() > 0 else 1
    M = tensors[0].numel() // N
    layouts = [_row_layout(t, N) for t in tensors]
    strides = [s if M > 1 else 0 for _, s in layouts]
    return M, N, [c for c, _ in layouts], strides


def _as_rows(t: Tensor, copy: bool, N: int) -> Tensor:
    """``t`` as the kernels read it: itself (its data pointer is the view's), or a contiguous copy."""
    return t.reshape(-1, N).contiguous() if copy else t


def _blocks(M: int, N: int) -> tuple[int, int, int]:
    elems = TUNING["block_elems"]
    block_n = min(next_pow2(max(N, 1)), elems if M == 1 else TUNING["max_block_n"])
    block_m = max(1, min(elems // block_n, next_pow2(max(M, 1))))
    return block_m, block_n, cdiv(N, block_n)


def _warps(block_m: int, block_n: int) -> int:
    return max(1, min(TUNING["warps"], (block_m * block_n) // 256))


def _split_rows(M: int, ncb: int, block_m: int, dev: torch.device) -> tuple[int, int]:
    """``(splits, rows per split)`` of a bias-grad launch with ``ncb`` column blocks; every split has rows."""
    splits = max(1, min(cdiv(M, block_m), TUNING["dbias_programs_per_sm"] * num_programs_hint(dev) // ncb))
    rows_per_split = cdiv(M, splits)
    return cdiv(M, rows_per_split), rows_per_split


def _dbias_sum_launch(splits: int, N: int) -> tuple[BoundLaunch, tuple]:
    bn = min(TUNING["dbias_sum_block_n"], next_pow2(N))
    bs = min(TUNING["dbias_sum_block_s"], next_pow2(splits))
    return BoundLaunch(_dbias_sum, (cdiv(N, bn),), dict(BLOCK_S=bs, BLOCK_N=bn), 4), (splits, N)


# ---------------------------------------------------------------------------------- act forward


class _FwdPlan:
    __slots__ = ("copy", "N", "launch", "tail")

    def __init__(self, x: Tensor, has_bias: bool, act: str):
        M, N, (copy,), (sx,) = _geometry([x], has_bias)
        block_m, block_n, ncb = _blocks(M, N)
        self.copy, self.N = copy, N
        self.launch = BoundLaunch(_fwd, (cdiv(M, block_m) * ncb,),
                                  dict(ACT=ACT_CODES[act], HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=block_n),
                                  _warps(block_m, block_n))
        self.tail = (M, N, sx, N if M > 1 else 0, ncb)


def act_fwd(x: Tensor, bias: Tensor | None, act: str, out: Tensor | None = None) -> Tensor:
    """``act(x + bias)`` of ``x`` ``(..., N)``; ``bias`` ``(N,)`` or ``None``. Returns a contiguous tensor of
    ``x``'s shape and dtype (``out`` when given: contiguous, may be ``x`` itself for in-place)."""
    dev = x.device
    key = ("f", act, x.shape, x.stride(), x.dtype, None if bias is None else bias.dtype, dev)
    plan = _PLANS.get(key) or _plan(key, _FwdPlan, x, bias is not None, act)
    xa = _as_rows(x, True, plan.N) if plan.copy else x
    y = _empty(x.shape, dev, x.dtype) if out is None else out
    with device_guard(dev):
        plan.launch((xa, bias, y, *plan.tail), _aligned(xa, bias, y), raw_stream(dev))
    return y


# --------------------------------------------------------------------------------- act backward


class _BwdPlan:
    __slots__ = ("copy_g", "copy_x", "N", "launch", "tail", "part", "final")

    def __init__(self, g: Tensor, x: Tensor, has_bias: bool, act: str, from_output: bool, want_dbias: bool,
                 store_out: bool, dev: torch.device):
        M, N, (self.copy_g, self.copy_x), (sg, sx) = _geometry([g, x], has_bias or want_dbias)
        self.N = N
        so = N if M > 1 else 0  # dx and y are contiguous
        meta = dict(ACT=ACT_CODES[act], HAS_BIAS=has_bias, FROM_OUTPUT=from_output, STORE_OUT=store_out)
        self.part = self.final = None
        if want_dbias:
            block_m = TUNING["dbias_block_m"]
            block_n = min(TUNING["dbias_block_n"], next_pow2(N))
            ncb = cdiv(N, block_n)
            splits, rows_per_split = _split_rows(M, ncb, block_m, dev)
            self.launch = BoundLaunch(_bwd_dbias, (ncb, splits),
                                      dict(**meta, PREFETCH=TUNING["dbias_prefetch"], BLOCK_M=block_m,
                                           BLOCK_N=block_n), TUNING["dbias_warps"])
            self.tail = (M, N, sg, sx, so, so, rows_per_split)
            if splits > 1:  # fp32 partials, then one small summing kernel; else the kernel writes dbias
                self.part = (splits, N)
                self.final = _dbias_sum_launch(splits, N)
        else:
            block_m, block_n, ncb = _blocks(M, N)
            self.launch = BoundLaunch(_bwd, (cdiv(M, block_m) * ncb,), dict(**meta, BLOCK_M=block_m, BLOCK_N=block_n),
                                      _warps(block_m, block_n))
            self.tail = (M, N, sg, sx, so, so, ncb)


def act_bwd(g: Tensor, x: Tensor, bias: Tensor | None, act: str, from_output: bool, want_dbias: bool,
            dbias_dtype: torch.dtype, store_out: bool = False, out: Tensor | None = None
            ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Backward of ``act(x + bias)``: ``(dx, dbias, y)``.

    ``g`` and ``x`` ``(..., N)``; ``dx`` has ``x``'s shape and dtype (written into ``out`` when given: a
    contiguous tensor such as ``g`` itself). ``from_output``: ``x`` holds ``act``'s output (none / relu /
    sigmoid). ``want_dbias``: also the column sums of ``dx`` (fp32 accumulation) in ``dbias_dtype``.
    ``store_out``: also return ``y = act(x + bias)`` (recomputed for checkpointing). Absent results are
    ``None``.
    """
    dev = x.device
    key = ("b", act, x.shape, x.stride(), g.stride(), x.dtype, g.dtype, None if bias is None else bias.dtype,
           from_output, want_dbias, dbias_dtype, store_out, dev)
    plan = _PLANS.get(key) or _plan(key, _BwdPlan, g, x, bias is not None, act, from_output, want_dbias, store_out,
                                    dev)
    ga = _as_rows(g, True, plan.N) if plan.copy_g else g
    xa = _as_rows(x, True, plan.N) if plan.copy_x else x
    dx = _empty(x.shape, dev, x.dtype) if out is None else out
    y = _empty(x.shape, dev, x.dtype) if store_out else None
    dbias = _empty((plan.N,), dev, dbias_dtype) if want_dbias else None
    with device_guard(dev):
        stream = raw_stream(dev)
        if want_dbias:
            part = _empty(plan.part, dev, torch.float32) if plan.part is not None else dbias
            plan.launch((ga, xa, bias, dx, y, part, *plan.tail), _aligned(ga, xa, bias, dx, y, part), stream)
            if plan.final is not None:
                launch, tail = plan.final
                launch((part, dbias, *tail), _aligned(part, dbias), stream)
        else:
            plan.launch((ga, xa, bias, dx, y, *plan.tail), _aligned(ga, xa, bias, dx, y), stream)
    return dx, dbias, y


# ------------------------------------------------------------------------ ReLU with a bit mask


class _MaskFwdPlan:
    __slots__ = ("copy", "M", "N", "NB", "launch", "tail")

    def __init__(self, x: Tensor, has_bias: bool, act: str):
        M, N, (copy,), (sx,) = _geometry([x], has_bias)
        NB = cdiv(N, 8)
        elems = TUNING["block_elems"]
        block_b = min(next_pow2(NB), (elems if M == 1 else TUNING["max_block_n"]) // 8)
        block_m = max(1, min(elems // (8 * block_b), next_pow2(M)))
        nbb = cdiv(NB, block_b)
        self.copy, self.M, self.N, self.NB = copy, M, N, NB
        self.launch = BoundLaunch(_mask_fwd, (cdiv(M, block_m) * nbb,),
                                  dict(GE0=act == "relu_ge0", HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_B=block_b),
                                  _warps(block_m, 8 * block_b))
        self.tail = (M, N, NB, sx, N if M > 1 else 0, nbb)


def relu_mask_fwd(x: Tensor, bias: Tensor | None, act: str) -> tuple[Tensor, Tensor, tuple[int, int]]:
    """``relu(x + bias)`` and the bit mask its backward needs (``act``: ``relu``, or ``relu_ge0`` whose mask
    bit is ``x + bias >= 0``).

    Returns ``(y, mask, (M, N))``: ``y`` contiguous like ``x``; ``mask`` uint8 ``(M, cdiv(N, 8))``, the
    geometry ``(M, N)`` it was packed in (to pass to ``relu_mask_bwd``).
    """
    dev = x.device
    key = ("mf", act, x.shape, x.stride(), x.dtype, None if bias is None else bias.dtype, dev)
    plan = _PLANS.get(key) or _plan(key, _MaskFwdPlan, x, bias is not None, act)
    xa = _as_rows(x, True, plan.N) if plan.copy else x
    y = _empty(x.shape, dev, x.dtype)
    mask = _empty((plan.M, plan.NB), dev, torch.uint8)
    with device_guard(dev):
        plan.launch((xa, bias, y, mask, *plan.tail), _aligned(xa, bias, y), raw_stream(dev))
    return y, mask, (plan.M, plan.N)


class _MaskBwdPlan:
    __slots__ = ("copy", "N", "launch", "tail", "part", "final")

    def __init__(self, g: Tensor, M: int, N: int, want_dbias: bool, dev: torch.device):
        NB = cdiv(N, 8)
        copy, sg = _row_layout(g, N) if M > 1 else (not g.is_contiguous(), 0)
        self.copy, self.N = copy, N
        sg = sg if M > 1 else 0
        sdx = N if M > 1 else 0
        self.part = self.final = None
        if want_dbias:
            block_m = TUNING["dbias_block_m"]
            block_b = max(1, min(TUNING["dbias_block_n"] // 8, next_pow2(NB)))
            nbb = cdiv(NB, block_b)
            splits, rows_per_split = _split_rows(M, nbb, block_m, dev)
            self.launch = BoundLaunch(_mask_bwd_dbias, (nbb, splits),
                                      dict(PREFETCH=TUNING["dbias_prefetch"], BLOCK_M=block_m, BLOCK_B=block_b),
                                      TUNING["dbias_warps"])
            self.tail = (M, N, NB, sg, sdx, rows_per_split)
            if splits > 1:
                self.part = (splits, N)
                self.final = _dbias_sum_launch(splits, N)
        else:
            elems = TUNING["block_elems"]
            block_b = min(next_pow2(NB), (elems if M == 1 else TUNING["max_block_n"]) // 8)
            block_m = max(1, min(elems // (8 * block_b), next_pow2(M)))
            nbb = cdiv(NB, block_b)
            self.launch = BoundLaunch(_mask_bwd, (cdiv(M, block_m) * nbb,), dict(BLOCK_M=block_m, BLOCK_B=block_b),
                                      _warps(block_m, 8 * block_b))
            self.tail = (M, N, NB, sg, sdx, nbb)


def relu_mask_bwd(g: Tensor, mask: Tensor, geometry: tuple[int, int], dx_dtype: torch.dtype, want_dbias: bool,
                  dbias_dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """Backward of ``relu_mask_fwd``: ``(dx, dbias)``; ``dx`` contiguous of ``g``'s shape in ``dx_dtype``,
    ``dbias`` ``(N,)`` in ``dbias_dtype`` (fp32 accumulation) when ``want_dbias``, else ``None``."""
    M, N = geometry
    dev = g.device
    key = ("mb", g.shape, g.stride(), g.dtype, M, N, dx_dtype, want_dbias, dbias_dtype, dev)
    plan = _PLANS.get(key) or _plan(key, _MaskBwdPlan, g, M, N, want_dbias, dev)
    ga = g if not plan.copy else (_as_rows(g, True, N) if M > 1 else g.contiguous())
    dx = _empty(g.shape, dev, dx_dtype)
    dbias = _empty((N,), dev, dbias_dtype) if want_dbias else None
    with device_guard(dev):
        stream = raw_stream(dev)
        if want_dbias:
            part = _empty(plan.part, dev, torch.float32) if plan.part is not None else dbias
            plan.launch((ga, mask, dx, part, *plan.tail), _aligned(ga, mask, dx, part), stream)
            if plan.final is not None:
                launch, tail = plan.final
                launch((part, dbias, *tail), _aligned(part, dbias), stream)
        else:
            plan.launch((ga, mask, dx, *plan.tail), _aligned(ga, mask, dx), stream)
    return dx, dbias


# --------------------------------------------------------------------------------------- gated


class _GluPlan:
    __slots__ = ("copies", "N", "launch", "tail")

    def __init__(self, tensors: list[Tensor], act: str, fwd: bool):
        M, N, self.copies, strides = _geometry(tensors, False)
        self.N = N
        block_m, block_n, ncb = _blocks(M, N)
        so = N if M > 1 else 0
        meta = dict(ACT=ACT_CODES[act], BLOCK_M=block_m, BLOCK_N=block_n)
        grid = (cdiv(M, block_m) * ncb,)
        if fwd:
            self.launch = BoundLaunch(_glu_fwd, grid, meta, _warps(block_m, block_n))
            self.tail = (M, N, *strides, so, ncb)
        else:
            self.launch = BoundLaunch(_glu_bwd, grid, meta, _warps(block_m, block_n))
            self.tail = (M, N, *strides, so, so, ncb)


def glu_fwd(x: Tensor, u: Tensor, act: str) -> Tensor:
    """``act(x) * u`` of two ``(..., N)`` tensors of one shape; a contiguous result in ``x``'s dtype."""
    dev = x.device
    key = ("gf", act, x.shape, x.stride(), u.stride(), x.dtype, u.dtype, dev)
    plan = _PLANS.get(key) or _plan(key, _GluPlan, [x, u], act, True)
    cx, cu = plan.copies
    xa, ua = _as_rows(x, cx, plan.N), _as_rows(u, cu, plan.N)
    y = _empty(x.shape, dev, x.dtype)
    with device_guard(dev):
        plan.launch((xa, ua, y, *plan.tail), _aligned(xa, ua, y), raw_stream(dev))
    return y


def glu_bwd(g: Tensor, x: Tensor, u: Tensor, act: str) -> tuple[Tensor, Tensor]:
    """Backward of ``act(x) * u``: ``(dx, du)``, contiguous, in the dtypes of ``x`` and ``u``."""
    dev = x.device
    key = ("gb", act, x.shape, g.stride(), x.stride(), u.stride(), g.dtype, x.dtype, u.dtype, dev)
    plan = _PLANS.get(key) or _plan(key, _GluPlan, [g, x, u], act, False)
    cg, cx, cu = plan.copies
    N = plan.N
    ga, xa, ua = _as_rows(g, cg, N), _as_rows(x, cx, N), _as_rows(u, cu, N)
    dx = _empty(x.shape, dev, x.dtype)
    du = _empty(x.shape, dev, u.dtype)
    with device_guard(dev):
        plan.launch((ga, xa, ua, dx, du, *plan.tail), _aligned(ga, xa, ua, dx, du), raw_stream(dev))
    return dx, du
