"""Call plans of the activation kernels: validate once, then allocate and launch.

A plan holds everything an activation op derives from one call signature (shapes, strides, dtypes,
device, activation, flags): the checks passed, how each operand is addressed as ``(M, N)`` rows, what
to allocate, and the bound ``Launch`` of every kernel. A cached call costs one key, one dict lookup,
one allocation per output and one launch per kernel.

* ``ActPlan``: ``act(x + bias)`` (``bias_act``, the raw ``act_fwd``), with ReLU's bit-mask forward and
  the backward plans of ``bias_act``'s autograd.
* ``ActBwdPlan``: the backward of ``act(x + bias)`` (the raw ``act_bwd``): ``dx``, optionally the bias
  gradient in the same pass (fp32 partial column sums, then one small summing kernel) and the
  recomputed activation.
* ``GluPlan``: ``act(x) * u`` and its backward (``gated_act``, the raw ``glu_fwd`` / ``glu_bwd``),
  including the packed variant whose two operands are the halves of one ``(..., 2N)`` tensor and whose
  gradient is one ``(..., 2N)`` buffer.

Geometry: a contiguous operand set without a per-column operand is launched as one flat row (``M == 1``,
row stride 0, which lets Triton prove 16-byte alignment whatever the shape); otherwise rows of the
last dim, each operand with its own row stride (halves of a packed tensor need no copy), and only an
operand whose leading dims cannot be merged is copied per call. Plans built for ``torch.compile``
(``traced``) always use rows, so a symbolic row count never reaches a specialization.

``TUNING`` holds the block rules so a sweep on the GPU can change them at run time (every change drops
the cached plans).
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
from culmen.ops.activations.reference import act_bwd_ref, act_fwd_ref, glu_bwd_ref, glu_fwd_ref
from culmen.ops.backend import choose_backend, num_programs_hint
from culmen.ops.common.function import calibrate_saved_memory
from culmen.ops.common.launch import Launch, PlanTuning, cdiv, next_pow2, row_stride, stream_getter, traceable_kernels
from culmen.ops.common.plans import PlanCache, clear_plans

ACT_CODES: dict[str, int] = {
    "none": 0, "relu": 1, "sigmoid": 2, "gelu": 3, "gelu_tanh": 4, "sqrelu": 5, "silu": 6, "relu_ge0": 7,
}
ACTIVATIONS: tuple[str, ...] = tuple(ACT_CODES)
"""Activations of ``bias_act`` (``relu_ge0``: ReLU whose derivative at 0 is 1, flash_attn's convention)."""
GATED_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu", "gelu_tanh", "relu", "sigmoid", "sqrelu", "none")
"""Activations applied to the gate ``x`` of ``gated_act``."""
FROM_OUTPUT_ACTIVATIONS: tuple[str, ...] = ("none", "relu", "sigmoid")
"""Activations whose derivative can be computed from their output (no pre-activation saved)."""
MASK_ACTIVATIONS: tuple[str, ...] = ("relu", "relu_ge0")
"""Activations whose derivative is one bit per element: ``bias_act`` saves a bit mask for them."""

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
}, clear_plans)

ACT_PLANS = PlanCache("activations")
ACT_BWD_PLANS = PlanCache("activations_bwd")
GLU_PLANS = PlanCache("gated_activations")

_F32 = torch.float32
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ------------------------------------------------------------------------------------ validation


def check_activation(act: str, allowed: tuple[str, ...] = ACTIVATIONS, name: str = "activation") -> str:
    """Return ``act`` when it is one of ``allowed``; else raise ``ValueError`` listing them."""
    if not isinstance(act, str) or act not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {act!r}")
    return act


def check_tensor(name: str, t: Tensor) -> None:
    """``t`` must be a floating-point tensor (``TypeError`` naming ``name`` otherwise)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float16/bfloat16/float32/float64, got {t.dtype}")


def check_bias(x: Tensor, bias: Tensor | None) -> None:
    """``bias`` must be ``None`` or a float ``(N,)`` tensor on ``x``'s device (``N = x.shape[-1]``)."""
    if bias is None:
        return
    check_tensor("bias", bias)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension when a bias is given")
    if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"bias must have shape ({x.shape[-1]},) (the last dim of x), got {tuple(bias.shape)}")
    if bias.device != x.device:
        raise ValueError(f"bias is on {bias.device} but x is on {x.device}")


def check_same(name: str, t: Tensor, x: Tensor, xname: str = "x") -> None:
    """``t`` must have ``x``'s shape and device."""
    if t.shape != x.shape:
        raise ValueError(f"{name} must have the shape of {xname} {tuple(x.shape)}, got {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but {xname} is on {x.device}")


# -------------------------------------------------------------------------------------- geometry


def _use_kernel(x: Tensor, traced: bool) -> bool:
    # fp64 keeps fp64 math: the kernels compute in fp32, so fp64 runs the (fp64) reference. Under
    # Triton's CPU interpreter kernels cannot be traced: compiled graphs take the reference there.
    ok = x.dtype != torch.float64 and choose_backend(x.device) == "triton"
    if traced:
        return ok and traceable_kernels()
    return ok and x.numel() > 0


def _geometry(tensors: list[Tensor], per_column: bool, traced: bool) -> tuple:
    """``(M, N, copies, row strides)`` of the views the kernels run on: one flat row when every operand
    is contiguous and nothing is indexed by column (eager only); rows of the last dim otherwise. A
    one-row launch gets row stride 0, which lets Triton's specialization prove 16-byte alignment."""
    x = tensors[0]
    if not traced and not per_column and all(t.is_contiguous() for t in tensors):
        return 1, x.numel(), [False] * len(tensors), [0] * len(tensors)
    N = x.shape[-1] if x.dim() else 1
    M = x.numel() // N if N else 0
    copies, strides = [], []
    for t in tensors:
        rs = row_stride(t)
        copies.append(rs is None)
        strides.append(N if rs is None else rs)
    if isinstance(M, int) and M == 1:
        strides = [0] * len(tensors)
    return M, N, copies, strides


def _cap(M) -> int:
    # A symbolic row count (torch.compile) takes no part in the block choice.
    return next_pow2(M) if isinstance(M, int) else 64


def _blocks(M, N: int) -> tuple[int, int, int]:
    elems = TUNING["block_elems"]
    block_n = min(next_pow2(max(N, 1)), elems if (isinstance(M, int) and M == 1) else TUNING["max_block_n"])
    block_m = max(1, min(elems // block_n, _cap(M)))
    return block_m, block_n, cdiv(N, block_n)


def _warps(block_m: int, block_n: int) -> int:
    return max(1, min(TUNING["warps"], (block_m * block_n) // 256))


def _split_rows(M, ncb: int, block_m: int, dev: torch.device) -> tuple[int, object]:
    """``(splits, rows per split)`` of a bias-grad launch with ``ncb`` column blocks. With a symbolic ``M``
    the split count is fixed and trailing splits may be empty (they write zero partials)."""
    target = max(1, TUNING["dbias_programs_per_sm"] * num_programs_hint(dev) // ncb)
    if not isinstance(M, int):
        return target, (M + target - 1) // target
    splits = max(1, min(cdiv(M, block_m), target))
    rows_per_split = cdiv(M, splits)
    return cdiv(M, rows_per_split), rows_per_split


def _empty_like_is_contiguous(t: Tensor) -> bool:
    """Whether ``torch.empty_like(t)`` is contiguous (then it is the cheapest allocation of an output
    shaped and typed like ``t``): ``t`` contiguous, or not dense (``empty_like`` then falls back to
    contiguous strides). Decided once per plan on a meta tensor."""
    if t.is_contiguous():
        return True
    try:
        return torch.empty_like(t, device="meta").is_contiguous()
    except Exception:  # noqa: BLE001 - fake / exotic tensors: allocate explicitly
        return False


def _rows(t: Tensor, N: int) -> Tensor:
    """``t`` as contiguous ``(M, N)`` rows (a copy: its leading dims could not be merged)."""
    return t.reshape(-1, N).contiguous()


class _DBias:
    """The bias-gradient part of a backward: fp32 partials of ``splits`` row splits, summed by a second
    kernel (one split: the main kernel writes the gradient itself, in its dtype)."""

    __slots__ = ("part", "final", "splits", "N")

    def __init__(self, splits: int, N: int, dev: torch.device):
        self.splits, self.N = splits, N
        self.part = (splits, N) if splits > 1 else None
        self.final = None
        if splits > 1:
            bn = min(TUNING["dbias_sum_block_n"], next_pow2(N))
            bs = min(TUNING["dbias_sum_block_s"], next_pow2(splits))
            self.final = Launch(_dbias_sum_kernel, (cdiv(N, bn),), dict(BLOCK_S=bs, BLOCK_N=bn), 4, device=dev)


# -------------------------------------------------------------------------------------- act fwd


class ActPlan:
    """``act(x + bias)`` of one signature: the forward launch, ReLU's bit-mask forward (eager autograd),
    and the backward plans of ``bias_act``'s autograd. Holds no tensors.

    Built from example tensors (real in eager mode, fake under ``torch.compile``: ``traced``).
    """

    __slots__ = ("act", "shape", "dtype", "device", "has_bias", "bias_dtype", "bias_copy", "use_kernel", "mask_ok",
                 "inplace_ok", "copy", "like", "M", "N", "fwd", "tail", "stream", "_mask", "_bwd", "_mask_bwd")

    def __init__(self, x: Tensor, bias: Tensor | None, act: str, traced: bool = False) -> None:
        check_tensor("x", x)
        check_activation(act)
        check_bias(x, bias)
        self.act = act
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device
        self.has_bias = bias is not None
        self.bias_dtype = bias.dtype if bias is not None else x.dtype
        self.inplace_ok = x.is_contiguous()
        self.bias_copy = bias is not None and not bias.is_contiguous()
        self.use_kernel = _use_kernel(x, traced)
        self.mask_ok = self.use_kernel and act in MASK_ACTIVATIONS and not traced
        self._mask = None
        self._bwd: dict = {}
        self._mask_bwd: dict = {}
        if not self.use_kernel:
            return
        self.stream = stream_getter(x.device)
        self.like = not traced and _empty_like_is_contiguous(x)
        M, N, (self.copy,), (sx,) = _geometry([x], bias is not None, traced)
        self.M, self.N = M, N
        block_m, block_n, ncb = _blocks(M, N)
        one_row = isinstance(M, int) and M == 1
        self.fwd = Launch(_act_fwd_kernel, (cdiv(M, block_m) * ncb,),
                          dict(ACT=ACT_CODES[act], HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n),
                          _warps(block_m, block_n), device=x.device)
        self.tail = (M, N, sx, 0 if one_row else N, ncb)

    def _out(self, x: Tensor) -> Tensor:
        return torch.empty_like(x) if self.like else torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def forward(self, x: Tensor, bias: Tensor | None, out: Tensor | None = None, traced: bool = False) -> Tensor:
        """``act(x + bias)``: a contiguous tensor of ``x``'s shape and dtype (``out`` when given: contiguous
        like ``x``, may be ``x`` itself)."""
        if not self.use_kernel:
            y = act_fwd_ref(x, bias, self.act)
            if out is None:
                return y
            out.copy_(y)
            return out
        y = self._out(x) if out is None else out
        if self.copy:
            x = _rows(x, self.N)
        if self.bias_copy:
            bias = bias.contiguous()
        if traced:
            self.fwd.traced(x, bias, y, *self.tail)
        else:
            # Fresh allocations are aligned: only the caller's tensors are checked.
            p = x.data_ptr() if out is None else x.data_ptr() | out.data_ptr()
            if bias is not None:
                p |= bias.data_ptr()
            self.fwd(self.stream(), p & 15 == 0, x, bias, y, *self.tail)
        return y

    # ------------------------------------------------------------------ ReLU with a bit mask
    def _plan_mask(self):
        M, N = self.M, self.N
        NB = cdiv(N, 8)
        elems = TUNING["block_elems"]
        block_b = min(next_pow2(NB), (elems if M == 1 else TUNING["max_block_n"]) // 8)
        block_m = max(1, min(elems // (8 * block_b), next_pow2(M)))
        nbb = cdiv(NB, block_b)
        la = Launch(_relu_mask_fwd_kernel, (cdiv(M, block_m) * nbb,),
                    dict(GE0=self.act == "relu_ge0", HAS_BIAS=self.has_bias, BLOCK_M=block_m, BLOCK_B=block_b),
                    _warps(block_m, 8 * block_b), device=self.device)
        self._mask = (la, (M, NB), (M, N, NB, self.tail[2], N if M > 1 else 0, nbb))
        return self._mask

    def forward_mask(self, x: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
        """``relu(x + bias)`` and its bit mask (``x + bias > 0``, ``>= 0`` for ``relu_ge0``): uint8
        ``(M, cdiv(N, 8))``, bit ``c % 8`` of byte ``c // 8``. Eager kernels only (``mask_ok``)."""
        la, mask_shape, tail = self._mask or self._plan_mask()
        y = self._out(x)
        if self.copy:
            x = _rows(x, self.N)
        if self.bias_copy:
            bias = bias.contiguous()
        mask = torch.empty(mask_shape, dtype=torch.uint8, device=self.device)
        p = x.data_ptr()
        if bias is not None:
            p |= bias.data_ptr()
        la(self.stream(), p & 15 == 0, x, bias, y, mask, *tail)
        return y, mask

    def _plan_mask_bwd(self, want_db: bool):
        M, N, dev = self.M, self.N, self.device
        NB = cdiv(N, 8)
        s = N if M > 1 else 0  # dy and dx are contiguous
        if want_db:
            block_m = TUNING["dbias_block_m"]
            block_b = max(1, min(TUNING["dbias_block_n"] // 8, next_pow2(NB)))
            nbb = cdiv(NB, block_b)
            splits, rows_per_split = _split_rows(M, nbb, block_m, dev)
            la = Launch(_relu_mask_bwd_dbias_kernel, (nbb, splits),
                        dict(PREFETCH=TUNING["dbias_prefetch"], BLOCK_M=block_m, BLOCK_B=block_b),
                        TUNING["dbias_warps"], device=dev)
            entry = (la, (M, N, NB, s, s, rows_per_split), _DBias(splits, N, dev))
        else:
            elems = TUNING["block_elems"]
            block_b = min(next_pow2(NB), (elems if M == 1 else TUNING["max_block_n"]) // 8)
            block_m = max(1, min(elems // (8 * block_b), next_pow2(M)))
            nbb = cdiv(NB, block_b)
            la = Launch(_relu_mask_bwd_kernel, (cdiv(M, block_m) * nbb,), dict(BLOCK_M=block_m, BLOCK_B=block_b),
                        _warps(block_m, 8 * block_b), device=dev)
            entry = (la, (M, N, NB, s, s, nbb), None)
        self._mask_bwd[want_db] = entry
        return entry

    def backward_mask(self, dy: Tensor, mask: Tensor, want_db: bool) -> tuple[Tensor, Tensor | None]:
        """``(dx, dbias)`` of ``forward_mask`` from the incoming gradient and the saved mask (``dbias`` in
        the bias dtype, ``None`` unless ``want_db``)."""
        la, tail, dbias = self._mask_bwd.get(want_db) or self._plan_mask_bwd(want_db)
        if not dy.is_contiguous():
            dy = dy.contiguous()
        dx = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        stream = self.stream()
        aligned = dy.data_ptr() & 15 == 0
        if dbias is None:
            la(stream, aligned, dy, mask, dx, *tail)
            return dx, None
        db = torch.empty((self.N,), dtype=self.bias_dtype, device=self.device)
        if dbias.part is None:
            la(stream, aligned, dy, mask, dx, db, *tail)
        else:
            part = torch.empty(dbias.part, dtype=_F32, device=self.device)
            la(stream, aligned, dy, mask, dx, part, *tail)
            dbias.final(stream, True, part, db, dbias.splits, dbias.N)
        return dx, db

    # ----------------------------------------------------------------- bias_act's backward
    def backward(self, dy: Tensor, x: Tensor, bias: Tensor | None, want_db: bool) -> tuple[Tensor, Tensor | None]:
        """``(dx, dbias)`` of ``act(x + bias)`` (eager autograd of ``bias_act``; ``dbias`` in the bias dtype)."""
        if not dy.is_contiguous():
            dy = dy.contiguous()
        b = self._bwd.get(want_db)
        if b is None:
            b = self._bwd[want_db] = ActBwdPlan(dy, x, bias, self.act, False, want_db, self.bias_dtype, False)
        dx, db, _ = b.run(dy, x, bias)
        return dx, db


# ------------------------------------------------------------------------------------- act bwd


class ActBwdPlan:
    """The backward of ``act(x + bias)`` for one signature: ``dx = g * act'(x + bias)`` (``act'`` from the
    output ``x = act(.)`` with ``from_output``), the bias gradient (column sums of ``dx``, fp32
    accumulation) with ``want_db``, ``act(x + bias)`` again with ``store_out``."""

    __slots__ = ("act", "from_output", "want_db", "db_dtype", "store_out", "shape", "dtype", "device", "use_kernel",
                 "copy_g", "copy_x", "bias_copy", "N", "main", "tail", "dbias", "stream", "inplace_ok", "like")

    def __init__(self, g: Tensor, x: Tensor, bias: Tensor | None, act: str, from_output: bool, want_db: bool,
                 db_dtype: torch.dtype, store_out: bool, traced: bool = False) -> None:
        check_tensor("x", x)
        check_tensor("g", g)
        check_same("g", g, x)
        check_activation(act)
        check_bias(x, bias)
        if from_output and act not in FROM_OUTPUT_ACTIVATIONS:
            raise ValueError(f"act' from the output is not defined for {act!r} (only {list(FROM_OUTPUT_ACTIVATIONS)})")
        if from_output and store_out:
            raise ValueError("store_out needs the pre-activation (from_output=False)")
        if want_db and x.dim() == 0:
            raise ValueError("the bias gradient needs x with at least one dimension")
        self.act, self.from_output, self.want_db = act, bool(from_output), bool(want_db)
        self.db_dtype, self.store_out = db_dtype, bool(store_out)
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device
        self.use_kernel = _use_kernel(x, traced)
        self.inplace_ok = g.dtype == x.dtype and g.is_contiguous()
        self.bias_copy = bias is not None and not bias.is_contiguous()
        self.dbias = None
        if not self.use_kernel:
            return
        dev = x.device
        self.stream = stream_getter(dev)
        self.like = not traced and _empty_like_is_contiguous(x)
        M, N, (self.copy_g, self.copy_x), (sg, sx) = _geometry([g, x], bias is not None or want_db, traced)
        self.N = N
        so = 0 if (isinstance(M, int) and M == 1) else N  # dx and the recomputed output are contiguous
        meta = dict(ACT=ACT_CODES[act], HAS_BIAS=bias is not None, FROM_OUTPUT=self.from_output,
                    STORE_OUT=self.store_out)
        if want_db:
            block_m = TUNING["dbias_block_m"]
            block_n = min(TUNING["dbias_block_n"], next_pow2(N))
            ncb = cdiv(N, block_n)
            splits, rows_per_split = _split_rows(M, ncb, block_m, dev)
            self.main = Launch(_act_bwd_dbias_kernel, (ncb, splits),
                               dict(**meta, PREFETCH=TUNING["dbias_prefetch"], BLOCK_M=block_m, BLOCK_N=block_n),
                               TUNING["dbias_warps"], device=dev)
            self.tail = (M, N, sg, sx, so, so, rows_per_split)
            self.dbias = _DBias(splits, N, dev)
        else:
            block_m, block_n, ncb = _blocks(M, N)
            self.main = Launch(_act_bwd_kernel, (cdiv(M, block_m) * ncb,), dict(**meta, BLOCK_M=block_m,
                                                                                  BLOCK_N=block_n),
                               _warps(block_m, block_n), device=dev)
            self.tail = (M, N, sg, sx, so, so, ncb)

    def run(self, g: Tensor, x: Tensor, bias: Tensor | None, out: Tensor | None = None, traced: bool = False
            ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``(dx, dbias, y)``, absent results ``None``. ``dx`` is contiguous of ``x``'s shape and dtype
        (``out`` when given: contiguous like ``x``, such as ``g`` itself)."""
        if not self.use_kernel:
            dx, db, y = act_bwd_ref(g, x, bias, self.act, self.from_output, self.want_db, self.db_dtype,
                                    self.store_out)
            if out is not None:
                out.copy_(dx)
                dx = out
            return dx, db, y
        dev = self.device
        if out is not None:
            dx = out
        elif self.like:
            dx = torch.empty_like(x)
        else:
            dx = torch.empty(self.shape, dtype=self.dtype, device=dev)
        y = torch.empty_like(dx) if self.store_out else None
        if self.copy_g:
            g = _rows(g, self.N)
        if self.copy_x:
            x = _rows(x, self.N)
        if self.bias_copy:
            bias = bias.contiguous()
        if traced:
            stream, aligned = None, True
        else:
            stream = self.stream()
            p = g.data_ptr() | x.data_ptr()  # dx is g or fresh
            if bias is not None:
                p |= bias.data_ptr()
            aligned = p & 15 == 0
        d = self.dbias
        if d is None:
            args = (g, x, bias, dx, y, *self.tail)
            self.main.traced(*args) if traced else self.main(stream, aligned, *args)
            return dx, None, y
        db = torch.empty((d.N,), dtype=self.db_dtype, device=dev)
        part = db if d.part is None else torch.empty(d.part, dtype=_F32, device=dev)
        args = (g, x, bias, dx, y, part, *self.tail)
        self.main.traced(*args) if traced else self.main(stream, aligned, *args)
        if d.final is not None:
            args = (part, db, d.splits, d.N)
            d.final.traced(*args) if traced else d.final(stream, True, *args)
        return dx, db, y


# ---------------------------------------------------------------------------------------- gated


class GluPlan:
    """``act(x) * u`` and its backward for one signature (``x``, ``u`` of one shape, any row strides).

    ``packable``: ``x`` and ``u`` are laid out like the two halves of one contiguous ``(..., 2N)`` tensor
    (row stride ``2N``); the caller checks per call that they really are (``packed_order``), and then
    ``forward_packed`` / ``backward_packed`` read the whole tensor through one pointer and write its
    gradient as one ``(..., 2N)`` buffer, which saves the concatenation autograd does for ``chunk``.

    ``reuse_saved``: ``x`` and ``u`` are contiguous, so a backward whose saved ``x`` / ``u`` nothing else holds
    (``common.function.saved_memory_free``) may write ``dx`` / ``du`` into them (``backward``'s ``out``).
    """

    __slots__ = ("act", "shape", "dtype", "u_dtype", "device", "use_kernel", "copies", "N", "fwd", "fwd_tail",
                 "bwd", "bwd_tail", "stream", "like_x", "like_u", "packable", "base_shape", "half_bytes", "_packed",
                 "geom", "reuse_saved")

    def __init__(self, x: Tensor, u: Tensor, act: str, traced: bool = False) -> None:
        check_tensor("x", x)
        check_tensor("u", u)
        check_same("u", u, x)
        check_activation(act, GATED_ACTIVATIONS)
        self.act = act
        self.shape, self.dtype, self.u_dtype, self.device = x.shape, x.dtype, u.dtype, x.device
        self.use_kernel = _use_kernel(x, traced)
        self.packable = False
        self._packed: dict = {}
        self.bwd = None
        self.reuse_saved = False
        if not self.use_kernel:
            return
        self.stream = stream_getter(x.device)
        self.like_x = not traced and _empty_like_is_contiguous(x)
        self.like_u = not traced and _empty_like_is_contiguous(u)
        M, N, self.copies, (sx, su) = _geometry([x, u], False, traced)
        self.N = N
        self.geom = (M, N, sx, su)
        block_m, block_n, ncb = _blocks(M, N)
        one_row = isinstance(M, int) and M == 1
        so = 0 if one_row else N
        meta = dict(ACT=ACT_CODES[act], BLOCK_M=block_m, BLOCK_N=block_n)
        grid = (cdiv(M, block_m) * ncb,)
        warps = _warps(block_m, block_n)
        self.fwd = Launch(_glu_fwd_kernel, grid, meta, warps, device=x.device)
        self.fwd_tail = (M, N, sx, su, so, 0, 0, ncb)
        self.bwd = Launch(_glu_bwd_kernel, grid, meta, warps, device=x.device)
        self.bwd_tail = (M, N, so, sx, su, so, so, 0, 0, ncb)
        self.packable = (not traced and not one_row and N > 0 and sx == su == 2 * N and not any(self.copies)
                         and x.dtype == u.dtype)
        if self.packable:
            self.base_shape = torch.Size((*x.shape[:-1], 2 * N))
            self.half_bytes = N * x.element_size()
        self.reuse_saved = not traced and not any(self.copies) and x.is_contiguous() and u.is_contiguous()
        if self.reuse_saved or self.packable:
            calibrate_saved_memory()

    def _outs(self, x: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
        dx = torch.empty_like(x) if self.like_x else torch.empty(self.shape, dtype=self.dtype, device=self.device)
        du = torch.empty_like(u) if self.like_u else torch.empty(self.shape, dtype=self.u_dtype, device=self.device)
        return dx, du

    def forward(self, x: Tensor, u: Tensor, traced: bool = False) -> Tensor:
        """``act(x) * u``: a contiguous tensor of ``x``'s shape and dtype."""
        if not self.use_kernel:
            return glu_fwd_ref(x, u, self.act)
        y = torch.empty_like(x) if self.like_x else torch.empty(self.shape, dtype=self.dtype, device=self.device)
        cx, cu = self.copies
        if cx:
            x = _rows(x, self.N)
        if cu:
            u = _rows(u, self.N)
        if traced:
            self.fwd.traced(x, u, y, *self.fwd_tail)
        else:
            self.fwd(self.stream(), (x.data_ptr() | u.data_ptr()) & 15 == 0, x, u, y, *self.fwd_tail)
        return y

    def backward(self, dy: Tensor, x: Tensor, u: Tensor, traced: bool = False,
                 out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """``(dx, du)`` of ``act(x) * u``: contiguous, in the dtypes of ``x`` and ``u``; written into ``out``
        when given (``reuse_saved`` plans: ``x`` / ``u`` themselves, each element read before it is written)."""
        if not self.use_kernel:
            return glu_bwd_ref(dy, x, u, self.act)
        if not dy.is_contiguous():
            dy = dy.contiguous()
        dx, du = self._outs(x, u) if out is None else out
        cx, cu = self.copies
        if cx:
            x = _rows(x, self.N)
        if cu:
            u = _rows(u, self.N)
        if traced:
            self.bwd.traced(dy, x, u, dx, du, *self.bwd_tail)
        else:
            aligned = (dy.data_ptr() | x.data_ptr() | u.data_ptr()) & 15 == 0
            self.bwd(self.stream(), aligned, dy, x, u, dx, du, *self.bwd_tail)
        return dx, du

    # ----------------------------------------------------------------------- packed halves
    def packed_order(self, x: Tensor, u: Tensor, base: Tensor) -> int:
        """``0`` when ``x`` / ``u`` are the first / second half of every row of ``base`` (contiguous
        ``(..., 2N)``), ``1`` when the other way round, ``-1`` when they are not its two halves."""
        if base.shape != self.base_shape or not base.is_contiguous():
            return -1
        px, pu, pb = x.data_ptr(), u.data_ptr(), base.data_ptr()
        if px == pb and pu - px == self.half_bytes:
            return 0
        if pu == pb and px - pu == self.half_bytes:
            return 1
        return -1

    def _plan_packed(self, order: int):
        M, N, _, _ = self.geom
        block_m, block_n, ncb = _blocks(M, N)
        meta = dict(ACT=ACT_CODES[self.act], BLOCK_M=block_m, BLOCK_N=block_n)
        grid = (cdiv(M, block_m) * ncb,)
        warps = _warps(block_m, block_n)
        xo, uo = (0, N) if order == 0 else (N, 0)
        entry = (Launch(_glu_fwd_kernel, grid, meta, warps, device=self.device), (M, N, 2 * N, 2 * N, N, xo, uo, ncb),
                 Launch(_glu_bwd_kernel, grid, meta, warps, device=self.device),
                 (M, N, N, 2 * N, 2 * N, 2 * N, 2 * N, xo, uo, ncb))
        self._packed[order] = entry
        return entry

    def forward_packed(self, base: Tensor, order: int) -> Tensor:
        """``act(x) * u`` with ``x`` / ``u`` the halves of ``base`` (``packed_order``'s ``order``)."""
        fwd, tail, _, _ = self._packed.get(order) or self._plan_packed(order)
        y = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        fwd(self.stream(), base.data_ptr() & 15 == 0, base, base, y, *tail)
        return y

    def backward_packed(self, dy: Tensor, base: Tensor, order: int, out: Tensor | None = None) -> Tensor:
        """The gradient of ``base`` (contiguous, its shape): ``dx`` and ``du`` in their halves (in ``out`` when
        given: ``base`` itself when nothing else holds it)."""
        _, _, bwd, tail = self._packed.get(order) or self._plan_packed(order)
        if not dy.is_contiguous():
            dy = dy.contiguous()
        d = torch.empty_like(base) if out is None else out
        bwd(self.stream(), (dy.data_ptr() | base.data_ptr()) & 15 == 0, dy, base, base, d, d, *tail)
        return d
