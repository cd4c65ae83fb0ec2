"""Call plans of the fused add + LayerNorm / RMSNorm op: validate once, then allocate and launch.

A ``NormPlan`` holds everything ``layer_norm`` derives from one call signature (shapes, strides,
dtypes, device, flags, scalars): the checks passed, how each input is addressed as ``(M, N)`` rows,
what to allocate, and the bound ``Launch`` of every kernel of the forward and the backward. A cached
call costs: one key, one dict lookup, one allocation per output, one launch (two in the backward).

The block-size rules were set by sweeps on an H100 (``bench/notes/layer_norm.md``); ``TUNING`` holds
them so a sweep can change them at run time (every change drops the cached plans).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from culmen.ops.backend import choose_backend, num_programs_hint
from culmen.ops.common.launch import Launch, PlanTuning, cdiv, next_pow2, row_stride, stream_getter, warps_for
from culmen.ops.common.launch import aligned_16 as _aligned
from culmen.ops.common.plans import PlanCache, clear_plans
from culmen.ops.layer_norm.kernels import (
    _layer_norm_bwd_chunked_kernel,
    _layer_norm_bwd_dw_kernel,
    _layer_norm_bwd_kernel,
    _layer_norm_dw_finish_kernel,
    _layer_norm_fwd_chunked_kernel,
    _layer_norm_fwd_kernel,
)

TUNING = PlanTuning({
    # Largest row (elements) a forward program keeps in registers; longer rows are chunked.
    "fwd_max_resident": 16384,
    # Same for the backward, whose dW/dB accumulators also live in registers.
    "bwd_max_resident": 8192,
    # Elements per program the row-resident kernels aim for (several short rows per program).
    "fwd_elems": 4096,
    "bwd_elems": 4096,
    # Chunk width of the chunked kernels.
    "chunk": 4096,
    # Elements per thread before another warp is added.
    "elems_per_thread": 16,
    "max_warps": 16,
    # Persistent backward programs per multiprocessor.
    "bwd_programs_per_sm": 2,
}, clear_plans)

PLANS = PlanCache("layer_norm")
_F32 = torch.float32
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _warps(elems: int) -> int:
    return warps_for(elems, TUNING["elems_per_thread"], TUNING["max_warps"])


def _row_blocks(N: int, M, target: int) -> tuple[int, int]:
    block_n = next_pow2(N)
    cap = next_pow2(M) if isinstance(M, int) else 64  # a symbolic M (torch.compile) takes no part
    return max(1, min(target // block_n, 64, cap)), block_n


def _check_float(name: str, t: Tensor | None) -> None:
    if t is not None and t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be a floating-point tensor (float16/bfloat16/float32/float64), got {t.dtype}")


def _check_like(name: str, t: Tensor | None, x: Tensor) -> None:
    if t is None:
        return
    if t.shape != x.shape:
        raise ValueError(f"{name} must have the shape of x {tuple(x.shape)}, got {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def _check_vec(name: str, t: Tensor | None, N: int, x: Tensor) -> None:
    if t is None:
        return
    if t.numel() != N:
        raise ValueError(f"{name} must have {N} elements (the normalized size), got shape {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


class NormPlan:
    """Everything ``layer_norm`` derives from one call signature. Holds no tensors.

    Built from example arguments (real tensors in eager mode, fake ones under ``torch.compile``, where
    ``M`` may be symbolic); valid for every call with the same signature.
    """

    def __init__(self, x, weight, bias, residual, x1, weight1, bias1, rowscale, eps, dropout_p, is_rms_norm,
                 zero_centered_weight, residual_in_fp32, out_dtype, return_residual, return_dropout_mask,
                 memory_efficient) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        for name, t in (("x", x), ("weight", weight), ("bias", bias), ("residual", residual), ("x1", x1),
                        ("weight1", weight1), ("bias1", bias1), ("rowscale", rowscale)):
            if t is not None and not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
            _check_float(name, t)
        if not (0.0 <= float(dropout_p) < 1.0):
            raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
        if float(eps) < 0.0:
            raise ValueError(f"eps must be non-negative, got {eps}")
        if x.dim() == 0:
            raise ValueError("x must have at least one dimension")
        if memory_efficient and weight1 is not None:
            raise ValueError("memory_efficient=True does not support weight1/bias1")
        if weight1 is None and bias1 is not None:
            raise ValueError("bias1 needs weight1")
        if out_dtype is not None and out_dtype not in _FLOATS:
            raise TypeError(f"out_dtype must be a floating-point dtype, got {out_dtype}")
        N = x.shape[-1]
        for name, t in (("residual", residual), ("x1", x1)):
            _check_like(name, t, x)
        for name, t in (("weight", weight), ("bias", bias), ("weight1", weight1), ("bias1", bias1)):
            _check_vec(name, t, N, x)
        M = x.numel() // N if N else math.prod(x.shape[:-1])
        if rowscale is not None and rowscale.numel() != M:
            raise ValueError(f"rowscale must have x.shape[:-1] = {tuple(x.shape[:-1])} elements, got "
                             f"{tuple(rowscale.shape)}")
        self.shape = x.shape
        self.M, self.N = M, N
        self.device = x.device
        self.eps, self.dropout_p = float(eps), float(dropout_p)
        self.is_rms = bool(is_rms_norm)
        self.zero_centered = bool(zero_centered_weight)
        self.x_dtype = x.dtype
        self.x1_dtype = x1.dtype if x1 is not None else x.dtype
        self.residual_dtype = residual.dtype if residual is not None else (_F32 if residual_in_fp32 else x.dtype)
        self.out_dtype = out_dtype or x.dtype
        self.has = (weight is not None, bias is not None, residual is not None, x1 is not None,
                    weight1 is not None, bias1 is not None, rowscale is not None)
        self.has_dropout = self.dropout_p > 0.0
        self.store_res = bool(residual is not None or self.residual_dtype != x.dtype or self.has_dropout
                              or rowscale is not None or x1 is not None)
        self.return_residual = bool(return_residual)
        self.store_mask = bool(return_dropout_mask and self.has_dropout)
        self.memory_efficient = bool(memory_efficient)
        # Row strides (None: the input is copied into rows per call).
        self.sx = row_stride(x) if M * N else N
        self.sres = row_stride(residual) if residual is not None else 0
        self.sx1 = row_stride(x1) if x1 is not None else 0
        # Row stride of what the backward reads as the pre-norm sum: y, residual_out, or x (or its copy).
        self.sxs = N if (self.memory_efficient or self.store_res or self.sx is None) else self.sx
        self.vec_shapes = tuple(None if t is None else t.shape for t in (weight, bias, weight1, bias1))
        self.vec_ok = all(t is None or t.is_contiguous() for t in (weight, bias, weight1, bias1))
        self.rs_ok = rowscale is None or rowscale.is_contiguous()
        self.use_kernel = (choose_backend(x.device) == "triton") and M * N > 0
        self.stream = stream_getter(x.device)
        self.stats_shape = (M,) if self.is_rms else (2, M)
        # Outputs shaped and typed like a contiguous x come from empty_like (cheaper on the host).
        self.y_like_x = x.is_contiguous() and self.out_dtype == x.dtype
        self.dx_like_x = x.is_contiguous()
        # dresidual equals dx unless dropout / rowscale / x1 sit between them or the dtypes differ.
        self.store_dres = self.has[2] and (self.has_dropout or self.has[6] or self.has[3]
                                           or self.residual_dtype != x.dtype)
        self._fwd: dict = {}
        self._bwd: dict = {}
        if self.use_kernel:
            self._plan_fwd()

    # ------------------------------------------------------------------------------ forward
    def _plan_fwd(self) -> None:
        M, N = self.M, self.N
        self.chunked = N > TUNING["fwd_max_resident"]
        if self.chunked:
            self.block_m, self.block_n = 1, min(TUNING["chunk"], next_pow2(N))
            self.fwd_kernel = _layer_norm_fwd_chunked_kernel
        else:
            self.block_m, self.block_n = _row_blocks(N, M, TUNING["fwd_elems"])
            self.fwd_kernel = _layer_norm_fwd_kernel
        hw, hb, hres, hx1, hw1, hb1, hrs = self.has
        self.fwd_meta = dict(IS_RMS=self.is_rms, HAS_W=hw, HAS_B=hb, HAS_RES=hres, HAS_X1=hx1, HAS_W1=hw1,
                             HAS_B1=hb1, HAS_ROWSCALE=hrs, HAS_DROPOUT=self.has_dropout, STORE_MASK=self.store_mask,
                             STORE_RES_OUT=self.store_res, ZERO_CENTERED=self.zero_centered)

    def fwd_launch(self, store_stats: bool) -> Launch:
        la = self._fwd.get(store_stats)
        if la is None:
            meta = dict(self.fwd_meta, STORE_STATS=store_stats, BLOCK_M=self.block_m, BLOCK_N=self.block_n)
            la = self._fwd[store_stats] = Launch(self.fwd_kernel, (cdiv(self.M, self.block_m),), meta,
                                                 _warps(self.block_m * self.block_n), device=self.device)
        return la

    def forward(self, x, weight, bias, residual, x1, weight1, bias1, rowscale, seed, store_stats: bool,
                traced: bool = False):
        """Run the forward kernel on real tensors (or trace it: ``traced``). Returns ``(y, y1, stats,
        residual_out, mask, mask1, xs)``, absent outputs ``None``; ``y``/``y1``/``residual_out``/masks have
        x's shape, ``stats`` is fp32 ``(2, M)`` (mean, rstd) or ``(M,)`` (RMSNorm's rstd); ``xs`` is what
        the backward reads as the pre-norm sum."""
        shape, dev = self.shape, self.device
        sx = self.sx
        if sx is None:
            x, sx = x.reshape(self.M, self.N).contiguous(), self.N
        sres, sx1 = self.sres, self.sx1
        if sres is None:
            residual, sres = residual.reshape(self.M, self.N).contiguous(), self.N
        if sx1 is None:
            x1, sx1 = x1.reshape(self.M, self.N).contiguous(), self.N
        if not self.vec_ok:
            weight, bias, weight1, bias1 = (t.contiguous() if t is not None else None
                                            for t in (weight, bias, weight1, bias1))
        if not self.rs_ok:
            rowscale = rowscale.contiguous()
        y = torch.empty_like(x) if self.y_like_x else torch.empty(shape, dtype=self.out_dtype, device=dev)
        y1 = torch.empty(shape, dtype=self.out_dtype, device=dev) if weight1 is not None else None
        stats = torch.empty(self.stats_shape, dtype=_F32, device=dev) if store_stats else None
        res_out = torch.empty(shape, dtype=self.residual_dtype, device=dev) if self.store_res else None
        mask = torch.empty(shape, dtype=torch.bool, device=dev) if self.store_mask else None
        mask1 = torch.empty(shape, dtype=torch.bool, device=dev) if (self.store_mask and x1 is not None) else None
        N = self.N
        args = (x, weight, bias, residual, x1, weight1, bias1, rowscale, seed, y, y1, res_out, mask, mask1, stats,
                sx, sres, sx1, N, N, N, self.M, N, self.eps, self.dropout_p)
        la = self.fwd_launch(store_stats)
        if traced:
            la.traced(*args)
        else:
            la(self.stream(), _aligned(x, weight, bias, residual, x1, weight1, bias1, rowscale), *args)
        xs = y if self.memory_efficient else (res_out if self.store_res else x)
        return y, y1, stats, res_out, mask, mask1, xs

    # ----------------------------------------------------------------------------- backward
    def _plan_bwd(self, has_dres_out: bool):
        M, N = self.M, self.N
        hw, hb, _, hx1, hw1, hb1, hrs = self.has
        flags = dict(IS_RMS=self.is_rms, HAS_W=hw, HAS_B=hb, HAS_W1=hw1, ZERO_CENTERED=self.zero_centered,
                     RECOMPUTE_FROM_Y=self.memory_efficient)
        dx_flags = dict(HAS_DRES_OUT=has_dres_out, STORE_DRES=self.store_dres,
                        HAS_X1=hx1, HAS_ROWSCALE=hrs, HAS_DROPOUT=self.has_dropout)
        n_params = hw + hb + hw1 + hb1
        dev = self.device
        b = _BwdPlan()
        b.n_params = n_params
        if N <= TUNING["bwd_max_resident"]:
            block_m, block_n = _row_blocks(N, M, TUNING["bwd_elems"])
            n_prog = num_programs_hint(dev) * TUNING["bwd_programs_per_sm"]
            if isinstance(M, int):
                n_prog = max(1, min(n_prog, cdiv(M, block_m)))
                rows_per_program = cdiv(M, n_prog)
                n_prog = cdiv(M, rows_per_program)
            else:
                rows_per_program = (M + n_prog - 1) // n_prog
            b.rows = n_prog
            b.rows_per = rows_per_program
            b.main = Launch(_layer_norm_bwd_kernel, (n_prog,),
                            dict(**flags, HAS_B1=hb1, **dx_flags, BLOCK_M=block_m, BLOCK_N=block_n),
                            _warps(block_m * block_n), device=dev)
            b.dw = None
            b.resident = True
        else:
            b.resident = False
            block_n = min(TUNING["chunk"], next_pow2(N))
            b.main = Launch(_layer_norm_bwd_chunked_kernel, (M,), dict(**flags, **dx_flags, BLOCK_M=1,
                                                                        BLOCK_N=block_n), _warps(block_n), device=dev)
            col_block = 256
            splits = max(1, 4 * num_programs_hint(dev) // cdiv(N, col_block))
            if isinstance(M, int):
                splits = max(1, min(cdiv(M, 32), splits))
                rows_per_split = cdiv(M, splits)
                splits = cdiv(M, rows_per_split)
            else:
                rows_per_split = (M + splits - 1) // splits
            b.rows = splits
            b.rows_per = rows_per_split
            b.dw = Launch(_layer_norm_bwd_dw_kernel, (cdiv(N, col_block), splits),
                          dict(**flags, HAS_B1=hb1, BLOCK_M=32, BLOCK_N=col_block), 4, device=dev) if n_params else None
        fin_block = 64
        b.finish = Launch(_layer_norm_dw_finish_kernel, (cdiv(N, fin_block),),
                          dict(HAS_W=hw, HAS_B=hb, HAS_W1=hw1, HAS_B1=hb1, BLOCK_R=16, BLOCK_N=fin_block), 4,
                          device=dev) if n_params else None
        return b

    def backward(self, dy, dy1, dres_out, xs, weight, bias, weight1, bias1, rowscale, seed, stats,
                 traced: bool = False):
        """Gradients ``(dx, dweight, dbias, dresidual, dx1, dweight1, dbias1)`` (``None`` where absent).
        ``dy``/``dy1``/``dres_out`` are row-addressable like ``y`` (the caller makes them contiguous);
        ``xs`` is the saved pre-norm sum (or ``y`` with ``memory_efficient``)."""
        has_dres_out = dres_out is not None
        b = self._bwd.get(has_dres_out)
        if b is None or traced:
            b = self._plan_bwd(has_dres_out)
            if not traced:
                self._bwd[has_dres_out] = b
        M, N, dev, shape = self.M, self.N, self.device, self.shape
        hw, hb, hres, hx1, hw1, hb1, _ = self.has
        dx = torch.empty_like(dy) if self.dx_like_x and dy.dtype == self.x_dtype else torch.empty(
            shape, dtype=self.x_dtype, device=dev)
        dx1 = torch.empty(shape, dtype=self.x1_dtype, device=dev) if hx1 else None
        dres = torch.empty(shape, dtype=self.residual_dtype, device=dev) if self.store_dres else None
        part = torch.empty((b.rows, b.n_params, N), dtype=_F32, device=dev) if b.n_params else None
        strides = (self.sxs, N, N, N, N, N, N)
        stream = None if traced else self.stream()
        aligned = True if traced else _aligned(dy, dy1, dres_out, xs, weight, bias, weight1, rowscale)
        if b.resident:  # row-resident: dX and the partials in one pass
            args = (xs, weight, bias, weight1, dy, dy1, dres_out, rowscale, seed, stats, dx, dx1, dres, part,
                    *strides, b.n_params * N, M, N, self.dropout_p, b.rows_per)
            b.main.traced(*args) if traced else b.main(stream, aligned, *args)
        else:
            args = (xs, weight, bias, weight1, dy, dy1, dres_out, rowscale, seed, stats, dx, dx1, dres, *strides,
                    M, N, self.dropout_p)
            b.main.traced(*args) if traced else b.main(stream, aligned, *args)
            if b.dw is not None:
                args = (xs, weight, bias, dy, dy1, stats, part, self.sxs, N, N, b.n_params * N, M, N, b.rows_per)
                b.dw.traced(*args) if traced else b.dw(stream, aligned, *args)
        sw, sb, sw1, sb1 = self.vec_shapes
        dw = torch.empty(sw, dtype=weight.dtype, device=dev) if hw else None
        db = torch.empty(sb, dtype=bias.dtype, device=dev) if hb else None
        dw1 = torch.empty(sw1, dtype=weight1.dtype, device=dev) if hw1 else None
        db1 = torch.empty(sb1, dtype=bias1.dtype, device=dev) if hb1 else None
        if b.finish is not None:
            args = (part, dw, db, dw1, db1, b.rows, N, b.n_params * N)
            b.finish.traced(*args) if traced else b.finish(stream, True, *args)
        dresidual = (dres if self.store_dres else dx) if hres else None
        return dx, dw, db, dresidual, dx1, dw1, db1


class _BwdPlan:
    __slots__ = ("main", "dw", "finish", "rows", "rows_per", "n_params", "resident")


