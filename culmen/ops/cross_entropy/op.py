"""Custom ops ``culmen::cross_entropy_fwd`` / ``culmen::cross_entropy_bwd``, their autograd, and ``cross_entropy``.

``cross_entropy`` is the op-level entry point behind flash_attn's ``cross_entropy_loss`` /
``CrossEntropyLoss`` and Apex's ``SoftmaxCrossEntropyLoss``: per-row losses of ``(N, V)`` logits with
label smoothing, ``logit_scale``, z-loss, softcap, an ignore index, an optional precomputed LSE, an
in-place backward and a vocab sharded over a process group.

Label checks: labels on the CPU are checked on the host (``ValueError``). For labels on a GPU that
check would cost a device sync on every call, so it only runs with ``CULMEN_CHECK_LABELS=1``;
otherwise an invalid label makes its row's loss and gradient NaN (never a silent finite value).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from culmen.ops.backend import choose_backend, register_op
from culmen.ops.cross_entropy.reference import cross_entropy_bwd_ref, cross_entropy_fwd_ref

register_op("cross_entropy_fwd", "loss", "softmax cross-entropy per row: loss, z-loss, LSE (online softmax)")
register_op("cross_entropy_bwd", "loss", "gradient of cross_entropy_fwd w.r.t. the logits")

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
# An ignore index no int64 label can equal (Apex's xentropy has none).
NO_IGNORE = -(2**63)


def _use_triton(t: Tensor) -> bool:
    # float64 keeps its precision on the reference path (the kernels compute in fp32).
    return choose_backend(t.device) == "triton" and t.numel() > 0 and t.dtype != torch.float64


def fwd_impl(*args, grad_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Forward on the chosen backend (arguments of ``launch.cross_entropy_fwd``)."""
    if _use_triton(args[0]):
        from culmen.ops.cross_entropy.launch import cross_entropy_fwd

        return cross_entropy_fwd(*args, grad_scale=grad_scale)
    return cross_entropy_fwd_ref(*args, grad_scale=grad_scale)


def bwd_impl(*args, out: Tensor | None = None) -> Tensor:
    """Backward on the chosen backend (arguments of ``launch.cross_entropy_bwd``)."""
    if _use_triton(args[1]):
        from culmen.ops.cross_entropy.launch import cross_entropy_bwd

        return cross_entropy_bwd(*args, out=out)
    return cross_entropy_bwd_ref(*args, out=out)


@torch.library.custom_op("culmen::cross_entropy_fwd", mutates_args=())
def cross_entropy_fwd_op(
    logits: Tensor,
    labels: Tensor,
    lse_in: Tensor | None,
    label_smoothing: float,
    logit_scale: float,
    lse_square_scale: float,
    ignore_index: int,
    softcap: float,
    vocab_start: int,
    total_classes: int,
    add_lse: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row fp32 ``(loss, z_loss, lse)`` of ``logits (N, V)`` (last dim contiguous), ``labels (N,)``."""
    loss, zl, lse = fwd_impl(logits, labels, lse_in, label_smoothing, logit_scale, lse_square_scale, ignore_index,
                             softcap, vocab_start, total_classes, add_lse)
    # Outputs of a custom op may not alias its inputs (a precomputed LSE is returned as given).
    return loss, zl, (lse.clone() if lse_in is not None else lse)


@cross_entropy_fwd_op.register_fake
def _(logits, labels, lse_in, label_smoothing, logit_scale, lse_square_scale, ignore_index, softcap, vocab_start,
      total_classes, add_lse):
    N = logits.shape[0]
    return tuple(logits.new_empty((N,), dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("culmen::cross_entropy_bwd", mutates_args=())
def cross_entropy_bwd_op(
    dloss: Tensor,
    logits: Tensor,
    lse: Tensor,
    labels: Tensor,
    label_smoothing: float,
    logit_scale: float,
    lse_square_scale: float,
    ignore_index: int,
    softcap: float,
    vocab_start: int,
    total_classes: int,
) -> Tensor:
    """``d loss / d logits`` ``(N, V)`` in the logits' dtype, for per-row ``dloss (N,)``."""
    return bwd_impl(dloss, logits, lse, labels, label_smoothing, logit_scale, lse_square_scale, ignore_index,
                    softcap, vocab_start, total_classes)


@cross_entropy_bwd_op.register_fake
def _(dloss, logits, lse, labels, label_smoothing, logit_scale, lse_square_scale, ignore_index, softcap,
      vocab_start, total_classes):
    return torch.empty_like(logits)


_FWD_ARGS = ("logits", "labels", "lse_in", "label_smoothing", "logit_scale", "lse_square_scale", "ignore_index",
             "softcap", "vocab_start", "total_classes", "add_lse")
_BWD_CONSTS = ("label_smoothing", "logit_scale", "lse_square_scale", "ignore_index", "softcap", "vocab_start",
               "total_classes")


def _setup_context(ctx, inputs, output):
    a = dict(zip(_FWD_ARGS, inputs))
    ctx.save_for_backward(a["logits"], output[2], a["labels"])
    ctx.consts = tuple(a[k] for k in _BWD_CONSTS)


def _backward(ctx, dloss, dzl, dlse):
    logits, lse, labels = ctx.saved_tensors
    if dloss is None:
        return (None,) * len(_FWD_ARGS)
    dlogits = cross_entropy_bwd_op(dloss, logits, lse, labels, *ctx.consts)
    return (dlogits,) + (None,) * (len(_FWD_ARGS) - 1)


torch.library.register_autograd("culmen::cross_entropy_fwd", _backward, setup_context=_setup_context)


class _CrossEntropyFn(torch.autograd.Function):
    """Eager path: the implementations without ``torch.library`` dispatch cost, plus ``inplace_backward``
    (``torch.compile`` traces the functional custom ops instead and ignores ``inplace_backward``)."""

    @staticmethod
    def forward(ctx, logits, labels, lse_in, label_smoothing, logit_scale, lse_square_scale, ignore_index, softcap,
                inplace_backward):
        V = logits.shape[1]
        loss, zl, lse = fwd_impl(logits, labels, lse_in, label_smoothing, logit_scale, lse_square_scale,
                                 ignore_index, softcap, 0, V, True)
        ctx.save_for_backward(logits, lse, labels)
        ctx.consts = (label_smoothing, logit_scale, lse_square_scale, ignore_index, softcap, 0, V)
        ctx.inplace = inplace_backward
        ctx.mark_non_differentiable(zl, lse)
        ctx.set_materialize_grads(False)
        return loss, zl, lse

    @staticmethod
    def backward(ctx, dloss, dzl, dlse):
        if dloss is None:
            return (None,) * 9
        logits, lse, labels = ctx.saved_tensors
        dlogits = bwd_impl(dloss, logits, lse, labels, *ctx.consts, out=logits if ctx.inplace else None)
        return (dlogits,) + (None,) * 8


class _VocabParallelFn(torch.autograd.Function):
    """Cross-entropy over a vocab sharded across ``group``: rank ``r`` holds columns ``[r V, (r+1) V)``.

    Each rank computes its shard's LSE and partial loss (target logit if the label is in its shard, its
    part of the smoothing sum); one MAX all-reduce of the LSEs and one SUM all-reduce of
    ``(exp(lse_r - max), partial loss)`` give the global LSE and loss on every rank. The backward needs
    only the global LSE, so it communicates nothing.
    """

    @staticmethod
    def forward(ctx, logits, labels, lse_in, label_smoothing, logit_scale, lse_square_scale, ignore_index, softcap,
                inplace_backward, group):
        world = dist.get_world_size(group)
        V = logits.shape[1]
        start, total = dist.get_rank(group) * V, world * V
        part, _, lse_local = fwd_impl(logits, labels, None, label_smoothing, logit_scale, lse_square_scale,
                                      ignore_index, softcap, start, total, False)
        if lse_in is not None:
            lse = lse_in.to(torch.float32)
            dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
        else:
            gmax = lse_local.clone()
            dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
            packed = torch.stack([torch.exp(lse_local - gmax), part])
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
            lse = gmax + torch.log(packed[0])
            part = packed[1]
        valid = labels != ignore_index
        zero = torch.zeros_like(lse)
        zl = torch.where(valid, lse_square_scale * lse * lse, zero)
        # A NaN partial (invalid label) stays NaN through the all-reduce and the where below.
        loss = torch.where(valid, part + lse + zl, zero)
        ctx.save_for_backward(logits, lse, labels)
        ctx.consts = (label_smoothing, logit_scale, lse_square_scale, ignore_index, softcap, start, total)
        ctx.inplace = inplace_backward
        ctx.mark_non_differentiable(zl, lse)
        ctx.set_materialize_grads(False)
        return loss, zl, lse

    @staticmethod
    def backward(ctx, dloss, dzl, dlse):
        if dloss is None:
            return (None,) * 10
        logits, lse, labels = ctx.saved_tensors
        dlogits = bwd_impl(dloss, logits, lse, labels, *ctx.consts, out=logits if ctx.inplace else None)
        return (dlogits,) + (None,) * 9


class CrossEntropyOutput(NamedTuple):
    """Per-row outputs of ``cross_entropy`` (fp32, shape ``(N,)``); only ``loss`` is differentiable."""

    loss: Tensor
    z_loss: Tensor
    lse: Tensor


def check_labels(labels: Tensor, num_classes: int, ignore_index: int, name: str = "labels") -> None:
    """Raise ``ValueError`` when a label other than ``ignore_index`` is outside ``[0, num_classes)``.

    Runs for CPU labels, and for GPU labels only with ``CULMEN_CHECK_LABELS=1`` (a device sync);
    skipped while ``torch.compile`` traces.
    """
    if torch.compiler.is_compiling() or labels.numel() == 0:
        return
    if labels.device.type != "cpu" and os.environ.get("CULMEN_CHECK_LABELS", "0") in ("", "0"):
        return
    lab = labels.long()
    bad = (lab != ignore_index) & ((lab < 0) | (lab >= num_classes))
    if bool(bad.any()):
        idx = int(bad.reshape(-1).nonzero()[0].item())
        raise ValueError(f"{name} must be in [0, {num_classes}) or equal ignore_index={ignore_index}; "
                         f"got {int(lab.reshape(-1)[idx].item())} at flat index {idx}")


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


def cross_entropy(
    logits: Tensor,
    labels: Tensor,
    *,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    lse_square_scale: float = 0.0,
    ignore_index: int = -100,
    softcap: float | None = None,
    precomputed_lse: Tensor | None = None,
    inplace_backward: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> CrossEntropyOutput:
    """Per-row softmax cross-entropy of ``logits (N, V)``, differentiable w.r.t. ``logits``.

    Args:
        logits: ``(N, V)`` fp16/bf16/fp32/fp64 (any row stride). With ``process_group``, this rank's
            vocab shard: columns ``[rank * V, (rank + 1) * V)`` of ``world_size * V`` classes.
        labels: ``(N,)`` integer class ids (global ids when sharded); ``ignore_index`` rows get 0 loss
            and 0 gradient.
        label_smoothing: ``s`` in ``[0, 1]``: ``loss = (1 - s) * CE + s * mean_j(-log p_j)``.
        logit_scale: multiplies the logits first. softcap: ``c * tanh(z / c)`` after the scale (None/0: off).
        lse_square_scale: adds ``lse_square_scale * lse^2`` (z-loss) to the loss.
        precomputed_lse: ``(N,)`` LSE to use instead of computing it (only when ``label_smoothing == 0``,
            ``logit_scale == 1`` and no softcap, as in flash_attn; ignored otherwise).
        inplace_backward: write the gradient into ``logits`` (saves ``N * V`` memory; eager only).
        process_group: shard the vocab across this group (see ``logits``).

    Returns:
        ``CrossEntropyOutput(loss, z_loss, lse)``, fp32 ``(N,)``; ``loss`` includes the z-loss.
    """
    check_float("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D (N, V), got shape {tuple(logits.shape)}")
    N, V = logits.shape
    if V == 0:
        raise ValueError("logits must have at least one class (V >= 1), got V = 0")
    check_int_labels(labels, (N,), logits.device)
    check_scalars(label_smoothing, lse_square_scale, softcap, logit_scale)
    softcap = float(softcap or 0.0)
    use_lse = (precomputed_lse is not None and label_smoothing == 0.0 and logit_scale == 1.0 and softcap == 0.0)
    lse_in = None
    if use_lse:
        if not isinstance(precomputed_lse, Tensor) or tuple(precomputed_lse.shape) != (N,):
            raise ValueError(f"precomputed_lse must be a tensor of shape ({N},), got "
                             f"{getattr(precomputed_lse, 'shape', type(precomputed_lse).__name__)}")
        lse_in = precomputed_lse.detach().to(torch.float32).contiguous()
    world = dist.get_world_size(process_group) if (process_group is not None and dist.is_initialized()) else 1
    check_labels(labels, V * world, ignore_index)
    if logits.stride(-1) != 1 and V > 1:
        logits = logits.contiguous()
    labels = labels.contiguous()
    args = (float(label_smoothing), float(logit_scale), float(lse_square_scale), int(ignore_index), softcap)
    if world > 1:
        out = _VocabParallelFn.apply(logits, labels, lse_in, *args, bool(inplace_backward), process_group)
    elif torch.compiler.is_compiling():
        out = cross_entropy_fwd_op(logits, labels, lse_in, *args, 0, V, True)
    else:
        out = _CrossEntropyFn.apply(logits, labels, lse_in, *args, bool(inplace_backward))
    return CrossEntropyOutput(*out)
