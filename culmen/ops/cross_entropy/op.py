"""``cross_entropy``, the op-level entry point of culmen's softmax cross-entropy, its eager autograd, the
vocab-parallel path, and the ``torch.library`` op ``culmen::cross_entropy`` that ``torch.compile`` traces.

``cross_entropy`` is behind flash_attn's ``cross_entropy_loss`` / ``CrossEntropyLoss`` and Apex's
``SoftmaxCrossEntropyLoss``: per-row losses (or their mean / sum) of ``(N, V)`` logits with label
smoothing, ``logit_scale``, z-loss, softcap, an ignore index, an optional precomputed LSE, an in-place
backward and a vocab sharded over a process group.

The call path (DESIGN.md): an eager call builds a key from its signature and looks up a cached
``CEPlan`` (validation ran when the plan was built); with autograd recording it goes through
``_CrossEntropyFn`` (a plain ``autograd.Function``), otherwise straight to the plan's forward. A
``mean`` / ``sum`` is computed by a one-program kernel and its backward reads the scale of a row from the
device (no PyTorch ops). Under ``torch.compile`` the op is a ``triton_op`` whose body launches through
``wrap_triton``, so Inductor launches the kernels itself.

Label checks: labels on the CPU are checked on the host (``ValueError``). For labels on a GPU that check
would cost a device sync on every call, so it only runs under ``culmen.ops.backend.set_check_values(True)``;
otherwise an invalid label makes its row's loss and gradient NaN (never a silent finite value, never an
out-of-bounds read).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from culmen.ops.backend import register_op
from culmen.ops.common.launch import traceable_kernels
from culmen.ops.cross_entropy.launch import (
    NO_IGNORE,
    PLANS,
    CEPlan,
    check_float,
    check_int_labels,
    check_labels,
    check_scalars,
    world_of,
)
from culmen.ops.cross_entropy.reference import cross_entropy_bwd_ref, cross_entropy_fwd_ref

register_op("cross_entropy", "loss", "softmax cross-entropy: per-row loss, z-loss, LSE (online softmax); "
            "mean / sum in a second one-program kernel")

__all__ = ["NO_IGNORE", "CrossEntropyOutput", "check_float", "check_int_labels", "check_labels", "check_scalars",
           "cross_entropy", "get_plan", "run_backward", "run_forward"]

_F32 = torch.float32


class CrossEntropyOutput(NamedTuple):
    """Outputs of ``cross_entropy``: ``loss`` and ``z_loss`` per row ``(N,)`` (0-dim for ``mean`` / ``sum``)
    in ``out_dtype`` (fp32 by default), fp32 ``lse (N,)``; only ``loss`` is differentiable."""

    loss: Tensor
    z_loss: Tensor
    lse: Tensor


# ------------------------------------------------------------------------------ reference path


def _forward_ref(plan: CEPlan, logits, labels, lse_in):
    """The plan's forward on the PyTorch reference (CPU, float64, ``set_backend("reference")``);
    traceable (no host syncs), so compiled graphs on Triton's CPU interpreter use it too."""
    vs, total, ignore, ls, lsc, zsq, cap = plan.consts
    loss, zl, lse = cross_entropy_fwd_ref(logits, labels, lse_in if plan.kernel_lse else None, ls, lsc, zsq, ignore,
                                          cap, vs, total, plan.add_lse)
    rows = None
    if plan.reduce:
        loss, zl = loss.sum(), zl.sum()
        if plan.mean:
            n = (labels != ignore).sum().to(_F32)
            loss, zl = loss / n, zl / n
            rows = (1.0 / n.clamp_min(1.0)).reshape(1)
        else:
            rows = torch.ones((1,), dtype=_F32, device=logits.device)
    return loss.to(plan.out_dtype), zl.to(plan.out_dtype), lse, rows


def _backward_ref(plan: CEPlan, dloss, logits, lse, labels, rows):
    vs, total, ignore, ls, lsc, zsq, cap = plan.consts
    if plan.reduce:
        # rows[-1] is a row's gradient scale on both paths (the kernels' scratch ends with it).
        dloss = (dloss.to(_F32) * rows[-1]).expand(plan.N)
    return cross_entropy_bwd_ref(dloss, logits, lse, labels, ls, lsc, zsq, ignore, cap, vs, total,
                                 out=logits if plan.inplace else None)


def run_forward(plan: CEPlan, logits: Tensor, labels: Tensor, lse_in: Tensor | None):
    """``(loss, z_loss, lse, rows)`` of ``plan`` on its backend (``CEPlan.forward``; no autograd). The
    logits' last dim must be contiguous where ``plan.copy_logits``; ``lse_in`` only where ``plan.use_lse``."""
    if plan.use_kernel:
        return plan.forward(logits, labels, lse_in)
    return _forward_ref(plan, logits, labels, lse_in)


def run_backward(plan: CEPlan, dloss: Tensor, logits: Tensor, lse: Tensor, labels: Tensor,
                 rows: Tensor | None) -> Tensor:
    """``d loss / d logits`` of ``plan`` on its backend (``CEPlan.backward``)."""
    if plan.use_kernel:
        return plan.backward(dloss, logits, lse, labels, rows)
    return _backward_ref(plan, dloss, logits, lse, labels, rows)


# ------------------------------------------------------------------------------------- eager


class _CrossEntropyFn(torch.autograd.Function):
    """Eager autograd: the plan's kernels called directly (no ``torch.library`` dispatch). Few, positional
    arguments: ``apply`` costs host time per argument."""

    @staticmethod
    def forward(ctx, plan, logits, labels, lse_in):
        loss, zl, lse, rows = run_forward(plan, logits, labels, lse_in)
        ctx.plan = plan
        ctx.save_for_backward(logits, labels, lse, rows)
        ctx.mark_non_differentiable(zl, lse)
        ctx.set_materialize_grads(False)
        return loss, zl, lse

    @staticmethod
    def backward(ctx, dloss, _dzl, _dlse):
        if dloss is None:
            return None, None, None, None
        logits, labels, lse, rows = ctx.saved_tensors
        return None, run_backward(ctx.plan, dloss, logits, lse, labels, rows), None, None


class _VocabParallelFn(torch.autograd.Function):
    """Cross-entropy over a vocab sharded across ``group``: rank ``r`` holds columns ``[r V, (r+1) V)``.

    Each rank computes its shard's LSE and partial loss (target logit if the label is in its shard, its
    part of the smoothing sum); one MAX all-reduce of the LSEs and one SUM all-reduce of
    ``(exp(lse_r - max), partial loss)`` give the global LSE and loss on every rank. The backward needs
    only the global LSE, so it communicates nothing.
    """

    @staticmethod
    def forward(ctx, plan, logits, labels, lse_in, group):
        part, _, lse_local, _ = run_forward(plan, logits, labels, None)
        if lse_in is not None:
            lse = lse_in.to(_F32)
            dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
        else:
            gmax = lse_local.clone()
            dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
            packed = torch.stack([torch.exp(lse_local - gmax), part])
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
            lse = gmax + torch.log(packed[0])
            part = packed[1]
        zsq = plan.consts[5]
        valid = labels != plan.ignore_index
        zero = torch.zeros_like(lse)
        zl = torch.where(valid, zsq * lse * lse, zero)
        # A NaN partial (invalid label) stays NaN through the all-reduce and the where below.
        loss = torch.where(valid, part + lse + zl, zero)
        ctx.plan = plan
        ctx.save_for_backward(logits, lse, labels)
        ctx.mark_non_differentiable(zl, lse)
        ctx.set_materialize_grads(False)
        return loss, zl, lse

    @staticmethod
    def backward(ctx, dloss, dzl, dlse):
        if dloss is None:
            return (None,) * 5
        logits, lse, labels = ctx.saved_tensors
        return None, run_backward(ctx.plan, dloss, logits, lse, labels, None), None, None, None


def _vocab_parallel(plan: CEPlan, logits, labels, lse_in, group) -> CrossEntropyOutput:
    loss, zl, lse = _VocabParallelFn.apply(plan, logits, labels, lse_in, group)
    if plan.reduction != "none":
        loss, zl = loss.sum(), zl.sum()
        if plan.reduction == "mean":
            n = (labels != plan.ignore_index).sum()
            loss, zl = loss / n, zl / n
    if plan.out_dtype != _F32:
        loss, zl = loss.to(plan.out_dtype), zl.to(plan.out_dtype)
    return CrossEntropyOutput(loss, zl, lse)


def get_plan(logits: Tensor, labels: Tensor, precomputed_lse: Tensor | None = None, label_smoothing: float = 0.0,
             logit_scale: float = 1.0, lse_square_scale: float = 0.0, ignore_index: int = -100,
             softcap: float | None = None, reduction: str = "none", inplace_backward: bool = False,
             out_dtype: torch.dtype | None = None, process_group=None) -> CEPlan:
    """The cached ``CEPlan`` of a call signature (built, validating every argument, on the first call)."""
    try:
        key = (logits.shape, logits.stride(), logits.dtype, logits.device,
               labels.shape, labels.stride(), labels.dtype, labels.device,
               None if precomputed_lse is None else (precomputed_lse.shape, precomputed_lse.stride(),
                                                     precomputed_lse.dtype, precomputed_lse.device),
               label_smoothing, logit_scale, lse_square_scale, ignore_index, softcap, reduction, inplace_backward,
               out_dtype, process_group)
        plan = PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors / unhashable arguments: the plan reports it
        key, plan = None, None
    if plan is None:
        plan = CEPlan(logits, labels, precomputed_lse, label_smoothing, logit_scale, lse_square_scale, ignore_index,
                      softcap, reduction, inplace_backward, out_dtype, process_group)
        if key is not None:
            PLANS.put(key, plan)
    return plan


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
    reduction: str = "none",
    out_dtype: torch.dtype | None = None,
) -> CrossEntropyOutput:
    """Softmax cross-entropy of ``logits (N, V)``, per row or reduced, differentiable w.r.t. ``logits``.

    Args:
        logits: ``(N, V)`` fp16/bf16/fp32/fp64 (any row stride). With ``process_group``, this rank's
            vocab shard: columns ``[rank * V, (rank + 1) * V)`` of ``world_size * V`` classes.
        labels: ``(N,)`` integer class ids (global ids when sharded); ``ignore_index`` rows get 0 loss
            and 0 gradient.
        label_smoothing: ``s`` in ``[0, 1]``: ``loss = (1 - s) * CE + s * mean_j(-log p_j)``.
        logit_scale: multiplies the logits first. softcap: ``c * tanh(z / c)`` after the scale (None/0: off).
        lse_square_scale: adds ``lse_square_scale * lse^2`` (z-loss) to the loss.
        precomputed_lse: ``(N,)`` LSE to use instead of computing it (only when ``label_smoothing == 0``,
            ``logit_scale == 1`` and no softcap, as in flash_attn; ignored otherwise). No gradient flows
            into it.
        inplace_backward: write the gradient into ``logits`` (saves ``N * V`` memory; eager only).
        process_group: shard the vocab across this group (see ``logits``).
        reduction: ``"none"`` (per row), ``"mean"`` (over the rows whose label is not ``ignore_index``;
            NaN when there is none, as PyTorch's) or ``"sum"``.
        out_dtype: dtype of ``loss`` / ``z_loss`` (default fp32; statistics are fp32 either way).

    Returns:
        ``CrossEntropyOutput(loss, z_loss, lse)``; ``loss`` includes the z-loss, ``lse`` is fp32 ``(N,)``.
    """
    if torch.compiler.is_compiling():
        return _cross_entropy_compiled(logits, labels, precomputed_lse, label_smoothing, logit_scale,
                                       lse_square_scale, ignore_index, softcap, reduction, inplace_backward,
                                       out_dtype, process_group)
    plan = get_plan(logits, labels, precomputed_lse, label_smoothing, logit_scale, lse_square_scale, ignore_index,
                    softcap, reduction, inplace_backward, out_dtype, process_group)
    if plan.check_values:
        check_labels(labels, plan.total, plan.ignore_index)
    if plan.copy_logits:
        logits = logits.contiguous()
    lse_in = precomputed_lse if plan.use_lse else None
    if plan.world > 1:
        return _vocab_parallel(plan, logits, labels, lse_in, process_group)
    if torch.is_grad_enabled() and logits.requires_grad:
        loss, zl, lse = _CrossEntropyFn.apply(plan, logits, labels, lse_in)
    else:
        loss, zl, lse, _ = run_forward(plan, logits, labels, lse_in)
    return CrossEntropyOutput(loss, zl, lse)


# -------------------------------------------------------------------------- torch.compile


def _plan_from(logits, labels, lse_in, label_smoothing, logit_scale, lse_square_scale, ignore_index, softcap,
               reduction, out_dtype) -> CEPlan:
    """An uncached plan for traced code (``N`` may be symbolic). Triton's CPU interpreter cannot be traced,
    so there the compiled graph takes the (traceable) reference path."""
    plan = CEPlan(logits, labels, lse_in, label_smoothing, logit_scale, lse_square_scale, ignore_index, softcap,
                  reduction, False, out_dtype)
    plan.use_kernel = plan.use_kernel and traceable_kernels()
    return plan


@torch.library.triton_op("culmen::cross_entropy", mutates_args=())
def cross_entropy_op(
    logits: Tensor, labels: Tensor, lse_in: Tensor | None, label_smoothing: float, logit_scale: float,
    lse_square_scale: float, ignore_index: int, softcap: float, reduction: str, out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``cross_entropy`` for ``torch.compile``: ``(loss, z_loss, lse, rows)``, ``rows`` the reduction's
    scratch (an empty tensor without one: custom ops cannot return ``None``)."""
    plan = _plan_from(logits, labels, lse_in, label_smoothing, logit_scale, lse_square_scale, ignore_index, softcap,
                      reduction, out_dtype)
    x = logits.contiguous() if plan.copy_logits else logits
    if plan.use_kernel:
        loss, zl, lse, rows = plan.forward(x, labels, lse_in, traced=True)
    else:
        loss, zl, lse, rows = _forward_ref(plan, x, labels, lse_in)
    return loss, zl, lse, (rows if rows is not None else logits.new_empty((0,), dtype=_F32))


def _setup_context(ctx, inputs, output):
    # Runs while torch.compile traces (never in eager calls): the plan rides on ctx to the backward,
    # which launches the kernel itself through wrap_triton (no second custom op needed).
    ctx.plan = _plan_from(*inputs)
    _, _, lse, rows = output
    ctx.save_for_backward(inputs[0], inputs[1], lse, rows)


def _compiled_backward(ctx, dloss, _dzl, _dlse, _drows):
    plan = ctx.plan
    logits, labels, lse, rows = ctx.saved_tensors
    dx = None
    if dloss is not None:
        x = logits.contiguous() if plan.copy_logits else logits
        if plan.use_kernel:
            dx = plan.backward(dloss, x, lse, labels, rows if plan.reduce else None, traced=True)
        else:
            dx = _backward_ref(plan, dloss, x, lse, labels, rows)
    return (dx,) + (None,) * 9


torch.library.register_autograd("culmen::cross_entropy", _compiled_backward, setup_context=_setup_context)


def _cross_entropy_compiled(logits, labels, precomputed_lse, label_smoothing, logit_scale, lse_square_scale,
                            ignore_index, softcap, reduction, inplace_backward, out_dtype,
                            process_group) -> CrossEntropyOutput:
    """``cross_entropy`` while ``torch.compile`` traces: the ``triton_op`` (``inplace_backward`` is ignored:
    a traced graph owns its buffers), no plan cache. Only plain Python runs here (Dynamo traces it); the
    op's body builds the plan, with every check. A sharded vocab keeps its autograd function."""
    check_scalars(label_smoothing, lse_square_scale, softcap, logit_scale)
    if process_group is not None and world_of(process_group)[0] > 1:
        plan = CEPlan(logits, labels, precomputed_lse, label_smoothing, logit_scale, lse_square_scale, ignore_index,
                      softcap, reduction, inplace_backward, out_dtype, process_group)
        return _vocab_parallel(plan, logits.contiguous() if plan.copy_logits else logits, labels,
                               precomputed_lse if plan.use_lse else None, process_group)
    softcap = float(softcap or 0.0)
    use_lse = (precomputed_lse is not None and float(label_smoothing) == 0.0 and float(logit_scale) == 1.0
               and softcap == 0.0)
    loss, zl, lse, _ = cross_entropy_op(logits, labels, precomputed_lse if use_lse else None, float(label_smoothing),
                                        float(logit_scale), float(lse_square_scale), int(ignore_index), softcap,
                                        reduction, out_dtype or _F32)
    return CrossEntropyOutput(loss, zl, lse)
