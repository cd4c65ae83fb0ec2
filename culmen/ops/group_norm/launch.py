"""Call plans of GroupNorm: validate once, view the input as ``(N, C, L)``, pick kernel, tiles and chunks.

A ``GNPlan`` holds everything ``group_norm`` derives from one call signature (shapes, strides, dtypes and
devices of ``x``, ``weight``, ``bias``; groups, eps, activation): the checks passed, the kernel family,
the chunking and the bound ``Launch`` of the forward (and, per layout of the incoming gradient, of the
backward). A cached call then costs the output and workspace allocations and one launch per direction.

Any input whose spatial dims collapse into one stride is taken as it is (NCHW, channels-last, a batch
slice of either ...); ``spatial_strides`` says which, others are copied first. Channels-last inputs (unit
channel stride) with at most ``TUNING["max_block_c"]`` (padded) channels take the ``cl`` kernels (a chunk
= whole contiguous positions), everything else the ``rows`` kernels (a chunk = a block of one group). One
launch per direction: see ``kernels.py`` for the look-back schedule, whose counters live in a zeroed
buffer kept per (device, stream) that the kernels leave zeroed again; inside CUDA-graph capture and in
traced code (``torch.compile``) a fresh zeroed buffer is made per call instead.

Under ``torch.compile`` a plan is built from fake tensors whose batch size may be symbolic: the chunking
then follows the size hint (any batch size runs correctly with it), the channel count and spatial size
are specialized (they decide the tiles).
"""

from __future__ import annotations

import math
import operator

import torch
import triton.language as tl
from torch import Tensor

from culmen.ops.backend import choose_backend, num_programs_hint
from culmen.ops.common.launch import Launch, PlanTuning, cdiv, next_pow2, stream_getter
from culmen.ops.common.launch import aligned_16 as _aligned
from culmen.ops.common.launch import size_hint as _hint
from culmen.ops.common.plans import PlanCache, clear_plans
from culmen.ops.group_norm.kernels import (
    _gn_bwd_cl_kernel,
    _gn_bwd_rows_kernel,
    _gn_fwd_cl_kernel,
    _gn_fwd_rows_kernel,
)
from culmen.ops.group_norm.reference import spatial_strides, stats_dtype

TUNING = PlanTuning({
    # Per kernel family (rows: no prefix; channels-last: ``cl_``) and direction (backward: ``bwd_``):
    # elements of one tile (rows: BLOCK_D x BLOCK_L; cl: BLOCK_P positions x BLOCK_C channels), elements of one
    # chunk (one program's share of a row; chunks shrink, never below one tile, until there are
    # ``min_programs_per_sm`` programs per multiprocessor) and warps per program.
    # H100 sweep (2026-11-22, scripts/tune_group_norm.py --select over 4 shapes x 2 layouts, device time):
    # rows forward 2048-element tiles x 4 warps in 8192-element chunks, cl forward 4096 x 4 warps, cl backward
    # 4096 x 4 warps; the rest are the register-count defaults (ptxas, sm_90a, Triton 3.6: 3-5 resident
    # programs per multiprocessor; 4096 x 8 warps needs up to 170 registers in the cl backward: one program
    # per multiprocessor, which a waiting program would stall). The cl chunks are larger: a sample's last
    # chunk merges S x G partials while the sample's readers wait, so S is kept small.
    "tile": 2048,
    "chunk": 8192,
    "num_warps": 4,
    "bwd_tile": 2048,
    "bwd_chunk": 16384,
    "bwd_num_warps": 4,
    "cl_tile": 4096,
    "cl_chunk": 32768,
    "cl_num_warps": 4,
    "cl_bwd_tile": 4096,
    "cl_bwd_chunk": 32768,
    "cl_bwd_num_warps": 4,
    "min_programs_per_sm": 4,
    # Channels-last inputs take the cl kernels up to this many channels (padded to a power of two).
    "max_block_c": 4096,
    # The cl kernels regroup per-channel sums into groups with tl.gather (else a scratch round trip).
    "gather": True,
    # At most this many chunks per row (the row's last chunk merges all their partials, and its readers
    # wait for that merge).
    "max_chunks": 128,
    # Partials (chunks x groups) per step of that merge.
    "merge_block": 512,
    # The weight/bias-gradient tail (sums the per-sample partials): channels per tail program, samples per step.
    "tail_block_c": 64,
    "tail_block_r": 64,
}, clear_plans)

PLANS = PlanCache("group_norm")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ACTS = {None: False, "": False, "none": False, "silu": True, "swish": True}


def parse_act(act: str | None) -> bool:
    """``True`` for SiLU (``"silu"`` / ``"swish"``, any case), ``False`` for none (``None``, ``""``, ``"none"``)."""
    key = act.lower() if isinstance(act, str) else act
    try:
        return _ACTS[key]
    except (KeyError, TypeError):
        raise ValueError(f"group_norm: act must be None, '', 'silu' or 'swish', got {act!r}") from None


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _fold(itemsize: int, block_l: int) -> int:
    """Positions the rows kernels' accumulators fold: one thread's 16-byte vector of ``x``."""
    return max(1, min(block_l, 16 // itemsize))


def _even(total: int, size: int, unit: int) -> tuple[int, int]:
    """``(pieces, piece size)``: ``total`` cut into pieces of at most ``size`` (a multiple of ``unit``), evened out."""
    pieces = cdiv(total, size)
    size = cdiv(cdiv(total, pieces), unit) * unit
    return cdiv(total, size), size


def _target(total: int, chunk: int, tile: int, dev: torch.device) -> int:
    """Elements per chunk: ``chunk``, fewer when that leaves under ``min_programs_per_sm`` programs per SM."""
    want = TUNING["min_programs_per_sm"] * num_programs_hint(dev)
    return max(tile, min(chunk, total // max(want, 1)))


def rows_layout(N: int, G: int, D: int, L: int, tile: int, chunk: int, dev: torch.device
                ) -> tuple[int, int, int, int, int, int]:
    """``(BLOCK_D, BLOCK_L, Dc, Lc, S, Sl)`` of the rows kernels: tiles, chunk size (``Dc`` channels x ``Lc``
    positions), chunks per group ``S`` and position chunks ``Sl`` (``S = Sd * Sl``). ``N`` only sizes the
    chunks (any batch size runs correctly with them)."""
    bl = min(next_pow2(L), tile)
    bd = min(next_pow2(D), max(1, tile // bl))
    while bd > 1 and D % bd:  # a divisor of D: no half-masked channel blocks
        bd //= 2
    target = max(_target(N * G * D * L, chunk, bd * bl, dev), cdiv(D * L, TUNING["max_chunks"]))
    if D * bl <= target:  # every channel of the group, several position tiles
        dc, lc = D, bl * max(1, target // (D * bl))
    else:
        dc, lc = bd * max(1, target // (bd * bl)), bl
    sl, lc = _even(L, lc, bl)
    sd, dc = _even(D, dc, bd)
    return bd, bl, dc, lc, sd * sl, sl


def cl_layout(N: int, C: int, L: int, tile: int, chunk: int, dev: torch.device) -> tuple[int, int, int, int]:
    """``(BLOCK_P, BLOCK_C, Lc, S)`` of the cl kernels: tile, positions per chunk, chunks per sample."""
    bc = next_pow2(C)
    bp = min(max(1, tile // bc), next_pow2(L))
    lc = max(bp * max(1, _target(N * C * L, chunk, bp * C, dev) // (C * bp)), cdiv(L, TUNING["max_chunks"]))
    s, lc = _even(L, lc, bp)
    return bp, bc, lc, s


# ---------------------------------------------------------------------------------------------- counters

_COUNTERS: dict = {}


def _counters(dev: torch.device, stream, need: int) -> Tensor:
    """A zeroed int32 buffer of at least ``need`` counters for kernels on ``stream`` (they leave it zeroed)."""
    key = (dev, stream)
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= need:
        return buf
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(need, device=dev, dtype=torch.int32)  # the graph zeroes it at every replay
    buf = torch.zeros(max(need, 4096), device=dev, dtype=torch.int32)
    _COUNTERS[key] = buf
    return buf


# ----------------------------------------------------------------------------------------------- checks


def _check_param(name: str, t, C: int, dev: torch.device) -> bool:
    """Validate a ``weight`` / ``bias`` of ``C`` elements; returns whether it must be reshaped to a contiguous
    ``(C,)`` per call."""
    if t is None:
        return False
    if not isinstance(t, Tensor) or t.dtype not in _FLOATS:
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"group_norm: {name} must be a floating-point tensor, got {got}")
    if t.numel() != C:
        raise ValueError(f"group_norm: {name} must have num_channels = {C} elements, got shape {tuple(t.shape)}")
    if t.device != dev:
        raise ValueError(f"group_norm: {name} is on {t.device} but x on {dev}")
    return not (t.dim() == 1 and t.is_contiguous())


class GNPlan:
    """Everything ``group_norm`` derives from one call signature. Holds no tensors.

    Built from example arguments (real tensors in eager mode, fake ones under ``torch.compile``, where the
    batch size may be symbolic); valid for every call with the same signature. ``fix_x`` / ``fix_params``:
    the caller passes ``x.contiguous()`` / ``(C,)`` contiguous parameters (``params``), which the plan's
    geometry describes.
    """

    def __init__(self, x, num_groups, weight, bias, eps, act) -> None:
        if not isinstance(x, Tensor) or x.dtype not in _FLOATS:
            got = x.dtype if isinstance(x, Tensor) else type(x).__name__
            raise TypeError(f"group_norm: x must be a float16/bfloat16/float32/float64 tensor, got {got}")
        if x.dim() < 2:
            raise ValueError(f"group_norm: x must be (N, C, *spatial), got shape {tuple(x.shape)}")
        C = int(x.shape[1])
        try:
            G = operator.index(num_groups)
        except TypeError:
            raise TypeError(f"group_norm: num_groups must be an integer, got {type(num_groups).__name__}") from None
        if G <= 0 or C % G:
            raise ValueError(f"group_norm: num_groups must be positive and divide the {C} channels of x, got "
                             f"{num_groups}")
        try:
            eps_f = float(eps)
        except (TypeError, ValueError):
            raise TypeError(f"group_norm: eps must be a number, got {type(eps).__name__}") from None
        if eps_f < 0.0:
            raise ValueError(f"group_norm: eps must be non-negative, got {eps}")
        self.silu = parse_act(act)
        dev = x.device
        self.fix_w = _check_param("weight", weight, C, dev)
        self.fix_b = _check_param("bias", bias, C, dev)
        self.fix_params = self.fix_w or self.fix_b
        self.fix_x = spatial_strides(x) is None
        self.shape = x.shape
        self.N, self.C, self.G = x.shape[0], C, G
        self.D = C // G
        self.L = int(math.prod(x.shape[2:]))
        self.NG = self.N * G
        self.eps = eps_f
        self.device = dev
        self.stats = stats_dtype(x)
        self.has_w, self.has_b = weight is not None, bias is not None
        self.empty = self.N == 0 or self.L == 0
        self.use_kernel = choose_backend(dev) == "triton" and not self.empty
        self.stream = stream_getter(dev)
        self._cnt = (None, None, 0)  # (stream, counter buffer, its size) of the last eager launch
        self._bwd: dict = {}
        if self.use_kernel:
            # The copy of an x whose spatial dims do not collapse is contiguous: its strides from a meta tensor.
            self._plan_fwd(torch.empty(x.shape, dtype=x.dtype, device="meta") if self.fix_x else x)

    def params(self, weight, bias):
        """``(weight, bias)`` as contiguous ``(C,)`` tensors (differentiable reshapes, only when ``fix_params``)."""
        if self.fix_w:
            weight = weight.reshape(self.C).contiguous()
        if self.fix_b:
            bias = bias.reshape(self.C).contiguous()
        return weight, bias

    # ----------------------------------------------------------------------------------- layout
    def _use_cl(self, sx) -> bool:
        return sx[1] == 1 and self.L > 1 and next_pow2(self.C) <= TUNING["max_block_c"]

    def _geometry(self, sx, pre: str):
        """``(cl, meta, S, Sl, Lc, Dc, num_warps, BLOCK_C)`` of one direction's kernels (``pre``: ``""`` forward,
        ``"bwd_"`` backward): the kernel family, its constexprs and the chunking (``BLOCK_C`` 0 for rows)."""
        N, C, G, D, L = _hint(self.N), self.C, self.G, self.D, self.L
        dev = self.device
        cl = self._use_cl(sx)
        key = ("cl_" + pre) if cl else pre
        tile, chunk = TUNING[key + "tile"], TUNING[key + "chunk"]
        meta = {"D": D, "ACC": _acc(self.x_dtype)}
        if cl:
            bp, bc, lc, S = cl_layout(N, C, L, tile, chunk, dev)
            bg = next_pow2(G)
            meta.update(USE_GATHER=bool(TUNING["gather"]), BLOCK_P=bp, BLOCK_C=bc, BLOCK_G=bg, BLOCK_D=next_pow2(D),
                        BLOCK_M=max(1, min(next_pow2(S), TUNING["merge_block"] // bg)))
            return cl, meta, S, S, lc, D, TUNING[key + "num_warps"], bc
        bd, bl, dc, lc, S, sl = rows_layout(N, G, D, L, tile, chunk, dev)
        meta.update(BLOCK_D=bd, BLOCK_L=bl, FOLD=_fold(self.itemsize, bl), BLOCK_M=min(next_pow2(S),
                                                                                      TUNING["merge_block"]))
        return cl, meta, S, sl, lc, dc, TUNING[key + "num_warps"], 0

    def _plan_fwd(self, x: Tensor) -> None:
        self.x_dtype, self.itemsize = x.dtype, x.element_size()
        self.sx = sx = spatial_strides(x)
        # y = empty_like(x) (and dx in the backward): its strides, from a meta tensor (nothing allocated).
        self.sy = spatial_strides(torch.empty_like(x, device="meta"))
        N, G, C, L = self.N, self.G, self.C, self.L
        cl, meta, S, sl, lc, dc, nw, bc = self._geometry(sx, "")
        meta.update(HAS_W=self.has_w, HAS_B=self.has_b, SILU=self.silu)
        self.cl = cl
        if cl:
            rows = N
            part = N * S * G * 2 + (0 if meta["USE_GATHER"] else N * S * bc)
            self.fwd = Launch(_gn_fwd_cl_kernel, ((N + 1) * S,), meta, nw, device=self.device)
            self.fwd_ints = (N, G, C, L, lc, S, *sx, *self.sy)
        else:
            rows = N * G
            part = rows * S * 2
            self.fwd = Launch(_gn_fwd_rows_kernel, ((rows + 1) * S,), meta, nw, device=self.device)
            self.fwd_ints = (rows, G, L, lc, dc, sl, S, *sx, *self.sy)
        self.part_numel = part
        self.fwd_cnt = 2 + rows
        # The eager workspace: [mean (N G) | rstd (N G) | partials].
        self.ws_numel = 2 * self.NG + part

    def _plan_bwd(self, sd, need_dw: bool) -> _BwdPlan:
        N, G, C, L = self.N, self.G, self.C, self.L
        b = _BwdPlan()
        b.store_dw = store_dw = bool(need_dw and (self.has_w or self.has_b))
        cl, meta, S, sl, lc, dc, nw, bc = self._geometry(self.sx, "bwd_")
        meta.update(HAS_W=self.has_w, HAS_B=self.has_b, SILU=self.silu, STORE_DW=store_dw)
        if cl:
            rows, rw = N, N * S
            pc = N * S * G * 2 + N * G * 2 + (0 if meta["USE_GATHER"] else N * S * bc)
        else:
            rows, rw = N * G, N * sl
            pc = rows * S * 2 + rows * 2
        E = 0
        if store_dw:
            # the readers of a row each sum a slice of its partial rows: (partial rows, slice width)
            nrows, ncols = (S, C) if cl else (sl, self.D)
            bct = min(TUNING["tail_block_c"], next_pow2(C))
            E = cdiv(C, bct)
            meta.update(BLOCK_RR=next_pow2(nrows), BLOCK_CC=next_pow2(cdiv(ncols, S)),
                        BLOCK_R=min(TUNING["tail_block_r"], next_pow2(_hint(N))), BLOCK_CT=bct)
        else:
            meta.update(BLOCK_RR=1, BLOCK_CC=1, BLOCK_R=1, BLOCK_CT=1)
        b.ws_numel = (2 * (rw + N) * C if store_dw else 0) + pc
        b.cnt = 2 + rows
        grid = ((rows + 1) * S + E,)
        if cl:
            b.launch = Launch(_gn_bwd_cl_kernel, grid, meta, nw, device=self.device)
            b.ints = (N, G, C, L, lc, S, E)
        else:
            b.launch = Launch(_gn_bwd_rows_kernel, grid, meta, nw, device=self.device)
            b.ints = (rows, G, C, L, lc, dc, sl, S, E)
        b.fix_dy = sd is None
        # A dy whose spatial dims do not collapse is copied contiguous: (C L, L, 1).
        b.sd = (C * L, L, 1) if sd is None else sd
        return b

    # ------------------------------------------------------------------------------------ launches
    def counters(self, stream, need: int, traced: bool) -> Tensor:
        """The look-back counters for a launch on ``stream`` (a fresh zeroed buffer in traced code)."""
        if traced:
            return torch.zeros(need, device=self.device, dtype=torch.int32)
        last_stream, buf, size = self._cnt
        if stream == last_stream and size >= need:
            return buf
        if stream is None and self.device.type == "cuda":  # another device is current: Triton's own launch
            return _counters(self.device, torch.cuda.current_stream(self.device).cuda_stream, need)
        buf = _counters(self.device, stream, need)
        if _COUNTERS.get((self.device, stream)) is buf:  # not a one-off buffer of a CUDA-graph capture
            self._cnt = (stream, buf, buf.numel())
        return buf

    def forward(self, x: Tensor, weight, bias, traced: bool = False):
        """Launch the forward on ``x`` (``x.contiguous()`` when ``fix_x``) and ``(C,)`` parameters. Eager: returns
        ``(y, ws)``, ``ws = [mean (N G) | rstd (N G) | partials]`` in the statistics dtype. Traced: returns
        ``(y, mean, rstd)``, ``mean``/``rstd`` separate ``(N, G)`` tensors (custom-op outputs may not alias)."""
        dev = self.device
        y = torch.empty_like(x)
        w = weight if weight is not None else x  # never read (HAS_W / HAS_B are off)
        b = bias if bias is not None else x
        if traced:
            mean = torch.empty((self.N, self.G), device=dev, dtype=self.stats)
            rstd = torch.empty((self.N, self.G), device=dev, dtype=self.stats)
            part = torch.empty((self.part_numel,), device=dev, dtype=self.stats)
            cnt = self.counters(None, self.fwd_cnt, True)
            self.fwd.traced(x, y, w, b, mean, rstd, 0, part, 0, cnt, *self.fwd_ints, self.eps)
            return y, mean, rstd
        ws = torch.empty((self.ws_numel,), device=dev, dtype=self.stats)
        stream = self.stream()
        cnt = self.counters(stream, self.fwd_cnt, False)
        self.fwd(stream, _aligned(x, weight, bias), x, y, w, b, ws, ws, self.NG, ws, 2 * self.NG, cnt,
                 *self.fwd_ints, self.eps)
        return y, ws

    def backward(self, dy: Tensor, x: Tensor, weight, bias, mean: Tensor, rstd: Tensor, roff, need_dw: bool,
                 traced: bool = False):
        """``(dx, dweight, dbias)`` (``None`` without the parameter or without ``need_dw``); ``dx`` like ``x``,
        the parameter gradients in the parameters' dtypes. ``mean``/``rstd`` at offsets ``0``/``roff`` (the
        eager workspace: both ``ws``, ``roff = N G``)."""
        b = None if traced else self._bwd.get((dy.stride(), need_dw))
        if b is None:
            b = self._plan_bwd(spatial_strides(dy), need_dw)
            if not traced:
                self._bwd[dy.stride(), need_dw] = b
        if b.fix_dy:
            dy = dy.contiguous()
        dev = self.device
        dx = torch.empty_like(x)
        ws = torch.empty((b.ws_numel,), device=dev, dtype=self.stats)
        dw = torch.empty_like(weight) if (b.store_dw and weight is not None) else None
        db = torch.empty_like(bias) if (b.store_dw and bias is not None) else None
        stream = None if traced else self.stream()
        cnt = self.counters(stream, b.cnt, traced)
        args = (dy, x, dx, weight if weight is not None else x, bias if bias is not None else x, mean, rstd, roff,
                ws, cnt, dw if dw is not None else ws, db if db is not None else ws, *b.ints, *b.sd, *self.sx,
                *self.sy)
        if traced:
            b.launch.traced(*args)
        else:
            # The workspace of the autograd forward (roff != 0) is a fresh allocation: aligned.
            b.launch(stream, _aligned(dy, x, weight, bias, *((mean, rstd) if not roff else ())), *args)
        return dx, dw, db


class _BwdPlan:
    __slots__ = ("launch", "ints", "sd", "fix_dy", "store_dw", "ws_numel", "cnt")


