"""``pair_attention``: the op-level entry point of attention with an additive pair bias and a logit mask
(Apex's ``contrib.openfold_triton`` MHA: ``AttnTri``, ``AttnBiasJIT``, ``AttnNoBiasJIT``), and its autograd.

The call path (DESIGN.md): the arguments are brought to the canonical 5-d layout with views (leading
batch dims beyond two are merged; a bias broadcast over some of the merged dims is expanded there, and
autograd sums its gradient back), a key of the canonical signature finds the cached ``PairAttnPlan``,
and with autograd recording the call goes through ``_PairAttnFn`` (a plain ``autograd.Function``).
CPU tensors (unless the backend is ``triton``), fp64 and head dims above 256 take the PyTorch
reference. Under ``torch.compile`` the reference formulation is traced (Inductor fuses it, as Apex's
``AttnBiasJIT`` does); the Triton kernels are not yet registered as a ``torch.library`` op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import register_op
from culmen.ops.common.function import raw_apply
from culmen.ops.pair_attention.launch import PLANS, PairAttnPlan
from culmen.ops.pair_attention.reference import pair_attention_ref

register_op("pair_attention_fwd", "attention", "attention with an additive pair bias and a logit mask (OpenFold)")
register_op("pair_attention_bwd", "attention", "backward of pair_attention_fwd: dq, dk, dv and the reduced dbias")


class _PairAttnFn(torch.autograd.Function):
    """Eager autograd: the plan's kernels called directly."""

    @staticmethod
    def forward(ctx, plan, q, k, v, bias, mask):
        o, lse = plan.forward(q, k, v, bias, mask)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, bias, mask, o, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, bias, mask, o, lse = ctx.saved_tensors
        dq, dk, dv, db = ctx.plan.backward(do, q, k, v, bias, mask, o, lse, ctx.needs_input_grad[4])
        return None, dq, dk, dv, db, None


_apply = raw_apply(_PairAttnFn)


def _canon(t: Tensor, batch: tuple, name: str) -> Tensor:
    """``t`` (broadcastable to ``(*batch, A, B, C)``) as a 5-d ``[c1, c2, A', B', C']`` tensor, by views where
    possible (differentiable: autograd maps the gradient back)."""
    nb = len(batch)
    if t.dim() > nb + 3:
        raise ValueError(f"pair_attention: {name} has {t.dim()} dims, more than q's {nb + 3}")
    if t.dim() < nb + 3:
        t = t.reshape((1,) * (nb + 3 - t.dim()) + tuple(t.shape))
    if nb == 2:
        return t
    if nb < 2:
        return t.reshape((1,) * (2 - nb) + tuple(t.shape))
    tail = tuple(t.shape[nb - 1:])
    lead = t.shape[:nb - 1]
    if all(s == 1 for s in lead):
        return t.reshape((1, *tail))
    for s, f in zip(lead, batch[:-1]):
        if s not in (1, f):
            raise ValueError(f"pair_attention: {name} of shape {tuple(t.shape)} does not broadcast to the batch "
                             f"dims {batch}")
    return t.expand(*batch[:-1], *tail).reshape((-1, *tail))


def canonicalize(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, mask: Tensor | None):
    """The 5-d forms of the arguments (see ``_canon``); a bool mask is viewed as uint8 (no copy)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"pair_attention: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() < 3:
            raise ValueError(f"pair_attention: {name} must be [*, H, seq, D] (at least 3 dims), got shape "
                             f"{tuple(t.shape)}")
    batch = tuple(q.shape[:-3])
    if tuple(k.shape[:-3]) != batch or tuple(v.shape[:-3]) != batch:
        raise ValueError(f"pair_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must have q's batch dims "
                         f"{batch}")
    q5, k5, v5 = _canon(q, batch, "q"), _canon(k, batch, "k"), _canon(v, batch, "v")
    b5 = None if bias is None else _canon(bias, batch, "bias")
    m5 = None
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"pair_attention: mask must be a tensor or None, got {type(mask).__name__}")
        m5 = _canon(mask.detach(), batch, "mask")
        if m5.dtype == torch.bool:
            m5 = m5.view(torch.uint8)
    return q5, k5, v5, b5, m5


def _sig(t: Tensor | None):
    return None if t is None else (t.shape, t.stride(), t.dtype)


def pair_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None, mask: Tensor | None = None,
                   inf: float = 1e9, scale: float | None = None) -> Tensor:
    """``softmax(q k^T * scale + (mask - 1) * inf + bias) v``, memory O(seq) per row block, differentiable in
    ``q``, ``k``, ``v`` and ``bias`` (its gradient summed over the dims it is broadcast on).

    Args:
        q: ``[*, H, M, D]`` fp16/bf16/fp32 (fp64 runs the reference); any strides.
        k, v: ``[*, H, N, D]``, q's dtype and batch dims ``*``.
        bias: additive logit bias broadcastable to ``[*, H, M, N]`` (any float dtype; OpenFold's pair bias
            is ``[B, 1, H, N, N]`` against q ``[B, I, H, N, D]``) or ``None``.
        mask: broadcastable to ``[*, H, M, N]``, 1 keeps a key and 0 masks it (bool, int or float; the
            logit gets ``(mask - 1) * inf``) or ``None``. Not differentiated.
        inf: the finite "infinity" of the mask (Apex / OpenFold: ``1e9``).
        scale: logit scale, default ``1 / sqrt(D)``.

    Returns:
        ``[*, H, M, D]`` in q's dtype (contiguous).
    """
    if torch.compiler.is_compiling():
        return pair_attention_ref(q, k, v, bias, mask, inf, scale)
    q5, k5, v5, b5, m5 = canonicalize(q, k, v, bias, mask)
    try:
        key = (_sig(q5), _sig(k5), _sig(v5), _sig(b5), _sig(m5), q5.device, inf, scale)
        plan = PLANS.get(key)
    except TypeError:  # unhashable scalars: the plan says why
        key, plan = None, None
    if plan is None:
        plan = PairAttnPlan(q5, k5, v5, b5, m5, inf, scale)
        if key is not None:
            PLANS.put(key, plan)
    out_shape = tuple(q.shape)
    if not plan.use_kernel:
        return pair_attention_ref(q5, k5, v5, b5, m5, inf, plan.scale).reshape(out_shape)
    if torch.is_grad_enabled() and (q5.requires_grad or k5.requires_grad or v5.requires_grad
                                    or (b5 is not None and b5.requires_grad)):
        o = _apply(plan, q5, k5, v5, b5, m5)
    else:
        o, _ = plan.forward(q5, k5, v5, b5, m5)
    return o.view(out_shape)
