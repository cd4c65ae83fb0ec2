"""Call plans of the scaled masked softmax: validate once, then allocate and launch.

A ``SoftmaxPlan`` holds everything a forward derives from one call signature (shapes, strides, dtypes
and devices of the scores and the mask; causal): the checks passed, the mask's broadcast strides (the
kernel reads a bool or uint8 mask of any broadcastable shape in place: no expand, view or cast), the
row blocking and the bound ``Launch``; a ``SoftmaxBwdPlan`` the same for a backward. A cached call
costs: one key, one dict lookup, one allocation, one launch.

``TUNING`` holds the block rules so a sweep can change them at run time (every change drops the plans).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import choose_backend
from culmen.ops.common.launch import Launch, PlanTuning, cdiv, next_pow2, stream_getter, warps_for
from culmen.ops.common.plans import PlanCache, clear_plans
from culmen.ops.softmax.kernels import (
    _softmax_bwd_chunked_kernel,
    _softmax_bwd_kernel,
    _softmax_fwd_chunked_kernel,
    _softmax_fwd_kernel,
)
from culmen.ops.softmax.reference import softmax_bwd_ref, softmax_fwd_ref

TUNING = PlanTuning({
    # Longest row (elements) a program keeps in registers; longer rows take the chunked kernels.
    "fwd_max_resident": 16384,
    "bwd_max_resident": 8192,
    # Elements per program the resident kernels aim for (several short rows per program).
    "fwd_elems": 4096,
    "bwd_elems": 4096,
    # Chunk width of the chunked kernels.
    "chunk": 4096,
    # Elements per thread before another warp is added.
    "elems_per_thread": 16,
    "max_warps": 16,
}, clear_plans)

PLANS = PlanCache("softmax")

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MASKS = (torch.bool, torch.uint8)
_FORMS = {3: "3-D (attn_batches, sq, sk)", 4: "4-D (batch, heads, sq, sk)"}


def _warps(elems: int) -> int:
    return warps_for(elems, TUNING["elems_per_thread"], TUNING["max_warps"])


def _launch(kernels: tuple, max_resident: str, target: str, SK: int, n_rows, flags: dict, device) -> Launch:
    """The launch of a resident (whole rows in registers) or chunked kernel for rows of ``SK``; ``n_rows``
    may be symbolic (``torch.compile``): it then caps nothing; ``SK`` sets the block, a constant."""
    SK = SK if isinstance(SK, int) else int(SK)
    if SK <= TUNING[max_resident]:
        block_n = next_pow2(SK)
        cap = next_pow2(n_rows) if isinstance(n_rows, int) else 64
        block_m = max(1, min(TUNING[target] // block_n, 64, cap))
        return Launch(kernels[0], (cdiv(n_rows, block_m),), dict(flags, BLOCK_M=block_m, BLOCK_N=block_n),
                      _warps(block_m * block_n), device=device)
    block_n = min(TUNING["chunk"], next_pow2(SK))
    return Launch(kernels[1], (n_rows,), dict(flags, BLOCK_M=1, BLOCK_N=block_n), _warps(block_n), device=device)


def check_scores(name: str, x, dims: tuple[int, ...]) -> None:
    """``TypeError`` / ``ValueError`` unless ``x`` is a float tensor with one of ``dims`` dims."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name} must be a floating-point tensor (float16/bfloat16/float32/float64), got {x.dtype}")
    if x.dim() not in dims:
        what = " or ".join(_FORMS[d] for d in dims)
        raise ValueError(f"{name} must be {what}, got shape {tuple(x.shape)}")


def _rows4(t: Tensor, st: tuple | None = None) -> tuple:
    """``(batch, heads, q)`` strides of a 3-D or 4-D tensor (``st``: its strides) as the kernels address it."""
    st = t.stride() if st is None else st
    return (0, *st[:2]) if len(st) == 3 else st[:3]


def _contiguous_strides(shape) -> tuple:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _unit_cols(t: Tensor) -> bool:
    return t.shape[-1] <= 1 or t.stride(-1) == 1


def mask_strides(mask, x: Tensor) -> tuple[int, int, int, int]:
    """Strides that read ``mask`` (bool/uint8, nonzero = masked, broadcastable to ``x``) as if expanded to
    x's shape (0 along broadcast dims), in the kernels' ``(b, h, q, k)`` order."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype not in _MASKS:
        raise TypeError(f"mask must be a bool or uint8 tensor, got {mask.dtype}")
    if mask.device != x.device:
        raise ValueError(f"mask is on {mask.device} but the input is on {x.device}")
    n = x.dim()
    if mask.dim() > n:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to the input's shape {tuple(x.shape)}")
    pad = n - mask.dim()
    out = []
    for i in range(n):
        size = mask.shape[i - pad] if i >= pad else 1
        if size == x.shape[i]:
            out.append(mask.stride(i - pad) if (i >= pad and size != 1) else 0)
        elif size == 1:
            out.append(0)
        else:
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to the input's shape "
                             f"{tuple(x.shape)}")
    return (0, *out) if n == 3 else tuple(out)  # type: ignore[return-value]


class SoftmaxPlan:
    """The forward of one call signature (and its backwards, per gradient layout). Holds no tensors.

    ``x``: ``(B, NP, SQ, SK)`` or ``(A, SQ, SK)`` scores (``dims`` says which are allowed), any strides;
    ``mask``: bool/uint8 broadcastable to ``x`` or ``None``. Built from real tensors in eager mode and
    from fake ones under ``torch.compile`` (sizes may be symbolic).
    """

    def __init__(self, x, mask, causal: bool, dims: tuple[int, ...] = (4,), name: str = "x") -> None:
        check_scores(name, x, dims)
        self.ms = mask_strides(mask, x) if mask is not None else (0, 0, 0, 0)
        self.causal = bool(causal)
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device
        SQ, SK = x.shape[-2], x.shape[-1]
        NP = x.shape[-3]
        n_rows = x.shape[0] * NP * SQ if x.dim() == 4 else NP * SQ
        # The kernels read rows with unit column stride (anything else is copied per call) and write y
        # contiguous: ``empty_like(x)`` is that when x is contiguous.
        self.fix_x = not _unit_cols(x)
        self.alloc_like = x.is_contiguous()
        sx = _rows4(x, _contiguous_strides(x.shape) if self.fix_x else None)
        self.ints = (n_rows, SK, NP, SQ, *sx, *self.ms)
        self.has_mask = mask is not None
        self.use_kernel = (choose_backend(x.device) == "triton" and x.dtype != torch.float64
                           and x.numel() > 0)
        self.stream = stream_getter(x.device)
        flags = dict(HAS_MASK=self.has_mask, CAUSAL=self.causal)
        self.fwd = _launch((_softmax_fwd_kernel, _softmax_fwd_chunked_kernel), "fwd_max_resident", "fwd_elems", SK,
                           n_rows, flags, x.device) if self.use_kernel else None
        self._bwd: dict = {}

    def forward(self, x: Tensor, mask: Tensor | None, scale: float, traced: bool = False) -> Tensor:
        """Probabilities ``softmax(where(mask, -10000, x * scale))`` (causal: columns past the row excluded),
        contiguous, in x's dtype."""
        if not self.use_kernel:
            return softmax_fwd_ref(x, mask, scale, self.causal)
        if self.fix_x:
            x = x.contiguous()
        y = torch.empty_like(x) if self.alloc_like else torch.empty(self.shape, dtype=self.dtype, device=self.device)
        if traced:
            self.fwd.traced(x, mask, y, *self.ints, scale)
            return y
        bits = x.data_ptr() | mask.data_ptr() if self.has_mask else x.data_ptr()
        self.fwd(self.stream(), bits & 15 == 0, x, mask, y, *self.ints, scale)
        return y

    def backward(self, dy: Tensor, y: Tensor, scale: float, traced: bool = False) -> Tensor:
        """Input gradient from the output gradient ``dy`` (any strides) and this plan's output ``y``."""
        if traced:
            return SoftmaxBwdPlan(dy, y, self.causal).backward(dy, y, scale, traced=True)
        key = dy.stride()
        plan = self._bwd.get(key)
        if plan is None:
            plan = self._bwd[key] = SoftmaxBwdPlan(dy, y, self.causal)
        return plan.backward(dy, y, scale)


class SoftmaxBwdPlan:
    """The backward of one call signature: ``dy``, ``y`` of one shape (3-D or 4-D, any strides)."""

    def __init__(self, dy, y, causal: bool, dims: tuple[int, ...] = (3, 4)) -> None:
        check_scores("output_grads", dy, dims)
        check_scores("softmax_results", y, dims)
        if dy.shape != y.shape:
            raise ValueError(f"output_grads {tuple(dy.shape)} and softmax_results {tuple(y.shape)} must have one "
                             f"shape")
        if dy.device != y.device:
            raise ValueError(f"output_grads is on {dy.device} but softmax_results is on {y.device}")
        self.causal = bool(causal)
        self.shape, self.dtype, self.device = dy.shape, dy.dtype, dy.device
        SQ, SK = dy.shape[-2], dy.shape[-1]
        NP = dy.shape[-3]
        n_rows = dy.shape[0] * NP * SQ if dy.dim() == 4 else NP * SQ
        self.fix_dy, self.fix_y = not _unit_cols(dy), not _unit_cols(y)
        self.alloc_like = dy.is_contiguous()
        cs = _contiguous_strides(dy.shape)
        self.ints = (n_rows, SK, NP, SQ, *_rows4(dy, cs if self.fix_dy else None),
                     *_rows4(y, cs if self.fix_y else None))
        self.use_kernel = (choose_backend(dy.device) == "triton" and dy.dtype != torch.float64
                           and dy.numel() > 0)
        self.stream = stream_getter(dy.device)
        self.bwd = _launch((_softmax_bwd_kernel, _softmax_bwd_chunked_kernel), "bwd_max_resident", "bwd_elems", SK,
                           n_rows, dict(CAUSAL=self.causal), dy.device) if self.use_kernel else None

    def backward(self, dy: Tensor, y: Tensor, scale: float, traced: bool = False) -> Tensor:
        """``scale * y * (dy - sum(y * dy))``, contiguous, in dy's dtype."""
        if not self.use_kernel:
            return softmax_bwd_ref(dy, y, scale, self.causal)
        if self.fix_dy:
            dy = dy.contiguous()
        if self.fix_y:
            y = y.contiguous()
        dx = torch.empty_like(dy) if self.alloc_like else torch.empty(self.shape, dtype=self.dtype, device=self.device)
        if traced:
            self.bwd.traced(dy, y, dx, *self.ints, scale)
            return dx
        self.bwd(self.stream(), (dy.data_ptr() | y.data_ptr()) & 15 == 0, dy, y, dx, *self.ints, scale)
        return dx
