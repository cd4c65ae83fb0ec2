"""``pair_attention``: the op-level entry point of attention with an additive pair bias and a logit mask
(Apex's ``contrib.openfold_triton`` MHA: ``AttnTri``, ``AttnBiasJIT``, ``AttnNoBiasJIT``), and its autograd.

The call path (DESIGN.md): the arguments are brought to the canonical 5-d layout with views (leading
batch dims beyond two are merged; a bias broadcast over some of the merged dims is expanded there, and
autograd sums its gradient back), a key of the canonical signature finds the cached ``PairAttnPlan``,
and with autograd recording the call goes through ``_PairAttnFn`` (a plain ``autograd.Function``).
CPU tensors (unless the backend is ``triton``), fp64 and head dims above 256 take the PyTorch
reference.

Under ``torch.compile`` (``torch.compiler.is_compiling()``) the canonicalizing views are traced and the
kernels are two opaque ``torch.library.custom_op`` s, ``culmen::pair_attention_fwd`` (``o`` and the
row LSE) and ``culmen::pair_attention_bwd`` (``dq``, ``dk``, ``dv`` and the bias gradient, an empty
tensor when not wanted), tied by ``register_autograd``; their fake implementations give the real
outputs' shapes, strides and dtypes. At run time their bodies call the same cached plan as an eager
call (the Triton kernels, the interpreter on CPU). Calls the kernels do not take (see above) trace the
reference formulation instead, which Inductor fuses as Apex's ``AttnBiasJIT`` does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import choose_backend, register_op
from culmen.ops.common.function import raw_apply
from culmen.ops.pair_attention.launch import KERNEL_DTYPES, MAX_HEAD_DIM, PLANS, PairAttnPlan
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
            # a free reinterpretation in eager; Inductor cannot lower a bool bitcast, so a traced call converts
            m5 = m5.to(torch.uint8) if torch.compiler.is_compiling() else m5.view(torch.uint8)
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
        return _pair_attention_compiled(q, k, v, bias, mask, inf, scale)
    q5, k5, v5, b5, m5 = canonicalize(q, k, v, bias, mask)
    plan = _plan(q5, k5, v5, b5, m5, inf, scale)
    out_shape = tuple(q.shape)
    if not plan.use_kernel:
        return pair_attention_ref(q5, k5, v5, b5, m5, inf, plan.scale).reshape(out_shape)
    if torch.is_grad_enabled() and (q5.requires_grad or k5.requires_grad or v5.requires_grad
                                    or (b5 is not None and b5.requires_grad)):
        o = _apply(plan, q5, k5, v5, b5, m5)
    else:
        o, _ = plan.forward(q5, k5, v5, b5, m5)
    return o.view(out_shape)


def _plan(q5: Tensor, k5: Tensor, v5: Tensor, b5: Tensor | None, m5: Tensor | None, inf: float,
          scale: float | None) -> PairAttnPlan:
    """The cached plan of canonical arguments (built, and the arguments checked, on first use)."""
    try:
        key = (_sig(q5), _sig(k5), _sig(v5), _sig(b5), _sig(m5), q5.device, inf, scale)
        plan = PLANS.get(key)
    except TypeError:  # unhashable scalars: the plan says why
        key, plan = None, None
    if plan is None:
        plan = PairAttnPlan(q5, k5, v5, b5, m5, inf, scale)
        if key is not None:
            PLANS.put(key, plan)
    return plan


# -------------------------------------------------------------------------- torch.compile


@torch.library.custom_op("culmen::pair_attention_fwd", mutates_args=())
def pair_attention_fwd_op(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, mask: Tensor | None, inf: float,
                          scale: float | None) -> tuple[Tensor, Tensor]:
    """``(o, lse)`` of canonical 5-d arguments (see ``canonicalize``; the mask not bool) for ``torch.compile``:
    ``o`` contiguous ``[Z1, Z2, H, M, D]`` in q's dtype, ``lse`` fp32 ``[Z1 * Z2 * H, M]`` (log2 units)."""
    return _plan(q, k, v, bias, mask, inf, scale).forward(q, k, v, bias, mask)


@pair_attention_fwd_op.register_fake
def _fwd_fake(q, k, v, bias, mask, inf, scale):
    z1, z2, h, m, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((z1 * z2 * h, m), dtype=torch.float32)


@torch.library.custom_op("culmen::pair_attention_bwd", mutates_args=())
def pair_attention_bwd_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, mask: Tensor | None,
                          o: Tensor, lse: Tensor, inf: float, scale: float | None,
                          need_dbias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dbias)`` of ``pair_attention_fwd`` (contiguous; ``dbias`` in the bias' shape and dtype, or
    an empty tensor unless ``need_dbias``) for ``torch.compile``."""
    plan = _plan(q, k, v, bias, mask, inf, scale)
    dq, dk, dv, db = plan.backward(do, q, k, v, bias, mask, o, lse, need_dbias)
    return dq, dk, dv, (db if db is not None else q.new_empty((0,)))


@pair_attention_bwd_op.register_fake
def _bwd_fake(do, q, k, v, bias, mask, o, lse, inf, scale, need_dbias):
    db = bias.new_empty(bias.shape) if need_dbias and bias is not None else q.new_empty((0,))
    return q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(k.shape), db


def _setup_context(ctx, inputs, output):
    q, k, v, bias, mask, inf, scale = inputs
    o, lse = output
    ctx.inf, ctx.scale = inf, scale
    ctx.save_for_backward(q, k, v, bias, mask, o, lse)


def _compiled_backward(ctx, do, dlse):
    q, k, v, bias, mask, o, lse = ctx.saved_tensors
    need_db = bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, db = pair_attention_bwd_op(do, q, k, v, bias, mask, o, lse, ctx.inf, ctx.scale, need_db)
    return dq, dk, dv, (db if need_db else None), None, None, None


torch.library.register_autograd("culmen::pair_attention_fwd", _compiled_backward, setup_context=_setup_context)


def _pair_attention_compiled(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, mask: Tensor | None, inf: float,
                             scale: float | None) -> Tensor:
    """``pair_attention`` while ``torch.compile`` traces: the canonicalizing views, then the custom op where an
    eager call would run the kernels, else the traced reference."""
    q5, k5, v5, b5, m5 = canonicalize(q, k, v, bias, mask)
    use_kernel = (choose_backend(q5.device) == "triton" and q5.dtype in KERNEL_DTYPES
                  and q5.shape[-1] <= MAX_HEAD_DIM and q5.numel() > 0 and k5.numel() > 0)
    if not use_kernel:
        return pair_attention_ref(q, k, v, bias, mask, inf, scale)
    o, _ = pair_attention_fwd_op(q5, k5, v5, b5, m5, float(inf), None if scale is None else float(scale))
    return o.view(q.shape)
