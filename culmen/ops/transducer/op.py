"""``transducer_joint`` and ``rnnt_loss``, the op-level entry points behind ``culmen.contrib.transducer``
(Apex's ``apex.contrib.transducer``), and their eager autograd.

The call path (DESIGN.md): a key from the call signature looks up a cached plan (the checks ran when it
was built); the call then goes through a plain ``autograd.Function`` when a gradient is wanted, else
straight to the plan. Neither op has a ``torch.library`` registration yet: under ``torch.compile`` they
run as opaque eager calls (a graph break).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import register_op
from culmen.ops.common.function import raw_apply
from culmen.ops.transducer.launch import JOINT_PLANS, LOSS_PLANS, JointPlan, LossPlan

register_op("transducer_joint_fwd", "transducer", "RNN-T joint: f[:, :, None] + g[:, None] (+ReLU, dropout), packed")
register_op("transducer_joint_bwd", "transducer", "gradient of the joint: masked sums over u and over t")
register_op("rnnt_loss_fwd", "transducer", "RNN-T loss: log-softmax statistics, alpha/beta recursions")
register_op("rnnt_loss_bwd", "transducer", "gradient of the RNN-T loss w.r.t. the logits, softmax backward fused")


def _sig(t: Tensor | None):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _joint_plan(f, g, f_len, g_len, batch_offset, packed_batch, pack_output, relu, dropout_p, store_mask) -> JointPlan:
    try:
        key = (_sig(f), _sig(g), _sig(f_len), _sig(g_len), _sig(batch_offset) if pack_output else None,
               packed_batch if pack_output else 0, pack_output, relu, dropout_p, store_mask)
        plan = JOINT_PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors / unhashable: the plan says why
        key, plan = None, None
    if plan is None:
        plan = JointPlan(f, g, f_len, g_len, batch_offset, packed_batch, pack_output, relu, dropout_p, store_mask)
        if key is not None:
            JOINT_PLANS.put(key, plan)
    return plan


class _JointFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, f, g, f_len, g_len, boff):
        h, mask, rng = plan.forward(f, g, f_len, g_len, boff)
        ctx.plan = plan
        ctx.rng = rng
        # f and g are saved for their shapes and ReLU's mask; autograd usually keeps them alive anyway.
        ctx.save_for_backward(f, g, f_len, g_len, boff)
        if mask is None:
            return h
        ctx.mark_non_differentiable(mask)
        return h, mask

    @staticmethod
    def backward(ctx, dh, *_):
        f, g, f_len, g_len, boff = ctx.saved_tensors
        df, dg = ctx.plan.backward(dh, f, g, f_len, g_len, boff, ctx.rng)
        return None, df, dg, None, None, None


_joint_apply = raw_apply(_JointFn)


def transducer_joint(f: Tensor, g: Tensor, f_len: Tensor, g_len: Tensor, batch_offset: Tensor | None = None,
                     packed_batch: int = 0, pack_output: bool = False, relu: bool = False,
                     dropout_prob: float | None = None, return_mask: bool = False):
    """The RNN-T joint ``h[b, t, u] = f[b, t] + g[b, u]``, optionally ReLU'd, dropped out and packed.

    Args:
        f: ``(B, T, H)`` encoder output; g: ``(B, U, H)`` prediction-network output (same dtype, device).
        f_len, g_len: ``(B,)`` integer valid lengths along ``T`` and ``U``.
        batch_offset: ``(B,)`` integers, ``cumsum(f_len * g_len)``; required when ``pack_output``.
        packed_batch: rows of the packed output (``batch_offset[-1]`` or more); required when packing.
        pack_output: ``False``: ``(B, T, U, H)`` with ``-1`` outside the lengths (as Apex writes).
            ``True``: ``(packed_batch, H)``, batch ``b``'s row ``(t, u)`` at
            ``batch_offset[b-1] + t * g_len[b] + u``; rows past ``batch_offset[-1]`` are zero.
        relu: ReLU on the sum. dropout_prob: ``None`` for no dropout, else the drop probability (kept
            elements are scaled by ``1 / (1 - p)``).
        return_mask: also return the uint8 keep-mask (ReLU and dropout), in ``h``'s layout.

    Returns:
        ``h`` (dtype of ``f``), or ``(h, mask)``. Differentiable in ``f`` and ``g``; the gradients are
        zero at ``t >= f_len`` / ``u >= g_len``, and the mask is recomputed in the backward, never stored.
    """
    plan = _joint_plan(f, g, f_len, g_len, batch_offset, packed_batch, pack_output, relu, dropout_prob, return_mask)
    f, g, f_len, g_len, boff = plan.prepare(f, g, f_len, g_len, batch_offset)
    if torch.is_grad_enabled() and (f.requires_grad or g.requires_grad):
        out = _joint_apply(plan, f, g, f_len, g_len, boff)
        if plan.store_mask:
            return out
        return (out, None) if return_mask else out
    h, mask, _ = plan.forward(f, g, f_len, g_len, boff)
    return (h, mask) if return_mask else h


def _loss_plan(x, label, f_len, y_len, blank_idx, batch_offset, max_f_len, packed_input) -> LossPlan:
    try:
        key = (_sig(x), _sig(label), _sig(f_len), _sig(y_len), _sig(batch_offset) if packed_input else None,
               blank_idx, max_f_len if packed_input else None, packed_input)
        plan = LOSS_PLANS.get(key)
    except (AttributeError, TypeError):
        key, plan = None, None
    if plan is None:
        plan = LossPlan(x, label, f_len, y_len, blank_idx, batch_offset, max_f_len, packed_input)
        if key is not None:
            LOSS_PLANS.put(key, plan)
    return plan


class _LossFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, x, label, f_len, y_len, boff, debug_list):
        loss, saved = plan.forward(x, label, f_len, y_len, boff)
        if debug_list is not None:
            debug_list += [saved["alpha"], saved["beta"]]
        ctx.plan = plan
        ctx.names = tuple(saved)
        ctx.save_for_backward(x, label, f_len, y_len, boff, *saved.values())
        return loss

    @staticmethod
    def backward(ctx, loss_grad):
        x, label, f_len, y_len, boff, *stats = ctx.saved_tensors
        saved = dict(zip(ctx.names, stats))
        return None, ctx.plan.backward(loss_grad, x, label, f_len, y_len, boff, saved), None, None, None, None, None


_loss_apply = raw_apply(_LossFn)


def rnnt_loss(x: Tensor, label: Tensor, f_len: Tensor, y_len: Tensor, blank_idx: int,
              batch_offset: Tensor | None = None, max_f_len: int | None = None, packed_input: bool = False,
              debug_list: list | None = None) -> Tensor:
    """RNN-T loss ``-log P(label | x)`` per batch, on unnormalized logits (the log-softmax is fused).

    Args:
        x: logits, ``(B, T, U, K)`` or, with ``packed_input``, ``(N, K)`` where batch ``b``'s row ``(t, u)``
            is ``batch_offset[b-1] + t * (y_len[b] + 1) + u``. fp16/bf16/fp32/fp64.
        label: ``(B, >= U-1)`` integer labels (``U = x.shape[2]``, or ``label.shape[1] + 1`` packed).
        f_len: ``(B,)`` frames per batch, ``1 <= f_len <= T``; y_len: ``(B,)`` labels, ``0 <= y_len <= U-1``.
        blank_idx: the blank symbol, in ``[0, K)``.
        batch_offset: ``(B,)`` integers, ``cumsum(f_len * (y_len + 1))``; required with ``packed_input``.
        max_f_len: ``T`` of the packed input (``max(f_len)`` or more); required with ``packed_input``.
        debug_list: an empty list receives ``[alpha, beta]`` (``(B, T, U)`` fp32, fp64 for fp64 ``x``;
            entries outside the lengths are unspecified).

    Returns:
        ``(B,)`` losses in ``x.dtype`` (fp32 arithmetic), differentiable in ``x``; the gradient (dtype of
        ``x``) is zero on rows outside the lengths.
    """
    plan = _loss_plan(x, label, f_len, y_len, blank_idx, batch_offset, max_f_len, packed_input)
    x, label, f_len, y_len, boff = plan.prepare(x, label, f_len, y_len, batch_offset)
    if torch.is_grad_enabled() and x.requires_grad:
        return _loss_apply(plan, x, label, f_len, y_len, boff, debug_list)
    loss, saved = plan.forward(x, label, f_len, y_len, boff)
    if debug_list is not None:
        debug_list += [saved["alpha"], saved["beta"]]
    return loss
