"""Call plans of the convolution epilogue: validate once, then allocate and launch.

An ``EpiloguePlan`` holds what ``conv_epilogue`` derives from one call signature (shapes, strides, dtypes and
devices of the convolution output, the per-channel vectors, the residual and the mask; the ReLU flag): the
checks passed, the per-call conversions still needed (tensors not in channels-last memory are copied into
it, a bool mask is reinterpreted as int8), the tiles, grids and bound ``Launch`` of each kernel. A cached
forward costs one allocation and one launch; a backward at most three allocations (``dc``, ``dr``, the
per-split sums), one launch and one small sum over the splits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import choose_backend, num_programs_hint
from culmen.ops.common.launch import Launch, PlanTuning, aligned_16, cdiv, next_pow2, stream_getter, traceable_kernels
from culmen.ops.common.plans import PlanCache, clear_plans
from culmen.ops.conv_epilogue.kernels import _conv_epilogue_bwd_kernel, _conv_epilogue_fwd_kernel
from culmen.ops.conv_epilogue.reference import conv_epilogue_bwd_ref, conv_epilogue_fwd_ref

TUNING = PlanTuning({
    # Elements of one forward tile and of one step of the backward's row loop.
    "fwd_tile": 4096,
    "bwd_tile": 2048,
    # Widest channel block of the forward / backward tiles.
    "fwd_block_c": 128,
    "bwd_block_c": 64,
    # Backward programs aimed for, per multiprocessor (the reduction over rows is split until about this).
    "bwd_programs_per_sm": 4,
    "num_warps": 4,
}, clear_plans)

PLANS = PlanCache("conv_epilogue")
_CL = torch.channels_last
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_vector(name: str, v, C: int, dev: torch.device) -> None:
    if not isinstance(v, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(v).__name__}")
    if v.dtype not in _FLOATS:
        raise TypeError(f"{name} must be a floating-point tensor, got {v.dtype}")
    if v.numel() != C:
        raise ValueError(f"{name} must have one element per channel ({C}), got shape {tuple(v.shape)}")
    if v.device != dev:
        raise ValueError(f"{name} is on {v.device} but the convolution output is on {dev}")


def _check_like(name: str, t, c: Tensor, floats: bool) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if tuple(t.shape) != tuple(c.shape):
        raise ValueError(f"{name} must have the convolution output's shape {tuple(c.shape)}, got {tuple(t.shape)}")
    if t.device != c.device:
        raise ValueError(f"{name} is on {t.device} but the convolution output is on {c.device}")
    if floats and t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not floats and (t.dtype.is_complex or t.dtype == torch.float64 and c.dtype != torch.float64):
        raise TypeError(f"{name} must be an integer, bool or floating-point tensor, got {t.dtype}")


def _is_cl(t: Tensor) -> bool:
    return t.is_contiguous(memory_format=_CL)


class EpiloguePlan:
    """Everything ``conv_epilogue`` derives from one call signature; holds no tensors.

    ``c``: ``(N, C, H, W)`` fp16/bf16/fp32/fp64, best stored channels-last (other layouts are copied per
    call); ``scale``, ``bias``, ``res_scale``: ``C`` elements or ``None``; ``res`` like ``c`` or ``None``
    (``res_scale`` needs ``res``); ``mask`` like ``c`` (int8, bool, or float) or ``None``.
    ``traced``: built from fake tensors inside the ``torch.compile`` op (``forward_traced`` /
    ``backward_traced``; the element count may be symbolic).
    """

    def __init__(self, c, scale, bias, res, res_scale, mask, relu: bool, traced: bool = False) -> None:
        if not isinstance(c, Tensor):
            raise TypeError(f"conv_epilogue: the convolution output must be a torch.Tensor, got {type(c).__name__}")
        if c.dim() != 4:
            raise ValueError(f"conv_epilogue: expected a 4-D (N, C, H, W) convolution output, got shape "
                             f"{tuple(c.shape)}")
        if c.dtype not in _FLOATS:
            raise TypeError(f"conv_epilogue: the convolution output must be floating point, got {c.dtype}")
        dev = c.device
        C = int(c.shape[1])
        for name, v in (("scale", scale), ("bias", bias), ("res_scale", res_scale)):
            if v is not None:
                _check_vector(name, v, C, dev)
        if res_scale is not None and res is None:
            raise ValueError("conv_epilogue: res_scale needs a residual (res is None)")
        if res is not None:
            _check_like("res", res, c, True)
        if mask is not None:
            _check_like("mask", mask, c, False)
        self.C = C
        self.M = c.numel() // C if C else 0
        self.relu = bool(relu)
        self.dtype = c.dtype
        self.device = dev
        self.copy_c = not _is_cl(c)
        self.copy_res = res is not None and not _is_cl(res)
        self.copy_mask = mask is not None and not _is_cl(mask)
        self.mask_bool = mask is not None and mask.dtype == torch.bool
        # A contiguous vector of any shape ((1, C, 1, 1) from Apex) is C consecutive elements: read in place.
        self.fix = tuple(v is not None and not v.is_contiguous() for v in (scale, bias, res_scale))
        self.has = (scale is not None, bias is not None, res is not None, res_scale is not None, mask is not None)
        self.use_kernel = c.dtype != torch.float64 and choose_backend(dev) == "triton"
        if traced:
            self.use_kernel = self.use_kernel and traceable_kernels()
        self.stream = stream_getter(dev)
        self._bwd: dict = {}
        if self.use_kernel:
            self._plan_kernels()

    def _plan_kernels(self) -> None:
        C, M, dev = self.C, self.M, self.device
        # A symbolic element count (torch.compile, dynamic shapes) sizes the tiles as if it were large.
        Mh = M if isinstance(M, int) else 1 << 30
        nw = TUNING["num_warps"]
        bc = min(TUNING["fwd_block_c"], next_pow2(max(C, 1)))
        bm = max(1, min(TUNING["fwd_tile"] // bc, next_pow2(max(Mh, 1))))
        hs, hb, hr, hrs, hm = self.has
        self.fwd = Launch(_conv_epilogue_fwd_kernel, (cdiv(M, bm), cdiv(C, bc)),
                          dict(HAS_SCALE=hs, HAS_BIAS=hb, HAS_RES=hr, HAS_RSCALE=hrs, HAS_MASK=hm, RELU=self.relu,
                               BLOCK_M=bm, BLOCK_C=bc), nw, device=dev)
        bc = min(TUNING["bwd_block_c"], next_pow2(max(C, 1)))
        bm = max(1, min(TUNING["bwd_tile"] // bc, next_pow2(max(Mh, 1))))
        col_blocks = cdiv(C, bc)
        want = max(1, TUNING["bwd_programs_per_sm"] * num_programs_hint(dev) // col_blocks)
        if isinstance(M, int):
            row_blocks = max(1, cdiv(M, bm))
            per = cdiv(row_blocks, min(want, row_blocks)) * bm
        else:
            per = 64 * bm
        self.rows_per = per
        self.splits = max(1, cdiv(M, per))
        self.bwd_grid = (col_blocks, self.splits)
        self.bwd_blocks = dict(BLOCK_M=bm, BLOCK_C=bc)

    def _bwd_launch(self, store_dc: bool, store_dr: bool, sum_g: bool) -> Launch:
        key = (store_dc, store_dr, sum_g)
        la = self._bwd.get(key)
        if la is None:
            _, _, _, hrs, hm = self.has
            la = self._bwd[key] = Launch(
                _conv_epilogue_bwd_kernel, self.bwd_grid,
                dict(RELU=self.relu, HAS_MASK=hm, HAS_SCALE=self.has[0], HAS_RSCALE=hrs, STORE_DC=store_dc,
                     STORE_DR=store_dr, SUM_G=sum_g, **self.bwd_blocks), TUNING["num_warps"], device=self.device)
        return la

    # ------------------------------------------------------------------------------ per call
    def _vectors(self, scale, bias, res_scale):
        fs, fb, fr = self.fix
        if fs:
            scale = scale.reshape(-1).contiguous()
        if fb and bias is not None:
            bias = bias.reshape(-1).contiguous()
        if fr:
            res_scale = res_scale.reshape(-1).contiguous()
        return scale, bias, res_scale

    def prepare_mask(self, mask):
        """``mask`` as the kernels read it (channels-last memory, bool as int8)."""
        if mask is None:
            return None
        if self.copy_mask:
            mask = mask.contiguous(memory_format=_CL)
        return mask.view(torch.int8) if self.mask_bool else mask

    def forward(self, c, scale, bias, res, res_scale, mask) -> Tensor:
        """``y`` (``c``'s shape and dtype, channels-last memory on the kernel path)."""
        if not self.use_kernel:
            return conv_epilogue_fwd_ref(c, scale, bias, res, res_scale, mask, self.relu)
        if self.copy_c:
            c = c.contiguous(memory_format=_CL)
        if self.copy_res:
            res = res.contiguous(memory_format=_CL)
        mask = self.prepare_mask(mask)
        scale, bias, res_scale = self._vectors(scale, bias, res_scale)
        y = torch.empty_like(c)
        if self.M and self.C:
            self.fwd(self.stream(), aligned_16(c, scale, bias, res, res_scale, mask, y),
                     c, scale, bias, res, res_scale, mask, y, self.M, self.C)
        return y

    def backward(self, dy, y, mask, scale, res_scale, need_dc: bool, need_dr: bool, need_sum: bool):
        """``(dc, dr, sum_g)`` for ``g = dy * [y > 0] * mask`` (``y`` as the forward returned it, ``mask`` as
        the forward was given it): ``dc = g * scale``, ``dr = g * res_scale`` in ``dy``'s dtype, channels-last,
        and the fp32 channel sums of ``g``; ``None`` where not asked for. Without ReLU, mask and scale, ``dc`` is ``dy``
        itself (no copy)."""
        if not self.use_kernel:
            return conv_epilogue_bwd_ref(dy, y, mask, scale, res_scale, self.relu, need_dc, need_dr, need_sum)
        if not _is_cl(dy):
            dy = dy.contiguous(memory_format=_CL)
        mask = self.prepare_mask(mask)
        hs, _, _, hrs, hm = self.has
        passthrough = not (self.relu or hm)
        store_dc = need_dc and not (passthrough and not hs)
        store_dr = need_dr and not (passthrough and not hrs)
        scale, _, res_scale = self._vectors(scale, None, res_scale)
        dc = torch.empty_like(dy) if store_dc else None
        dr = torch.empty_like(dy) if store_dr else None
        part = None
        if need_sum:
            part = torch.empty((self.splits, self.C), device=self.device, dtype=torch.float32)
        if (store_dc or store_dr or need_sum) and self.M and self.C:
            la = self._bwd_launch(store_dc, store_dr, need_sum)
            la(self.stream(), aligned_16(dy, y, mask, scale, res_scale, dc, dr, part),
               dy, y, mask, scale, res_scale, dc, dr, part, self.M, self.C, self.rows_per)
        elif need_sum:
            part.zero_()
        if need_dc and not store_dc:
            dc = dy
        if need_dr and not store_dr:
            dr = dy
        return dc, dr, (part.sum(0) if need_sum else None)

    # ------------------------------------------------------------------------------ torch.compile
    # The bodies of the ``culmen::conv_epilogue_*`` ops: launches through ``Launch.traced`` (no pointer
    # checks, no raw stream), and every output a fresh tensor (custom ops return neither None nor aliases).
    def forward_traced(self, c, scale, bias, res, res_scale, mask) -> Tensor:
        """``forward`` inside the ``culmen::conv_epilogue_fwd`` op."""
        if not self.use_kernel:
            y = conv_epilogue_fwd_ref(c, scale, bias, res, res_scale, mask, self.relu)
            return y.clone() if y is c else y  # the identity epilogue: an output may not alias an input
        c = c.contiguous(memory_format=_CL)
        if res is not None:
            res = res.contiguous(memory_format=_CL)
        mask = None if mask is None else mask.contiguous(memory_format=_CL)
        if self.mask_bool:
            mask = mask.to(torch.int8)
        scale, bias, res_scale = (None if v is None else v.reshape(-1).contiguous() for v in (scale, bias, res_scale))
        y = torch.empty_like(c, memory_format=_CL)
        if self.M and self.C:
            self.fwd.traced(c, scale, bias, res, res_scale, mask, y, self.M, self.C)
        return y

    def backward_traced(self, dy, y, mask, scale, res_scale, need_dc: bool, need_dr: bool,
                        need_sum: bool) -> tuple[Tensor, Tensor, Tensor]:
        """``backward`` inside the ``culmen::conv_epilogue_bwd`` op: ``(dc, dr, sum_g)``, 0-element tensors
        where not asked for."""
        if not self.use_kernel:
            dc, dr, s = conv_epilogue_bwd_ref(dy, y, mask, scale, res_scale, self.relu, need_dc, need_dr, need_sum)
        else:
            dy = dy.contiguous(memory_format=_CL)
            y = None if y is None else y.contiguous(memory_format=_CL)
            mask = None if mask is None else mask.contiguous(memory_format=_CL)
            if self.mask_bool:
                mask = mask.to(torch.int8)
            scale, res_scale = (None if v is None else v.reshape(-1).contiguous() for v in (scale, res_scale))
            dc = torch.empty_like(dy, memory_format=_CL) if need_dc else None
            dr = torch.empty_like(dy, memory_format=_CL) if need_dr else None
            part = torch.empty((self.splits, self.C), device=self.device, dtype=torch.float32) if need_sum else None
            if need_sum and not (self.M and self.C):
                part.zero_()
            if (need_dc or need_dr or need_sum) and self.M and self.C:
                self._bwd_launch(need_dc, need_dr, need_sum).traced(dy, y, mask, scale, res_scale, dc, dr, part,
                                                                    self.M, self.C, self.rows_per)
            s = part.sum(0) if need_sum else None
        empty = dy.new_empty(0)
        dc = empty if dc is None else (dc.clone() if dc is dy else dc)
        dr = dy.new_empty(0) if dr is None else (dr.clone() if dr is dy else dr)
        s = torch.empty(0, device=dy.device, dtype=torch.float32) if s is None else s
        return dc, dr, s
