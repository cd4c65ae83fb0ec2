"""``transducer_joint`` and ``rnnt_loss``, the op-level entry points behind ``culmen.contrib.transducer``
(Apex's ``apex.contrib.transducer``), their eager autograd, and the ``torch.library`` ops that
``torch.compile`` traces.

The call path (DESIGN.md): a key from the call signature looks up a cached plan (the checks ran when it
was built); the call then goes through a plain ``autograd.Function`` when a gradient is wanted, else
straight to the plan. Under ``torch.compile`` both entry points call ``triton_op``s instead
(``culmen::transducer_joint_fwd``, ``culmen::rnnt_loss_fwd``) whose bodies launch through ``wrap_triton``;
their backwards (``register_autograd``) are the ops ``culmen::transducer_joint_bwd`` and
``culmen::rnnt_loss_bwd``. The value checks of lengths and labels (a device sync) are left out there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import register_op
from culmen.ops.common.function import raw_apply
from culmen.ops.transducer.launch import JOINT_PLANS, LOSS_PLANS, STATS, JointPlan, LossPlan

register_op("transducer_joint_fwd", "transducer", "RNN-T joint: f[:, :, None] + g[:, None] (+ReLU, dropout), packed")
register_op("transducer_joint_bwd", "transducer", "gradient of the joint: masked sums over u and over t")
register_op("rnnt_loss_fwd", "transducer", "RNN-T loss: log-softmax statistics, alpha/beta recursions")
register_op("rnnt_loss_bwd", "transducer", "gradient of the RNN-T loss w.r.t. the logits, softmax backward fused")


_compiling = torch.compiler.is_compiling


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
    if _compiling():
        return _joint_compiled(f, g, f_len, g_len, batch_offset, packed_batch, pack_output, relu, dropout_prob,
                               return_mask)
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
    if _compiling():
        return _loss_compiled(x, label, f_len, y_len, blank_idx, batch_offset, max_f_len, packed_input, debug_list)
    plan = _loss_plan(x, label, f_len, y_len, blank_idx, batch_offset, max_f_len, packed_input)
    x, label, f_len, y_len, boff = plan.prepare(x, label, f_len, y_len, batch_offset)
    if torch.is_grad_enabled() and x.requires_grad:
        return _loss_apply(plan, x, label, f_len, y_len, boff, debug_list)
    loss, saved = plan.forward(x, label, f_len, y_len, boff)
    if debug_list is not None:
        debug_list += [saved["alpha"], saved["beta"]]
    return loss


# -------------------------------------------------------------------------- torch.compile


@torch.library.triton_op("culmen::transducer_joint_fwd", mutates_args=())
def transducer_joint_fwd_op(f: Tensor, g: Tensor, f_len: Tensor, g_len: Tensor, batch_offset: Tensor | None,
                            rng: Tensor | None, packed_batch: int, pack_output: bool, relu: bool,
                            dropout_p: float | None, store_mask: bool) -> tuple[Tensor, Tensor]:
    """``transducer_joint`` for ``torch.compile`` on contiguous inputs: ``(h, mask)``, ``mask`` a 0-element
    uint8 tensor unless ``store_mask``. ``rng``: the dropout ``(seed, offset)`` int64 pair (``None``
    without dropout), drawn by the caller so that the backward replays it."""
    plan = JointPlan(f, g, f_len, g_len, batch_offset, packed_batch, pack_output, relu, dropout_p, store_mask,
                     traced=True)
    return plan.forward_traced(f, g, f_len, g_len, batch_offset, rng)


@torch.library.triton_op("culmen::transducer_joint_bwd", mutates_args=())
def transducer_joint_bwd_op(dh: Tensor, f: Tensor, g: Tensor, f_len: Tensor, g_len: Tensor,
                            batch_offset: Tensor | None, rng: Tensor | None, packed_batch: int, pack_output: bool,
                            relu: bool, dropout_p: float | None) -> tuple[Tensor, Tensor]:
    """The gradient ``(df, dg)`` of ``culmen::transducer_joint_fwd`` for the output gradient ``dh``."""
    plan = JointPlan(f, g, f_len, g_len, batch_offset, packed_batch, pack_output, relu, dropout_p, False, traced=True)
    return plan.backward_traced(dh, f, g, f_len, g_len, batch_offset, rng)


def _joint_setup(ctx, inputs, output):
    f, g, f_len, g_len, boff, rng, *ctx.scalars = inputs
    ctx.save_for_backward(f, g, f_len, g_len, boff, rng)


def _joint_backward(ctx, dh, _dmask):
    f, g, f_len, g_len, boff, rng = ctx.saved_tensors
    packed_batch, pack, relu, dropout_p, _ = ctx.scalars
    df, dg = transducer_joint_bwd_op(dh, f, g, f_len, g_len, boff, rng, packed_batch, pack, relu, dropout_p)
    return df, dg, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("culmen::transducer_joint_fwd", _joint_backward, setup_context=_joint_setup)


def _joint_compiled(f, g, f_len, g_len, batch_offset, packed_batch, pack_output, relu, dropout_prob, return_mask):
    """``transducer_joint`` while ``torch.compile`` traces (the op's body checks the arguments)."""
    pack = bool(pack_output)
    p = None if dropout_prob is None else float(dropout_prob)
    masked = bool(relu) or p is not None
    # (seed, offset) from torch's generator, as the eager plan draws it
    rng = None if p is None else torch.randint(0, 2**62, (2,), device=f.device, dtype=torch.int64)
    boff = batch_offset.contiguous() if pack else None
    h, mask = transducer_joint_fwd_op(f.contiguous(), g.contiguous(), f_len.contiguous(), g_len.contiguous(), boff,
                                      rng, packed_batch if pack else 0, pack, bool(relu), p,
                                      bool(return_mask) and masked)
    if not return_mask:
        return h
    return h, (mask if masked else None)


@torch.library.triton_op("culmen::rnnt_loss_fwd", mutates_args=())
def rnnt_loss_fwd_op(x: Tensor, label: Tensor, f_len: Tensor, y_len: Tensor, batch_offset: Tensor | None,
                     blank_idx: int, max_f_len: int, packed_input: bool) -> tuple[Tensor, Tensor, Tensor, Tensor,
                                                                                  Tensor, Tensor]:
    """``rnnt_loss`` for ``torch.compile`` on contiguous inputs: ``(loss, alpha, beta, lse, lpb, lpe)``, the
    ``(B,)`` loss (``x.dtype``) and the ``(B, T, U)`` statistics the backward reads (fp32, fp64 for fp64 ``x``).
    ``max_f_len`` is read only with ``packed_input``."""
    plan = LossPlan(x, label, f_len, y_len, blank_idx, batch_offset, max_f_len, packed_input, traced=True)
    return plan.forward_traced(x, label, f_len, y_len, batch_offset)


@torch.library.triton_op("culmen::rnnt_loss_bwd", mutates_args=())
def rnnt_loss_bwd_op(loss_grad: Tensor, x: Tensor, label: Tensor, f_len: Tensor, y_len: Tensor,
                     batch_offset: Tensor | None, alpha: Tensor, beta: Tensor, lse: Tensor, lpb: Tensor, lpe: Tensor,
                     blank_idx: int, max_f_len: int, packed_input: bool) -> Tensor:
    """The gradient (``x``'s shape and dtype) of ``(loss_grad * loss).sum()`` for ``culmen::rnnt_loss_fwd``."""
    plan = LossPlan(x, label, f_len, y_len, blank_idx, batch_offset, max_f_len, packed_input, traced=True)
    saved = dict(zip(STATS, (alpha, beta, lse, lpb, lpe)))
    return plan.backward_traced(loss_grad, x, label, f_len, y_len, batch_offset, saved)


def _loss_setup(ctx, inputs, output):
    x, label, f_len, y_len, boff, *ctx.scalars = inputs
    ctx.save_for_backward(x, label, f_len, y_len, boff, *output[1:])


def _loss_backward(ctx, dloss, *_dstats):
    x, label, f_len, y_len, boff, *stats = ctx.saved_tensors
    dx = rnnt_loss_bwd_op(dloss, x, label, f_len, y_len, boff, *stats, *ctx.scalars)
    return dx, None, None, None, None, None, None, None


torch.library.register_autograd("culmen::rnnt_loss_fwd", _loss_backward, setup_context=_loss_setup)


def _loss_compiled(x, label, f_len, y_len, blank_idx, batch_offset, max_f_len, packed_input, debug_list):
    """``rnnt_loss`` while ``torch.compile`` traces (the op's body checks the arguments)."""
    packed = bool(packed_input)
    out = rnnt_loss_fwd_op(x.contiguous(), label.contiguous(), f_len.contiguous(), y_len.contiguous(),
                           batch_offset.contiguous() if packed else None, blank_idx,
                           max_f_len if packed else 0, packed)
    if debug_list is not None:
        debug_list += [out[1], out[2]]
    return out[0]
