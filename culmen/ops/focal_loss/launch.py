"""Call plans of the focal loss: validate once, then allocate and launch.

A ``FocalPlan`` holds everything ``focal_loss`` derives from one call signature (shapes, strides and
dtypes of the logits, labels and normalizer, the class count and the scalars): the checks passed, the
per-call conversions still needed (only for unusual layouts and dtypes: non-contiguous logits or
labels, labels neither int32 nor int64, a normalizer on another device or given as a number), the
tiles, grid and bound ``Launch`` of each kernel. A cached call costs one key, one dict lookup, two
allocations and two launches forward, one allocation and one launch backward.

``TUNING`` holds the tile rules so a sweep can change them at run time (every change drops the plans).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import check_values_on, choose_backend, interpreter_enabled, num_programs_hint
from culmen.ops.common.launch import Launch, PlanTuning, cdiv, next_pow2, stream_getter, traceable_kernels
from culmen.ops.common.plans import PlanCache, clear_plans
from culmen.ops.focal_loss.kernels import _focal_loss_bwd_kernel, _focal_loss_finish_kernel, _focal_loss_fwd_kernel
from culmen.ops.focal_loss.reference import focal_loss_bwd_ref, focal_loss_fwd_ref

TUNING = PlanTuning({
    # Elements per (rows x columns) tile of the forward and backward kernels (8 per thread at 8 warps).
    "fwd_tile": 2048,
    "bwd_tile": 2048,
    # Column-block candidates, widest first; the launcher takes the one wasting the fewest lanes.
    "block_c": (64, 32, 16, 8, 4),
    # Persistent forward programs per multiprocessor.
    "fwd_programs_per_sm": 4,
    "fwd_warps": 8,
    "bwd_warps": 8,
    # Hardware approximations of exp2 / log2 / 1/x for 16-bit logits on CUDA (see kernels.py).
    "fast_math": True,
}, clear_plans)

PLANS = PlanCache("focal_loss")

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def int_gamma(gamma: float) -> int:
    """``gamma`` as a small non-negative integer when it is one (multiplications instead of a pow), else -1."""
    g = float(gamma)
    return int(g) if g.is_integer() and 0.0 <= g <= 8.0 else -1


def _block_c(cols: int, elem: int) -> int:
    """The column block that wastes the fewest lanes on ``cols`` columns (ties: the widest), at least one
    16-byte vector of ``elem``-byte elements where the row allows it."""
    best, best_waste = 0, None
    for bc in TUNING["block_c"]:
        if bc * elem < 16 and best:
            break
        waste = cdiv(cols, bc) * bc - cols
        if best_waste is None or waste < best_waste:
            best, best_waste = bc, waste
    return best


def out_dtype(x: Tensor) -> torch.dtype:
    """The dtype of the loss: fp32, fp64 for fp64 logits."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_args(x, labels, nps, num_real_classes, gamma, label_smoothing) -> int:
    """The checks of ``focal_loss``' arguments (errors name them); returns ``num_real_classes`` as an int."""
    if not isinstance(x, Tensor) or x.dtype not in _FLOATS:
        got = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"focal_loss: cls_output must be a float16/bfloat16/float32/float64 tensor, got {got}")
    if not isinstance(labels, Tensor) or labels.dtype.is_floating_point or labels.dtype.is_complex or \
            labels.dtype == torch.bool:
        got = labels.dtype if isinstance(labels, Tensor) else type(labels).__name__
        raise TypeError(f"focal_loss: cls_targets_at_level must be an integer tensor, got {got}")
    if x.dim() == 0:
        raise ValueError("focal_loss: cls_output must have a class dimension, got a 0-dim tensor")
    if tuple(labels.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"focal_loss: cls_targets_at_level must have shape cls_output.shape[:-1] = "
                         f"{tuple(x.shape[:-1])}, got {tuple(labels.shape)}")
    if labels.device != x.device:
        raise ValueError(f"focal_loss: cls_targets_at_level is on {labels.device} but cls_output on {x.device}")
    C = x.shape[-1]
    num_real = int(num_real_classes)
    if not 0 <= num_real <= C:
        raise ValueError(f"focal_loss: num_real_classes must be in [0, {C}] (the class dim of cls_output), "
                         f"got {num_real_classes}")
    if float(gamma) < 0.0:
        raise ValueError(f"focal_loss: gamma must be >= 0, got {gamma}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"focal_loss: label_smoothing must be in [0, 1], got {label_smoothing}")
    if isinstance(nps, Tensor) and (nps.numel() != 1 or not nps.dtype.is_floating_point):
        raise ValueError(f"focal_loss: num_positives_sum must be a one-element float tensor, got shape "
                         f"{tuple(nps.shape)} and dtype {nps.dtype}")
    return num_real


class FocalPlan:
    """Everything ``focal_loss`` derives from one call signature. Holds no tensors.

    Built from example arguments (real tensors in eager mode, fake ones under ``torch.compile``:
    ``traced``, where the row count may be symbolic).
    """

    __slots__ = ("shape", "R", "C", "num_real", "alpha", "gamma", "smoothing", "device", "dtype", "loss_dtype",
                 "copy_x", "fix_labels", "nps_kind", "check_values", "use_kernel", "stream", "fwd", "finish",
                 "progs", "num_tiles", "bwd", "empty")

    def __init__(self, x, labels, nps, num_real_classes, alpha, gamma, label_smoothing, traced: bool = False):
        self.num_real = check_args(x, labels, nps, num_real_classes, gamma, label_smoothing)
        self.alpha, self.gamma, self.smoothing = float(alpha), float(gamma), float(label_smoothing)
        self.shape, self.device, self.dtype = x.shape, x.device, x.dtype
        self.loss_dtype = out_dtype(x)
        C = self.C = x.shape[-1]
        self.R = x.numel() // C if C else 0
        self.empty = isinstance(self.R, int) and self.R * C == 0  # no gradient to compute
        self.copy_x = not x.is_contiguous()
        self.fix_labels = not (labels.dtype in (torch.int32, torch.int64) and labels.is_contiguous())
        # 0: a one-element tensor the kernels read as it is; 1: one on another device; 2: a number.
        self.nps_kind = (0 if nps.device == x.device else 1) if isinstance(nps, Tensor) else 2
        # Values are checked where that costs no device sync: CPU tensors whose kernels really run (the
        # reference or the interpreter), or anywhere with ``set_check_values(True)``.
        self.stream = stream_getter(x.device)
        self.check_values = not traced and (check_values_on() or (x.device.type == "cpu" and self.stream() is None))
        # Triton passes float scalars (alpha, gamma, smoothing) as fp32: fp64 logits take the reference.
        self.use_kernel = x.dtype != torch.float64 and choose_backend(x.device) == "triton"
        if traced:
            self.use_kernel = self.use_kernel and traceable_kernels()
        if self.use_kernel:
            self._plan(x, traced)

    def _plan(self, x: Tensor, traced: bool) -> None:
        R, C, dev = self.R, self.C, self.device
        fast = (TUNING["fast_math"] and dev.type == "cuda" and torch.version.hip is None and x.element_size() == 2
                and not interpreter_enabled())
        ig, sm = int_gamma(self.gamma), self.smoothing != 0.0
        cap = next_pow2(R) if isinstance(R, int) else 1 << 30
        bc = _block_c(max(1, self.num_real), x.element_size())
        br = max(1, min(TUNING["fwd_tile"] // bc, cap))
        self.num_tiles = cdiv(R, br)
        target = TUNING["fwd_programs_per_sm"] * num_programs_hint(dev)
        self.progs = max(1, min(self.num_tiles, target)) if isinstance(R, int) else target
        meta = dict(INT_GAMMA=ig, SMOOTHING=sm, FAST=fast, BLOCK_R=br, BLOCK_C=bc)
        self.fwd = Launch(_focal_loss_fwd_kernel, (self.progs,), meta, TUNING["fwd_warps"], device=dev)
        self.finish = Launch(_focal_loss_finish_kernel, (1,), {"BLOCK_P": min(1024, next_pow2(self.progs))}, 4,
                             device=dev)
        bc = _block_c(max(1, C), x.element_size())
        br = max(1, min(TUNING["bwd_tile"] // bc, cap))
        self.bwd = {}
        for normalize in (True, False):
            self.bwd[normalize] = Launch(_focal_loss_bwd_kernel, (cdiv(R, br),),
                                         dict(INT_GAMMA=ig, SMOOTHING=sm, NORMALIZE=normalize, FAST=fast, BLOCK_R=br,
                                              BLOCK_C=bc), TUNING["bwd_warps"], device=dev)

    def prepare(self, x: Tensor, labels: Tensor, nps) -> tuple[Tensor, Tensor, Tensor]:
        """The call's ``(x, labels, num_pos)`` as the kernels read them (converted only where the plan
        says so), after the value check of the labels when it is on."""
        if self.copy_x:
            x = x.contiguous()
        if self.fix_labels:
            labels = labels.contiguous() if labels.dtype in (torch.int32, torch.int64) else labels.to(torch.int64)
        kind = self.nps_kind
        if kind == 1:
            nps = nps.to(self.device)
        elif kind == 2:
            nps = torch.full((1,), float(nps), device=self.device, dtype=self.loss_dtype)
        if self.check_values and labels.numel():
            self._check_labels(labels)
        return x, labels, nps

    def _check_labels(self, labels: Tensor) -> None:
        lo, hi = (int(v) for v in torch.aminmax(labels))
        if lo < -2 or hi >= self.num_real:
            bad = labels[(labels < -2) | (labels >= self.num_real)]
            raise ValueError(f"focal_loss: cls_targets_at_level must be -2 (ignore), -1 (background) or a class in "
                             f"[0, {self.num_real}); got {bad.unique()[:8].tolist()}")

    def forward(self, x: Tensor, labels: Tensor, nps: Tensor, traced: bool = False) -> Tensor:
        """The loss (0-dim, ``loss_dtype``) of prepared arguments."""
        if not self.use_kernel:
            return focal_loss_fwd_ref(x.reshape(-1, self.C), labels.reshape(-1), nps, self.num_real, self.alpha,
                                      self.gamma, self.smoothing)
        dev = self.device
        loss = torch.empty((), device=dev, dtype=torch.float32)
        part = torch.empty((self.progs,), device=dev, dtype=torch.float32)
        args = (x, labels, part, self.R, self.C, self.num_real, self.num_tiles, self.alpha, self.gamma,
                self.smoothing)
        fargs = (part, nps, loss, self.progs)
        if traced:
            self.fwd.traced(*args)
            self.finish.traced(*fargs)
        else:
            stream = self.stream()
            aligned = (x.data_ptr() | labels.data_ptr() | nps.data_ptr()) & 15 == 0
            self.fwd(stream, aligned, *args)
            self.finish(stream, aligned, *fargs)
        return loss

    def backward(self, grad: Tensor | None, x: Tensor, labels: Tensor, nps: Tensor, traced: bool = False) -> Tensor:
        """The gradient of the loss for prepared arguments, times ``grad`` (0-dim); ``grad=None`` gives the
        gradient of the un-normalized summed loss (Apex's ``partial_grad``). Shape of the prepared ``x``."""
        if not self.use_kernel:
            return focal_loss_bwd_ref(grad, x.reshape(-1, self.C), labels.reshape(-1), nps, self.num_real,
                                      self.alpha, self.gamma, self.smoothing).reshape(x.shape)
        dx = torch.empty_like(x)
        if self.empty:
            return dx
        normalize = grad is not None
        args = (x, labels, dx, grad, nps, self.R, self.C, self.num_real, self.alpha, self.gamma, self.smoothing)
        la = self.bwd[normalize]
        if traced:
            la.traced(*args)
        else:
            p = x.data_ptr() | labels.data_ptr() | nps.data_ptr()
            if normalize:
                p |= grad.data_ptr()
            la(self.stream(), p & 15 == 0, *args)
        return dx
