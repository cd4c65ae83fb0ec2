"""Fused linear + cross-entropy: ``CE(hidden @ weight.T + bias, labels)`` without the ``(N, V)`` logits.

culmen's addition (flash_attn and Apex have no such op). The stages and their memory / time trade-offs
are described in ``fused_linear_plan.py``; this module is the entry point, its eager autograd and the
``torch.library`` ops ``torch.compile`` traces.

For ``reduction="mean"``/``"sum"`` all the work happens in the forward (the backward scales the saved
gradients by the incoming scalar, on the device, and not at all when it is 1); ``reduction="none"``
computes only the losses in the forward and runs the same stages in the backward with the per-row
upstream gradient.

The call path (DESIGN.md): a cached ``FLCEPlan`` per call signature holds the validation, the chunk and
slice schedule and the bound kernel launches; a call allocates its outputs, its gradients and one scratch
buffer, then walks the schedule. Under ``torch.compile`` the op is an opaque ``custom_op`` (its body is a
loop of cuBLAS matmuls writing into views of one buffer, which a traced graph cannot express), whose
implementation runs the same cached plans.

Precision: logits and their gradient are in the input dtype (as in the unfused bf16 matmul), softmax
statistics in fp32 (safe at any vocab size). ``grad_weight`` and ``grad_hidden`` come from single
matmuls with fp32 accumulation, except on the accumulating path, where ``accum_dtype`` chooses the
weight's dtype (one rounding per chunk) or ``torch.float32`` (one rounding in all, ``4 V H`` more bytes).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import register_op
from culmen.ops.common.outputs import nothing
from culmen.ops.cross_entropy.fused_linear_plan import PLANS, TUNING, FLCEPlan, chunk_rows, validate
from culmen.ops.cross_entropy.launch import check_labels

register_op("fused_linear_cross_entropy", "loss", "hidden @ W.T (+ b) -> cross-entropy in token chunks, "
            "gradients computed in the forward")
register_op("fused_linear_cross_entropy_bwd", "loss", "recompute-based backward of the reduction='none' case")


def get_plan(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, ignore_index: int,
             label_smoothing: float, lse_square_scale: float, softcap: float | None, reduction: str,
             needs: tuple[bool, bool, bool], chunk_size: int | None, accum_dtype: torch.dtype | None) -> FLCEPlan:
    """The cached ``FLCEPlan`` of a call signature (built, validating every argument, on the first call)."""
    try:
        key = (hidden.shape, hidden.stride(), hidden.dtype, hidden.device, weight.shape, weight.stride(),
               weight.dtype, weight.device,
               None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
               labels.shape, labels.stride(), labels.dtype, labels.device, ignore_index, label_smoothing,
               lse_square_scale, softcap, reduction, needs, chunk_size, accum_dtype)
        plan = PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors / unhashable arguments: the plan reports it
        key, plan = None, None
    if plan is None:
        plan = FLCEPlan(hidden, weight, bias, labels, ignore_index, label_smoothing, lse_square_scale, softcap,
                        reduction, needs, chunk_size, accum_dtype)
        if key is not None:
            PLANS.put(key, plan)
    return plan


# ------------------------------------------------------------------------------------- eager


class _FusedLinearCEFn(torch.autograd.Function):
    """Eager path: the plan's passes without dispatch cost; the backward of a reduced loss scales the
    gradients of the forward in place (they belong to this call), so it may run only once per forward."""

    @staticmethod
    def forward(ctx, plan, hidden, weight, bias, labels):
        loss, zl, lse, gh, gw, gb = plan.forward(hidden, weight, bias, labels)
        ctx.plan = plan
        if plan.reduce:
            ctx.grads = [gh, gw, gb]
        else:
            ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.mark_non_differentiable(zl)
        ctx.set_materialize_grads(False)
        return loss, zl

    @staticmethod
    def backward(ctx, dloss, _dzl):
        if dloss is None:
            return (None,) * 5
        plan = ctx.plan
        if not plan.reduce:
            hidden, weight, bias, labels, lse = ctx.saved_tensors
            gh, gw, gb = plan.backward(dloss, hidden, weight, bias, labels, lse)
        else:
            if ctx.grads is None:
                raise RuntimeError("fused_linear_cross_entropy: backward through the same forward twice "
                                   "(retain_graph=True) is not supported; its gradients were computed in the "
                                   "forward and handed out by the first backward")
            # Scale in place (no second copy of grad_weight); then drop our reference so autograd owns it.
            gh, gw, gb = ctx.grads
            ctx.grads = None
            plan.scale_grads(dloss, gh, gw, gb)
        return None, gh, gw, gb, None


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    return_z_loss: bool = False,
    chunk_size: int | None = None,
    accum_dtype: torch.dtype | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Cross-entropy of ``hidden @ weight.T + bias`` without materialising the ``(N, V)`` logits.

    Args:
        hidden: ``(..., H)`` fp16/bf16/fp32 activations (any row stride).
        weight: ``(V, H)``, the dtype of ``hidden``. bias: ``(V,)`` or ``None``, same dtype.
        labels: ``hidden.shape[:-1]`` integer class ids; ``ignore_index`` rows add nothing.
        label_smoothing: in ``[0, 1]``. lse_square_scale: z-loss weight (adds ``scale * lse^2``).
        softcap: ``softcap * tanh(logits / softcap)`` before the softmax (None: off).
        reduction: ``"mean"`` (over non-ignored rows), ``"sum"`` or ``"none"`` (per row).
        return_z_loss: also return the z-loss part (reduced the same way, not differentiable).
        chunk_size: rows per chunk (default: from ``TUNING["chunk_bytes"]``).
        accum_dtype: ``grad_weight`` accumulator dtype: ``None`` (the weight's) or ``torch.float32``.

    Under CUDA autocast the inputs are cast to the autocast dtype first. Returns the fp32 loss (0-dim,
    or ``labels.shape`` for ``"none"``), or ``(loss, z_loss)``.
    """
    dev_type = hidden.device.type if isinstance(hidden, Tensor) else None
    if dev_type in ("cuda", "cpu") and torch.is_autocast_enabled(dev_type):
        dt = torch.get_autocast_dtype(dev_type)
        hidden, weight = hidden.to(dt), weight.to(dt)
        bias = bias.to(dt) if bias is not None else None
    grad_on = torch.is_grad_enabled()
    needs = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
             grad_on and bias is not None and bias.requires_grad)
    if torch.compiler.is_compiling():
        return _fused_linear_compiled(hidden, weight, labels, bias, ignore_index, label_smoothing, lse_square_scale,
                                      softcap, reduction, return_z_loss, chunk_size, accum_dtype, needs)
    plan = get_plan(hidden, weight, bias, labels, ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
                    needs, chunk_size, accum_dtype)
    if plan.check_values:
        check_labels(labels, plan.V, plan.ignore_index)
    h = hidden.reshape(-1, plan.H) if plan.flatten else hidden
    if plan.copy_hidden:
        h = h.contiguous()
    lab = labels.reshape(-1) if plan.flatten_labels else labels
    if needs[0] or needs[1] or needs[2]:
        loss, zl = _FusedLinearCEFn.apply(plan, h, weight, bias, lab)
    else:
        loss, zl = plan.forward(h, weight, bias, lab)[:2]
    if not plan.reduce and plan.flatten:
        loss, zl = loss.reshape(plan.lead), zl.reshape(plan.lead)
    return (loss, zl) if return_z_loss else loss


def default_chunk_rows(n_rows: int, vocab: int, dtype: torch.dtype) -> int:
    """The chunk the default budget gives for ``n_rows`` tokens of ``vocab`` classes (for benchmarks)."""
    return chunk_rows(n_rows, vocab, torch.finfo(dtype).bits // 8, 0)


# ------------------------------------------------------------------------------ custom ops


def _filled(ts, like: Tensor):
    return tuple(t if t is not None else nothing(like.device, like.dtype) for t in ts)


@torch.library.custom_op("culmen::fused_linear_cross_entropy", mutates_args=())
def fused_linear_cross_entropy_op(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    reduction: str,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    chunk_size: int,
    accum_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, z_loss, lse, grad_hidden, grad_weight, grad_bias)`` of ``hidden (N, H)``, ``labels (N,)``;
    absent gradients are empty tensors."""
    plan = get_plan(hidden, weight, bias, labels, ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
                    (need_hidden, need_weight, need_bias), chunk_size or None, accum_dtype)
    x = hidden.contiguous() if plan.copy_hidden else hidden
    out = plan.forward(x, weight, bias, labels)
    return out[:3] + _filled(out[3:], hidden)


@fused_linear_cross_entropy_op.register_fake
def _(hidden, weight, bias, labels, ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
      need_hidden, need_weight, need_bias, chunk_size, accum_dtype):
    N = hidden.shape[0]
    f32 = torch.float32
    shape = (N,) if reduction == "none" else ()
    grads = reduction != "none"
    return (hidden.new_empty(shape, dtype=f32), hidden.new_empty(shape, dtype=f32), hidden.new_empty((N,), dtype=f32),
            *_fake_grads(hidden, weight, bias, grads and need_hidden, grads and need_weight, grads and need_bias))


def _fake_grads(hidden, weight, bias, need_hidden, need_weight, need_bias):
    # The plans allocate the gradients contiguous, whatever the inputs' strides.
    return (hidden.new_empty(hidden.shape) if need_hidden else nothing(hidden.device, hidden.dtype),
            weight.new_empty(weight.shape) if need_weight else nothing(hidden.device, hidden.dtype),
            bias.new_empty(bias.shape) if need_bias and bias is not None else nothing(hidden.device, hidden.dtype))


@torch.library.custom_op("culmen::fused_linear_cross_entropy_bwd", mutates_args=())
def fused_linear_cross_entropy_bwd_op(
    dloss: Tensor,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    lse: Tensor,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    chunk_size: int,
    accum_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_hidden, grad_weight, grad_bias)`` of ``reduction="none"``; absent ones are empty tensors."""
    plan = get_plan(hidden, weight, bias, labels, ignore_index, label_smoothing, lse_square_scale, softcap, "none",
                    (need_hidden, need_weight, need_bias), chunk_size or None, accum_dtype)
    x = hidden.contiguous() if plan.copy_hidden else hidden
    return _filled(plan.backward(dloss, x, weight, bias, labels, lse), hidden)


@fused_linear_cross_entropy_bwd_op.register_fake
def _(dloss, hidden, weight, bias, labels, lse, ignore_index, label_smoothing, lse_square_scale, softcap,
      need_hidden, need_weight, need_bias, chunk_size, accum_dtype):
    return _fake_grads(hidden, weight, bias, need_hidden, need_weight, need_bias)


_OP_ARGS = ("hidden", "weight", "bias", "labels", "ignore_index", "label_smoothing", "lse_square_scale", "softcap",
            "reduction", "need_hidden", "need_weight", "need_bias", "chunk_size", "accum_dtype")


def _setup_context(ctx, inputs, output):
    a = dict(zip(_OP_ARGS, inputs))
    ctx.reduction = a["reduction"]
    ctx.needs = (a["need_hidden"], a["need_weight"], a["need_bias"] and a["bias"] is not None)
    if a["reduction"] == "none":
        ctx.save_for_backward(a["hidden"], a["weight"], a["bias"], a["labels"], output[2])
        ctx.consts = (a["ignore_index"], a["label_smoothing"], a["lse_square_scale"], a["softcap"])
        ctx.chunk = (a["chunk_size"], a["accum_dtype"])
    else:
        ctx.save_for_backward(*output[3:])


def _op_backward(ctx, dloss, dzl, dlse, *_):
    n_in = len(_OP_ARGS)
    if dloss is None:
        return (None,) * n_in
    if ctx.reduction == "none":
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        gh, gw, gb = fused_linear_cross_entropy_bwd_op(dloss, hidden, weight, bias, labels, lse, *ctx.consts,
                                                       *ctx.needs, *ctx.chunk)
    else:
        # Traced: Inductor fuses these scalings (a traced graph cannot skip them on the device as eager does).
        gh, gw, gb = (g * dloss.to(g.dtype) for g in ctx.saved_tensors)
    hn, wn, bn = ctx.needs
    return (gh if hn else None, gw if wn else None, gb if bn else None) + (None,) * (n_in - 3)


torch.library.register_autograd("culmen::fused_linear_cross_entropy", _op_backward, setup_context=_setup_context)


def _fused_linear_compiled(hidden, weight, labels, bias, ignore_index, label_smoothing, lse_square_scale, softcap,
                           reduction, return_z_loss, chunk_size, accum_dtype, needs):
    """``fused_linear_cross_entropy`` while ``torch.compile`` traces: checks on the traced shapes, then the
    opaque custom op (its implementation uses the cached plans at run time)."""
    validate(hidden, weight, labels, bias, ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
             chunk_size, accum_dtype)
    H = weight.shape[1]
    h2 = hidden.reshape(-1, H)
    lab = labels.reshape(-1)
    loss, zl, _ = fused_linear_cross_entropy_op(h2, weight, bias, lab, int(ignore_index), float(label_smoothing),
                                                float(lse_square_scale), float(softcap or 0.0), reduction, *needs,
                                                int(chunk_size or 0), accum_dtype)[:3]
    if reduction == "none":
        loss, zl = loss.reshape(labels.shape), zl.reshape(labels.shape)
    return (loss, zl) if return_z_loss else loss


__all__ = ["TUNING", "default_chunk_rows", "fused_linear_cross_entropy", "get_plan"]
