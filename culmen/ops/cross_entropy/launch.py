"""Call plans of the softmax cross-entropy op: validate once, then allocate and launch.

A ``CEPlan`` holds everything ``cross_entropy`` derives from one call signature (shapes, strides, dtypes,
device, options, process group): the checks passed, the kernels' block sizes and grids, and the bound
``Launch`` of every kernel of the forward and the backward. A cached call then costs one key, one dict
lookup, one allocation per output and one launch per kernel (two for a reduced loss: the per-row
kernel, then the one-program reduction).

``TUNING`` holds the block-size rules so a sweep (``scripts/tune_cross_entropy.py``) can change them at
run time (every change drops the cached plans). The defaults are set from register counts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from culmen.ops.backend import check_values_on, choose_backend, num_programs_hint
from culmen.ops.common.launch import Launch, PlanTuning, cdiv, next_pow2, stream_getter, warps_for
from culmen.ops.common.plans import PlanCache, clear_plans
from culmen.ops.cross_entropy.kernels import (
    _cross_entropy_bwd_kernel,
    _cross_entropy_combine_kernel,
    _cross_entropy_fwd_kernel,
    _cross_entropy_reduce_kernel,
)

TUNING = PlanTuning({
    # Widest vocab chunk a forward program loads per step, and elements per program it aims for
    # (several short rows per program when the vocab is small).
    "fwd_block_v": 4096,
    "fwd_elems": 4096,
    # Tile width / elements per program of the backward (one tile per program).
    "bwd_block_v": 4096,
    "bwd_elems": 4096,
    # 8 elements (one 16-byte bf16 load) per thread: 40 registers for the forward at 16 warps (sm_90,
    # ptxas of Triton 3.9), so three programs (48 warps) share a multiprocessor; 16 elements per thread
    # took 64-84 registers and left one or two.
    "elems_per_thread": 8,
    "max_warps": 16,
    # Below this many row programs per multiprocessor the forward splits each row's vocab over
    # several programs (and merges them in a second small kernel).
    "fwd_programs_per_sm": 4,
    # Rows the one-program reduction (mean / sum) adds per step.
    "reduce_block": 1024,
}, clear_plans)

PLANS = PlanCache("cross_entropy")
_F32 = torch.float32
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
REDUCTIONS = ("none", "mean", "sum")
# An ignore index no int64 label can equal (Apex's xentropy has none).
NO_IGNORE = -(2**63)


def _warps(elems: int) -> int:
    return warps_for(elems, TUNING["elems_per_thread"], TUNING["max_warps"])


def _blocks(N, V: int, max_block_v: int, elems: int) -> tuple[int, int]:
    block_v = min(next_pow2(V), max_block_v)
    cap = next_pow2(N) if isinstance(N, int) else 64  # a symbolic N (torch.compile) takes no part
    return max(1, min(elems // block_v, 64, cap)), block_v


# ------------------------------------------------------------------------------------------- checks


def check_float(name: str, t: Tensor) -> None:
    """``TypeError`` unless ``t`` is a float16/bfloat16/float32/float64 tensor."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be a floating-point tensor (float16/bfloat16/float32/float64), got {t.dtype}")


def check_int_labels(labels: Tensor, shape: tuple[int, ...], device: torch.device, name: str = "labels") -> None:
    """``TypeError`` / ``ValueError`` unless ``labels`` is an integer tensor of ``shape`` on ``device``."""
    if not isinstance(labels, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype not in _INTS:
        raise TypeError(f"{name} must be an integer tensor (int64/int32/...), got {labels.dtype}")
    if tuple(labels.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(labels.shape)}")
    if labels.device != device:
        raise ValueError(f"{name} is on {labels.device} but the logits are on {device}")


def check_scalars(label_smoothing: float, lse_square_scale: float, softcap: float | None,
                  logit_scale: float = 1.0) -> None:
    """``ValueError`` naming the argument when a scalar option is out of range."""
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not (float(lse_square_scale) >= 0.0 and float(lse_square_scale) < float("inf")):
        raise ValueError(f"lse_square_scale must be finite and >= 0, got {lse_square_scale}")
    if softcap is not None and not (0.0 <= float(softcap) < float("inf")):
        raise ValueError(f"softcap must be None or a finite value >= 0 (0 or None: off), got {softcap}")
    if not (abs(float(logit_scale)) < float("inf")):
        raise ValueError(f"logit_scale must be finite, got {logit_scale}")


def check_labels(labels: Tensor, num_classes: int, ignore_index: int, name: str = "labels") -> None:
    """Raise ``ValueError`` when a label other than ``ignore_index`` is outside ``[0, num_classes)``.

    A value check (it reads the labels: a device sync on a GPU). The ops run it for CPU labels always and
    for GPU labels under ``culmen.ops.backend.set_check_values(True)``, never while ``torch.compile``
    traces; the kernels are memory-safe on bad labels either way (NaN rows)."""
    if labels.numel() == 0:
        return
    bad = (labels < 0) | (labels >= num_classes)
    if not 0 <= ignore_index < num_classes:  # an ignore index inside the range is a valid label anyway
        bad &= labels != ignore_index
    if bool(bad.any()):
        idx = int(bad.reshape(-1).nonzero()[0].item())
        raise ValueError(f"{name} must be in [0, {num_classes}) or equal ignore_index={ignore_index}; "
                         f"got {int(labels.reshape(-1)[idx].item())} at flat index {idx}")


def world_of(process_group) -> tuple[int, int]:
    """``(world size, rank)`` of a vocab-parallel group (``(1, 0)`` for ``None`` or without distributed)."""
    if process_group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(process_group), dist.get_rank(process_group)


# --------------------------------------------------------------------------------------------- plan


class CEPlan:
    """Everything ``cross_entropy`` derives from one call signature. Holds no tensors.

    Built from example arguments (real tensors in eager mode, fake ones under ``torch.compile``, where
    ``N`` may be symbolic). With a process group of several ranks the kernels compute this rank's shard
    (columns ``[rank V, (rank + 1) V)``) per row, without the LSE (``add_lse`` off) and unreduced: the
    vocab-parallel autograd function of ``op.py`` finishes the rows after its all-reduces.
    """

    def __init__(self, logits, labels, precomputed_lse, label_smoothing, logit_scale, lse_square_scale, ignore_index,
                 softcap, reduction, inplace_backward, out_dtype, process_group=None) -> None:
        check_float("logits", logits)
        if logits.dim() != 2:
            raise ValueError(f"logits must be 2-D (N, V), got shape {tuple(logits.shape)}")
        N, V = logits.shape
        if V == 0:
            raise ValueError("logits must have at least one class (V >= 1), got V = 0")
        check_int_labels(labels, (N,), logits.device)
        check_scalars(label_smoothing, lse_square_scale, softcap, logit_scale)
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if out_dtype is not None and out_dtype not in _FLOATS:
            raise TypeError(f"out_dtype must be a floating-point dtype, got {out_dtype}")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
        softcap = float(softcap or 0.0)
        ls, lsc, zsq = float(label_smoothing), float(logit_scale), float(lse_square_scale)
        # flash_attn uses a given LSE only where it equals the logsumexp of the logits as they are.
        self.use_lse = precomputed_lse is not None and ls == 0.0 and lsc == 1.0 and softcap == 0.0
        if self.use_lse:
            if not isinstance(precomputed_lse, Tensor) or tuple(precomputed_lse.shape) != (N,):
                raise ValueError(f"precomputed_lse must be a tensor of shape ({N},), got "
                                 f"{getattr(precomputed_lse, 'shape', type(precomputed_lse).__name__)}")
            check_float("precomputed_lse", precomputed_lse)
            if precomputed_lse.device != logits.device:
                raise ValueError(f"precomputed_lse is on {precomputed_lse.device} but the logits are on "
                                 f"{logits.device}")
        self.world, rank = world_of(process_group)
        self.N, self.V = N, V
        self.device = logits.device
        self.dtype = logits.dtype
        self.reduction = reduction
        # A sharded vocab reduces after the all-reduces (op.py), so its kernels work per row.
        kernel_red = reduction if self.world == 1 else "none"
        self.reduce = kernel_red != "none"
        self.mean = kernel_red == "mean"
        self.out_dtype = out_dtype or _F32
        self.inplace = bool(inplace_backward)
        self.ignore_index = int(ignore_index)
        self.add_lse = self.world == 1
        self.total = V * self.world
        self.kernel_lse = self.use_lse and self.add_lse  # sharded: the given LSE is the global one (op.py)
        # The last dim must be contiguous; the entry copies logits that are not (then rows are V apart).
        self.copy_logits = logits.stride(-1) != 1 and V > 1
        self.stride_row = V if self.copy_logits else logits.stride(0)
        self.stride_label = labels.stride(0)
        self.stride_lse = precomputed_lse.stride(0) if self.kernel_lse else 0
        self.consts = (V * rank, self.total, self.ignore_index, ls, lsc, zsq, softcap)
        self.flags = dict(HAS_SMOOTHING=ls > 0.0, HAS_SOFTCAP=softcap > 0.0)
        # float64 keeps its precision on the reference path (the kernels compute in fp32).
        self.use_kernel = choose_backend(logits.device) == "triton" and N * V > 0 and logits.dtype != torch.float64
        self.check_values = labels.device.type == "cpu" or check_values_on()
        self.stream = stream_getter(logits.device)
        if self.use_kernel:
            self._plan_fwd()
            self._plan_bwd()

    # ------------------------------------------------------------------------------ forward
    def _plan_fwd(self) -> None:
        N, V, dev = self.N, self.V, self.device
        block_m, block_v = _blocks(N, V, TUNING["fwd_block_v"], TUNING["fwd_elems"])
        row_programs = cdiv(N, block_m)
        n_splits, self.cols_per_split = 1, V
        # Few row programs and a vocab of several chunks: split each row's vocab over programs (only at a
        # known row count; a symbolic one under torch.compile would add a guard on it).
        if V > block_v and not self.kernel_lse and isinstance(N, int):
            target = num_programs_hint(dev) * TUNING["fwd_programs_per_sm"]
            if row_programs < target:
                want = min(cdiv(V, block_v), cdiv(target, row_programs))
                self.cols_per_split = cdiv(cdiv(V, want), block_v) * block_v
                n_splits = cdiv(V, self.cols_per_split)
        self.split = n_splits > 1
        self.part_elems = 3 * n_splits * N
        self.fwd = Launch(_cross_entropy_fwd_kernel, (row_programs, n_splits),
                          dict(**self.flags, PRECOMPUTED_LSE=self.kernel_lse, ADD_LSE=self.add_lse, SPLIT=self.split,
                               WRITE_GRAD=False, BLOCK_M=block_m, BLOCK_V=block_v),
                          _warps(block_m * block_v), device=dev)
        self.n_splits = n_splits
        if self.split:
            block_s = next_pow2(n_splits)
            cm = max(1, min(64, 2048 // block_s, next_pow2(N)))
            self.combine = Launch(_cross_entropy_combine_kernel, (cdiv(N, cm),),
                                  dict(**self.flags, ADD_LSE=self.add_lse, BLOCK_M=cm, BLOCK_S=block_s), 4, device=dev)
        if self.reduce:
            self.red = Launch(_cross_entropy_reduce_kernel, (1,),
                              dict(MEAN=self.mean, WRITE_SCALE=True, WRITE_LOSS=True, BLOCK=TUNING["reduce_block"]), 4,
                              device=dev)

    def forward(self, logits: Tensor, labels: Tensor, lse_in: Tensor | None, traced: bool = False):
        """Run the forward kernels (or trace them: ``traced``) on ``logits`` with a contiguous last dim.

        Returns ``(loss, z_loss, lse, rows)``: per-row ``(N,)`` losses in ``out_dtype`` (0-dim for a
        reduction), fp32 ``lse (N,)``, and for a reduction the fp32 scratch ``rows (2N + 1,)`` (losses,
        z-losses, then the gradient scale of a row, which the backward reads), else ``None``."""
        N, dev, od = self.N, self.device, self.out_dtype
        lse = torch.empty((N,), dtype=_F32, device=dev)
        zl_off = 0
        if self.reduce:
            # rows: losses [0, N), z-losses [N, 2N) in eager calls, the gradient scale at 2N. A traced launch
            # (Inductor's functional wrapper) clones each written argument separately, so there the
            # z-losses get their own tensor: two written views of one buffer would lose writes.
            lrows = rows = torch.empty((2 * N + 1,), dtype=_F32, device=dev)
            if traced:
                zrows = torch.empty((N,), dtype=_F32, device=dev)
            else:
                zrows, zl_off = rows, N
            loss = torch.empty((), dtype=od, device=dev)
            zl = torch.empty((), dtype=od, device=dev)
        else:
            rows = None
            lrows = loss = torch.empty((N,), dtype=od, device=dev)
            zrows = zl = torch.empty((N,), dtype=od, device=dev)
        part = torch.empty((self.part_elems,), dtype=_F32, device=dev) if self.split else None
        c = self.consts
        args = (logits, labels, lse_in, None, lrows, zrows, lse, part, self.stride_row, self.stride_label,
                self.stride_lse, N, 0, zl_off, 0, self.V, self.cols_per_split, *c)
        if traced:
            self.fwd.traced(*args)
            stream, aligned = None, True
        else:
            stream = self.stream()
            aligned = (logits.data_ptr() | labels.data_ptr() | (0 if lse_in is None else lse_in.data_ptr())) & 15 == 0
            self.fwd(stream, aligned, *args)
        if self.split:
            args = (logits, labels, part, lrows, zrows, lse, self.stride_row, 1, self.stride_label, N, zl_off, self.V,
                    self.n_splits, *c)
            self.combine.traced(*args) if traced else self.combine(stream, aligned, *args)
        if self.reduce:
            args = (rows, zrows, labels, loss, zl, N, zl_off, 2 * N, self.stride_label, self.ignore_index)
            self.red.traced(*args) if traced else self.red(stream, aligned, *args)
        return loss, zl, lse, rows

    # ----------------------------------------------------------------------------- backward
    def _plan_bwd(self) -> None:
        N, V = self.N, self.V
        block_m, block_v = _blocks(N, V, TUNING["bwd_block_v"], TUNING["bwd_elems"])
        self.bwd = Launch(_cross_entropy_bwd_kernel, (cdiv(N, block_m), cdiv(V, block_v)),
                          dict(**self.flags, HAS_SCALE=self.mean, BLOCK_M=block_m, BLOCK_V=block_v),
                          _warps(block_m * block_v), device=self.device)
        # The gradient is written into the logits (in place) or a new contiguous tensor.
        self.stride_drow = self.stride_row if self.inplace else V
        self.grad_like = self.stride_row == V  # empty_like(logits) is then contiguous too (and cheaper)

    def backward(self, dloss: Tensor, logits: Tensor, lse: Tensor, labels: Tensor, rows: Tensor | None,
                 traced: bool = False) -> Tensor:
        """``d loss / d logits`` ``(N, V)`` in the logits' dtype, into ``logits`` itself with
        ``inplace_backward``. ``dloss``: the upstream gradient, ``(N,)`` of any stride or 0-dim for a
        reduction (in ``out_dtype``); ``rows``: the forward's scratch of a reduction."""
        if dloss.dtype != self.out_dtype:
            dloss = dloss.to(self.out_dtype)
        if self.inplace:
            dx = logits
        elif self.grad_like:
            dx = torch.empty_like(logits)
        else:
            dx = torch.empty((self.N, self.V), dtype=self.dtype, device=self.device)
        N = self.N
        args = (dx, dloss, rows, logits, lse, labels, self.stride_row, self.stride_drow, self.stride_label,
                0 if self.reduce else dloss.stride(0), 2 * N, N, 0, self.V, *self.consts)
        if traced:
            self.bwd.traced(*args)
        else:
            # dx is the logits or fresh, the LSE is the forward's: only the caller's pointers can be unaligned.
            aligned = (dloss.data_ptr() | logits.data_ptr() | labels.data_ptr()) & 15 == 0
            self.bwd(self.stream(), aligned, *args)
        return dx
