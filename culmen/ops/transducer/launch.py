"""Call plans of the transducer joint and RNN-T loss: validate once per signature, then allocate and launch.

``JointPlan`` and ``LossPlan`` hold what ``transducer_joint`` / ``rnnt_loss`` derive from a call signature
(shapes, dtypes, devices, flags, ``blank_idx``, ``max_f_len``, ``packed_batch``): the checks passed, the
tiles, grids and bound ``Launch`` of every kernel. Values (lengths, labels, batch offsets) are checked
per call only where that costs no device sync: CPU tensors, or any device with
``culmen.ops.backend.set_check_values(True)``. The kernels clamp every length and label, so unchecked
bad values give wrong numbers, never out-of-bounds accesses.

fp64 inputs and CPU tensors (unless the backend is ``triton``) take the reference in ``reference.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import check_values_on, choose_backend
from culmen.ops.common.launch import Launch, PlanTuning, aligned_16, cdiv, next_pow2, stream_getter, traceable_kernels
from culmen.ops.common.plans import PlanCache, clear_plans
from culmen.ops.transducer import reference as ref
from culmen.ops.transducer.kernels import (
    _joint_bwd_f_kernel,
    _joint_bwd_g_kernel,
    _joint_fwd_kernel,
    _rnnt_alpha_beta_kernel,
    _rnnt_bwd_kernel,
    _rnnt_logprobs_kernel,
    _zero_tail_kernel,
)

TUNING = PlanTuning({
    # Elements per program tile of the streaming kernels (joint forward / backward, loss passes).
    "tile": 4096,
    "max_block_h": 512,
    "max_block_k": 1024,
    "warps": 4,
    "loss_warps": 8,
}, clear_plans)

JOINT_PLANS = PlanCache("transducer_joint")
LOSS_PLANS = PlanCache("transducer_loss")

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Sizes may be symbolic where torch.compile traces the plans (dynamic shapes).
_INT = (int, torch.SymInt)
STATS = ("alpha", "beta", "lse", "lpb", "lpe")  # the loss forward's (B, T, U) statistics, in op output order


def _is_int_tensor(t) -> bool:
    return isinstance(t, Tensor) and not t.dtype.is_floating_point and not t.dtype.is_complex and \
        t.dtype != torch.bool


def _check_float(name: str, op: str, t, dim: int) -> None:
    if not isinstance(t, Tensor) or t.dtype not in _FLOATS:
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"{op}: {name} must be a float16/bfloat16/float32/float64 tensor, got {got}")
    if t.dim() != dim:
        raise ValueError(f"{op}: {name} must be {dim}-D, got shape {tuple(t.shape)}")


def _check_lengths(name: str, op: str, t, B: int, device: torch.device) -> None:
    """``t`` (``f_len``, ``g_len``, ``y_len`` or ``batch_offset``) must be an integer tensor of shape ``(B,)`` on
    ``device``."""
    if not _is_int_tensor(t):
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"{op}: {name} must be an integer tensor, got {got}")
    if tuple(t.shape) != (B,):
        raise ValueError(f"{op}: {name} must have shape ({B},) (one per batch), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but the inputs are on {device}")


def _bad(name: str, op: str, values: Tensor, what: str) -> ValueError:
    return ValueError(f"{op}: {name} {what}; got {values.tolist()[:16]}")


def _contig(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _pow2_le(n: int, cap: int) -> int:
    return max(1, min(next_pow2(max(n, 1)), cap))


# ----------------------------------------------------------------------------------------------- joint


class JointPlan:
    """Everything ``transducer_joint`` derives from one call signature. Holds no tensors.

    ``traced``: built inside the ``torch.compile`` ops (``forward_traced`` / ``backward_traced``): no value checks.
    """

    __slots__ = ("B", "T", "U", "H", "dtype", "device", "pack", "relu", "dropout_p", "scale", "store_mask",
                 "packed_batch", "check_values", "use_kernel", "stream", "fwd", "bwd_f", "bwd_g", "tail", "tail_mask",
                 "empty")

    def __init__(self, f, g, f_len, g_len, batch_offset, packed_batch, pack_output: bool, relu: bool,
                 dropout_p: float | None, store_mask: bool, traced: bool = False):
        op = "transducer_joint"
        _check_float("f", op, f, 3)
        _check_float("g", op, g, 3)
        if g.dtype != f.dtype or g.device != f.device:
            raise TypeError(f"{op}: g must have f's dtype and device ({f.dtype}, {f.device}), got ({g.dtype}, "
                            f"{g.device})")
        B, T, H = f.shape
        if g.shape[0] != B or g.shape[2] != H:
            raise ValueError(f"{op}: g must have shape ({B}, U, {H}) to match f {tuple(f.shape)}, got "
                             f"{tuple(g.shape)}")
        U = g.shape[1]
        _check_lengths("f_len", op, f_len, B, f.device)
        _check_lengths("g_len", op, g_len, B, f.device)
        self.pack = bool(pack_output)
        if self.pack:
            _check_lengths("batch_offset", op, batch_offset, B, f.device)
            if isinstance(packed_batch, bool) or not isinstance(packed_batch, _INT) or packed_batch < 0:
                raise ValueError(f"{op}: packed_batch must be a non-negative int when packing, got {packed_batch!r}")
        if dropout_p is not None and not 0.0 <= float(dropout_p) <= 1.0:
            raise ValueError(f"{op}: dropout_prob must be in [0, 1], got {dropout_p}")
        self.B, self.T, self.U, self.H = B, T, U, H
        self.dtype, self.device = f.dtype, f.device
        self.relu = bool(relu)
        self.dropout_p = None if dropout_p is None else float(dropout_p)
        # Apex: kept elements scale by 1 / (1 - p); p = 1 drops everything (scale 0).
        self.scale = 1.0 if self.dropout_p is None else (0.0 if self.dropout_p >= 1.0 else 1.0 / (1.0 - self.dropout_p))
        self.store_mask = bool(store_mask) and (self.relu or self.dropout_p is not None)
        self.packed_batch = packed_batch if self.pack else 0
        self.stream = stream_getter(f.device)
        self.check_values = not traced and (check_values_on() or (f.device.type == "cpu" and self.stream() is None))
        self.use_kernel = f.dtype != torch.float64 and choose_backend(f.device) == "triton"
        if traced:
            self.use_kernel = self.use_kernel and traceable_kernels()
        self.empty = B * T * U * H == 0
        if self.use_kernel:
            self._plan()

    def _plan(self) -> None:
        B, T, U, H, dev = self.B, self.T, self.U, self.H, self.device
        tile, warps = TUNING["tile"], TUNING["warps"]
        bh = _pow2_le(H, TUNING["max_block_h"])
        bu = _pow2_le(U, max(1, tile // bh))
        masked = self.relu or self.dropout_p is not None
        flags = dict(PACK=self.pack, RELU=self.relu, DROPOUT=self.dropout_p is not None)
        self.fwd = Launch(_joint_fwd_kernel, (B * T, cdiv(U, bu), cdiv(H, bh)),
                          dict(flags, STORE_MASK=self.store_mask and masked, BLOCK_U=bu, BLOCK_H=bh), warps,
                          device=dev)
        bh2 = _pow2_le(H, 256)
        rows = max(1, min(16, tile // bh2))
        self.bwd_f = Launch(_joint_bwd_f_kernel, (B * T, cdiv(H, bh2)),
                            dict(flags, BLOCK_U=_pow2_le(U, rows), BLOCK_H=bh2), warps, device=dev)
        self.bwd_g = Launch(_joint_bwd_g_kernel, (B * U, cdiv(H, bh2)),
                            dict(flags, BLOCK_T=_pow2_le(T, rows), BLOCK_H=bh2), warps, device=dev)
        # One launch per output dtype: a bound launch serves the argument types it was compiled for.
        br = max(1, tile // bh)
        tail_grid = (max(1, cdiv(self.packed_batch, br)),)
        self.tail = self.tail_mask = None
        if self.pack:
            self.tail = Launch(_zero_tail_kernel, tail_grid, dict(BLOCK_R=br, BLOCK_W=bh), warps, device=dev)
            self.tail_mask = Launch(_zero_tail_kernel, tail_grid, dict(BLOCK_R=br, BLOCK_W=bh), warps, device=dev)

    def prepare(self, f, g, f_len, g_len, batch_offset):
        """The call's tensors as the kernels read them, after the value checks when they are on."""
        f, g, f_len, g_len = _contig(f), _contig(g), _contig(f_len), _contig(g_len)
        boff = _contig(batch_offset) if self.pack else None
        if self.check_values:
            self._check_values(f_len, g_len, boff)
        return f, g, f_len, g_len, boff

    def _check_values(self, f_len, g_len, boff) -> None:
        op = "transducer_joint"
        if f_len.numel() and (int(f_len.min()) < 0 or int(f_len.max()) > self.T):
            raise _bad("f_len", op, f_len, f"must be in [0, {self.T}] (f's time dimension T={self.T})")
        if g_len.numel() and (int(g_len.min()) < 0 or int(g_len.max()) > self.U):
            raise _bad("g_len", op, g_len, f"must be in [0, {self.U}] (g's length dimension U={self.U})")
        if self.pack and self.B:
            want = torch.cumsum(f_len.to(torch.int64) * g_len.to(torch.int64), 0)
            if not torch.equal(boff.to(torch.int64), want):
                raise _bad("batch_offset", op, boff, f"must be cumsum(f_len * g_len) = {want.tolist()[:16]}")
            if int(want[-1]) > self.packed_batch:
                raise ValueError(f"{op}: packed_batch={self.packed_batch} is smaller than the {int(want[-1])} "
                                 "rows the lengths need (batch_offset[-1])")

    def _rng(self) -> Tensor | None:
        if self.dropout_p is None:
            return None
        # (seed, offset) from torch's generator of the device: torch.manual_seed replays the mask.
        return torch.randint(0, 2**62, (2,), device=self.device, dtype=torch.int64)

    def forward(self, f, g, f_len, g_len, boff) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``(h, mask, rng)``: the joint output, the uint8 keep-mask (``store_mask`` only) and the dropout
        ``(seed, offset)`` the backward replays (``None`` without dropout)."""
        rng = self._rng()
        if not self.use_kernel:
            h, keep = ref.transducer_joint_fwd_ref(f, g, f_len, g_len, boff, self.packed_batch, self.pack, self.relu,
                                                   self.dropout_p, self.scale, rng)
            return h, (keep if self.store_mask else None), rng
        B, T, U, H = self.B, self.T, self.U, self.H
        shape = (self.packed_batch, H) if self.pack else (B, T, U, H)
        h = torch.empty(shape, device=self.device, dtype=self.dtype)
        mask = torch.empty(shape, device=self.device, dtype=torch.uint8) if self.store_mask else None
        if h.numel() == 0:
            return h, mask, rng
        ph = f_len  # any tensor stands in for an unused pointer
        rng_t = ph if rng is None else rng
        boff_t = ph if boff is None else boff
        stream = self.stream()
        if not self.empty:
            self.fwd(stream, aligned_16(f, g, f_len, g_len, boff_t, rng_t, h, mask),
                     f, g, f_len, g_len, boff_t, rng_t, h, h if mask is None else mask, T, U, H, self.packed_batch,
                     self.dropout_p or 0.0, self.scale)
        if self.pack and B:
            self.tail(stream, aligned_16(h, boff), h, boff, B, self.packed_batch, H)
            if mask is not None:
                self.tail_mask(stream, aligned_16(mask, boff), mask, boff, B, self.packed_batch, H)
        return h, mask, rng

    def backward(self, dh, f, g, f_len, g_len, boff, rng) -> tuple[Tensor, Tensor]:
        """``(df, dg)`` of the joint for the output gradient ``dh``."""
        if not self.use_kernel:
            return ref.transducer_joint_bwd_ref(dh, f, g, f_len, g_len, boff, self.pack, self.relu, self.dropout_p,
                                                self.scale, rng)
        dh = _contig(dh)
        df = torch.empty_like(f)
        dg = torch.empty_like(g)
        if self.empty:
            return df.zero_(), dg.zero_()
        ph = f_len
        rng_t = ph if rng is None else rng
        boff_t = ph if boff is None else boff
        stream = self.stream()
        aligned = aligned_16(dh, f, g, f_len, g_len, boff_t, rng_t, df, dg)
        p, s = self.dropout_p or 0.0, self.scale
        self.bwd_f(stream, aligned, dh, f, g, f_len, g_len, boff_t, rng_t, df, self.T, self.U, self.H, p, s)
        self.bwd_g(stream, aligned, dh, f, g, f_len, g_len, boff_t, rng_t, dg, self.T, self.U, self.H, p, s)
        return df, dg

    # torch.compile: the bodies of the ``culmen::transducer_joint_*`` ops. Launches go through
    # ``Launch.traced``; outputs are fresh tensors (custom ops return neither None nor aliases).
    def forward_traced(self, f, g, f_len, g_len, boff, rng) -> tuple[Tensor, Tensor]:
        """``(h, mask)`` for contiguous inputs and the dropout ``rng`` the caller drew (``None`` without
        dropout); ``mask`` is a 0-element uint8 tensor unless ``store_mask``."""
        if not self.use_kernel:
            h, keep = ref.transducer_joint_fwd_ref(f, g, f_len, g_len, boff, self.packed_batch, self.pack, self.relu,
                                                   self.dropout_p, self.scale, rng)
            mask = keep if self.store_mask else None
        else:
            B, T, U, H = self.B, self.T, self.U, self.H
            shape = (self.packed_batch, H) if self.pack else (B, T, U, H)
            h = torch.empty(shape, device=self.device, dtype=self.dtype)
            mask = torch.empty(shape, device=self.device, dtype=torch.uint8) if self.store_mask else None
            rng_t = f_len if rng is None else rng
            boff_t = f_len if boff is None else boff
            if not self.empty:
                self.fwd.traced(f, g, f_len, g_len, boff_t, rng_t, h,
                                torch.empty(1, device=self.device, dtype=torch.uint8) if mask is None else mask,
                                T, U, H, self.packed_batch, self.dropout_p or 0.0, self.scale)
            if self.pack and B:
                self.tail.traced(h, boff, B, self.packed_batch, H)
                if mask is not None:
                    self.tail_mask.traced(mask, boff, B, self.packed_batch, H)
        return h, (torch.empty(0, device=self.device, dtype=torch.uint8) if mask is None else mask)

    def backward_traced(self, dh, f, g, f_len, g_len, boff, rng) -> tuple[Tensor, Tensor]:
        """``backward`` inside the ``culmen::transducer_joint_bwd`` op."""
        if not self.use_kernel:
            return ref.transducer_joint_bwd_ref(dh, f, g, f_len, g_len, boff, self.pack, self.relu, self.dropout_p,
                                                self.scale, rng)
        dh = dh.contiguous()
        df = torch.zeros_like(f) if self.empty else torch.empty_like(f)
        dg = torch.zeros_like(g) if self.empty else torch.empty_like(g)
        if not self.empty:
            rng_t = f_len if rng is None else rng
            boff_t = f_len if boff is None else boff
            p, s = self.dropout_p or 0.0, self.scale
            self.bwd_f.traced(dh, f, g, f_len, g_len, boff_t, rng_t, df, self.T, self.U, self.H, p, s)
            self.bwd_g.traced(dh, f, g, f_len, g_len, boff_t, rng_t, dg, self.T, self.U, self.H, p, s)
        return df, dg


# ------------------------------------------------------------------------------------------------ loss


def check_loss_inputs(op: str, name: str, x: Tensor, label, f_len, y_len, blank_idx, batch_offset, max_f_len,
                      packed: bool, K: int, k_what: str) -> tuple[int, int, int, int | None]:
    """The RNN-T loss's label / length / blank checks shared by ``rnnt_loss`` and the fused projection loss:
    ``(B, T, U, max_f_len)`` of ``x`` (named ``name``: logits ``(B, T, U, K)`` or packed rows), ``K`` the vocabulary
    (``k_what`` says where it comes from in the message)."""
    if not _is_int_tensor(label):
        got = label.dtype if isinstance(label, Tensor) else type(label).__name__
        raise TypeError(f"{op}: label must be an integer tensor, got {got}")
    if label.dim() != 2:
        raise ValueError(f"{op}: label must be 2-D (B, max label length), got shape {tuple(label.shape)}")
    if label.device != x.device:
        raise ValueError(f"{op}: label is on {label.device} but {name} on {x.device}")
    B = label.shape[0]
    if packed:
        if isinstance(max_f_len, Tensor):
            max_f_len = int(max_f_len)
        if isinstance(max_f_len, bool) or not isinstance(max_f_len, _INT) or max_f_len < 1:
            raise ValueError(f"{op}: max_f_len must be a positive int with packed_input, got {max_f_len!r}")
        T, U = max_f_len, label.shape[1] + 1
        _check_lengths("batch_offset", op, batch_offset, B, x.device)
    else:
        if x.shape[0] != B:
            raise ValueError(f"{op}: {name} has batch size {x.shape[0]} but label has {B} rows")
        T, U = x.shape[1], x.shape[2]
        if label.shape[1] < U - 1:
            raise ValueError(f"{op}: label must have at least U-1={U - 1} columns for {name} of shape "
                             f"{tuple(x.shape)}, got {tuple(label.shape)}")
    _check_lengths("f_len", op, f_len, B, x.device)
    _check_lengths("y_len", op, y_len, B, x.device)
    if isinstance(blank_idx, bool) or not isinstance(blank_idx, _INT) or not 0 <= blank_idx < K:
        raise ValueError(f"{op}: blank_idx must be an int in [0, {K}) ({k_what}), got {blank_idx!r}")
    return B, T, U, max_f_len


class LossPlan:
    """Everything ``rnnt_loss`` derives from one call signature. Holds no tensors.

    ``traced``: built inside the ``torch.compile`` ops (``forward_traced`` / ``backward_traced``): no value checks.
    """

    __slots__ = ("B", "T", "U", "K", "N", "L", "blank", "packed", "dtype", "acc", "device", "check_values",
                 "use_kernel", "stream", "logprobs", "alpha_beta", "bwd", "tail")

    def __init__(self, x, label, f_len, y_len, blank_idx, batch_offset, max_f_len, packed_input: bool,
                 traced: bool = False):
        op = "transducer_loss"
        self.packed = bool(packed_input)
        _check_float("x", op, x, 2 if self.packed else 4)
        B, T, U, max_f_len = check_loss_inputs(op, "x", x, label, f_len, y_len, blank_idx, batch_offset, max_f_len,
                                               self.packed, x.shape[-1], "x's last dimension")
        K = x.shape[-1]
        if K == 0 or U == 0 or T == 0:
            raise ValueError(f"{op}: x must have non-empty time, label and vocabulary dimensions, got "
                             f"{tuple(x.shape)}")
        self.B, self.T, self.U, self.K, self.L, self.blank = B, T, U, K, label.shape[1], blank_idx
        self.N = x.shape[0] if self.packed else B * T * U
        self.dtype, self.device = x.dtype, x.device
        self.acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        self.stream = stream_getter(x.device)
        self.check_values = not traced and (check_values_on() or (x.device.type == "cpu" and self.stream() is None))
        self.use_kernel = x.dtype != torch.float64 and choose_backend(x.device) == "triton"
        if traced:
            self.use_kernel = self.use_kernel and traceable_kernels()
        if self.use_kernel:
            self._plan()

    def _plan(self) -> None:
        B, T, U, K, dev = self.B, self.T, self.U, self.K, self.device
        tile = TUNING["tile"]
        bk = _pow2_le(K, TUNING["max_block_k"])
        bu = _pow2_le(U, max(1, tile // bk))
        warps = TUNING["loss_warps"]
        grid = (B * T, cdiv(U, bu))
        meta = dict(PACK=self.packed, BLOCK_U=bu, BLOCK_K=bk)
        self.logprobs = Launch(_rnnt_logprobs_kernel, grid, meta, warps, device=dev)
        self.bwd = Launch(_rnnt_bwd_kernel, grid, meta, warps, device=dev)
        bu_scan = next_pow2(U)
        self.alpha_beta = Launch(_rnnt_alpha_beta_kernel, (B, 2), dict(BLOCK_U=bu_scan),
                                 max(1, min(8, bu_scan // 32)), device=dev)
        self.tail = None
        if self.packed:
            br = max(1, tile // bk)
            self.tail = Launch(_zero_tail_kernel, (max(1, cdiv(self.N, br)),), dict(BLOCK_R=br, BLOCK_W=bk), warps,
                               device=dev)

    def prepare(self, x, label, f_len, y_len, batch_offset):
        """The call's tensors as the kernels read them, after the value checks when they are on."""
        x, label, f_len, y_len = _contig(x), _contig(label), _contig(f_len), _contig(y_len)
        boff = _contig(batch_offset) if self.packed else None
        if self.check_values:
            self._check_values(label, f_len, y_len, boff)
        return x, label, f_len, y_len, boff

    def _check_values(self, label, f_len, y_len, boff) -> None:
        op = "transducer_loss"
        T, U = self.T, self.U
        tdim = "max_f_len" if self.packed else "x.shape[1]"
        if f_len.numel() and (int(f_len.min()) < 1 or int(f_len.max()) > T):
            raise _bad("f_len", op, f_len, f"must be in [1, {T}] ({tdim}={T})")
        udim = "label.shape[1]" if self.packed else "x.shape[2] - 1"
        if y_len.numel() and (int(y_len.min()) < 0 or int(y_len.max()) > U - 1):
            raise _bad("y_len", op, y_len, f"must be in [0, {U - 1}] ({udim}={U - 1})")
        lab = label[:, :U - 1]
        used = torch.arange(lab.shape[1], device=lab.device) < y_len.to(torch.int64).view(-1, 1)
        bad = used & ((lab < 0) | (lab >= self.K))
        if bool(bad.any()):
            raise _bad("label", op, lab[bad], f"values must be in [0, {self.K}) (x's last dimension)")
        if self.packed:
            want = torch.cumsum(f_len.to(torch.int64) * (y_len.to(torch.int64) + 1), 0)
            if not torch.equal(boff.to(torch.int64), want):
                raise _bad("batch_offset", op, boff, f"must be cumsum(f_len * (y_len + 1)) = {want.tolist()[:16]}")
            if self.B and int(want[-1]) > self.N:
                raise ValueError(f"{op}: x has {self.N} rows but the lengths need batch_offset[-1]={int(want[-1])}")

    def forward(self, x, label, f_len, y_len, boff) -> tuple[Tensor, dict[str, Tensor]]:
        """``(loss, saved)``: the per-batch loss (``x.dtype``) and the ``(B, T, U)`` statistics the backward
        reads (``alpha``, ``beta``, ``lse``, ``lpb``, ``lpe``; fp32, fp64 for fp64 ``x``)."""
        if not self.use_kernel:
            saved = ref.rnnt_loss_fwd_ref(x, label, f_len, y_len, self.blank, boff, self.T, self.packed)
            return saved.pop("loss"), saved
        B, T, U, dev = self.B, self.T, self.U, self.device
        saved = {name: torch.empty((B, T, U), device=dev, dtype=torch.float32)
                 for name in ("alpha", "beta", "lse", "lpb", "lpe")}
        loss = torch.empty((B,), device=dev, dtype=self.dtype)
        if B == 0:
            return loss, saved
        boff_t = f_len if boff is None else boff
        stream = self.stream()
        s = saved
        self.logprobs(stream, aligned_16(x, label, f_len, y_len, boff_t, *s.values()),
                      x, label, f_len, y_len, boff_t, s["lse"], s["lpb"], s["lpe"], T, U, self.K, self.N, self.L,
                      self.blank)
        self.alpha_beta(stream, aligned_16(f_len, y_len, loss, *s.values()),
                        f_len, y_len, s["lpb"], s["lpe"], s["alpha"], s["beta"], loss, T, U)
        return loss, saved

    def backward(self, loss_grad, x, label, f_len, y_len, boff, saved) -> Tensor:
        """The gradient of ``(loss_grad * loss).sum()`` w.r.t. ``x`` (softmax backward fused)."""
        loss_grad = _contig(loss_grad.to(self.dtype).expand(self.B))
        if not self.use_kernel:
            return ref.rnnt_loss_bwd_ref(loss_grad, x, label, f_len, y_len, self.blank, boff, self.T, self.packed,
                                         saved)
        dx = torch.empty_like(x)
        if self.B == 0:
            return dx.zero_()
        boff_t = f_len if boff is None else boff
        stream = self.stream()
        s = saved
        self.bwd(stream, aligned_16(x, dx, label, f_len, y_len, boff_t, loss_grad, *s.values()),
                 x, dx, label, f_len, y_len, boff_t, s["lse"], s["lpb"], s["lpe"], s["alpha"], s["beta"], loss_grad,
                 self.T, self.U, self.K, self.N, self.L, self.blank)
        if self.packed and self.N and self.B:
            self.tail(stream, aligned_16(dx, boff), dx, boff, self.B, self.N, self.K)
        return dx

    # torch.compile: the bodies of the ``culmen::rnnt_loss_*`` ops (see JointPlan.forward_traced).
    def forward_traced(self, x, label, f_len, y_len, boff) -> tuple[Tensor, ...]:
        """``(loss, alpha, beta, lse, lpb, lpe)`` for contiguous inputs (``forward``'s values, flattened)."""
        if not self.use_kernel:
            saved = ref.rnnt_loss_fwd_ref(x, label, f_len, y_len, self.blank, boff, self.T, self.packed)
            return tuple(saved[n] for n in ("loss", *STATS))
        B, T, U, dev = self.B, self.T, self.U, self.device
        s = {name: torch.empty((B, T, U), device=dev, dtype=torch.float32) for name in STATS}
        loss = torch.empty((B,), device=dev, dtype=self.dtype)
        if B:
            boff_t = f_len if boff is None else boff
            self.logprobs.traced(x, label, f_len, y_len, boff_t, s["lse"], s["lpb"], s["lpe"], T, U, self.K, self.N,
                                 self.L, self.blank)
            self.alpha_beta.traced(f_len, y_len, s["lpb"], s["lpe"], s["alpha"], s["beta"], loss, T, U)
        return (loss, *(s[n] for n in STATS))

    def backward_traced(self, loss_grad, x, label, f_len, y_len, boff, saved: dict[str, Tensor]) -> Tensor:
        """``backward`` inside the ``culmen::rnnt_loss_bwd`` op."""
        loss_grad = loss_grad.to(self.dtype).expand(self.B).contiguous()
        if not self.use_kernel:
            return ref.rnnt_loss_bwd_ref(loss_grad, x, label, f_len, y_len, self.blank, boff, self.T, self.packed,
                                         saved)
        if self.B == 0:
            return torch.zeros_like(x)
        dx = torch.empty_like(x)
        boff_t = f_len if boff is None else boff
        s = saved
        self.bwd.traced(x, dx, label, f_len, y_len, boff_t, s["lse"], s["lpb"], s["lpe"], s["alpha"], s["beta"],
                        loss_grad, self.T, self.U, self.K, self.N, self.L, self.blank)
        if self.packed and self.N:
            self.tail.traced(dx, boff, self.B, self.N, self.K)
        return dx
