"""``index_mul_2d``, the op-level entry point of ``culmen.contrib.index_mul_2d``, its eager autograd
(backward differentiable once more: double backward, as in Apex), and the ``torch.library`` op
``culmen::index_mul_2d_fwd`` that ``torch.compile`` traces.

The call path (DESIGN.md): an eager call builds a key from its signature and looks up a cached
``IndexMulPlan`` (validation ran when the plan was built); with autograd recording it goes through
``_IndexMul2dFn``, otherwise straight to the plan. The backward calls the plan directly, unless it is
itself being recorded (``create_graph=True``): then it goes through ``_IndexMul2dBwdFn``, whose backward
is the double backward. Under ``torch.compile`` the forward is a ``triton_op`` whose body launches
through ``wrap_triton``; its registered backward launches the gradient kernels the same way (the
compiled path is differentiable once).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import deterministic_enabled, register_op
from culmen.ops.index_mul_2d.launch import PLANS, IndexMulPlan, check_args, rows_ok

register_op("index_mul_2d_fwd", "indexing", "out = in1[idx] * in2 over rows")
register_op("index_mul_2d_bwd", "indexing", "backward of index_mul_2d (scatter-add for in1, atomic or sorted)")
register_op("index_mul_2d_bwd_bwd", "indexing", "double backward of index_mul_2d")


def _deterministic() -> bool:
    """Whether the gradient of ``in1`` must be bitwise reproducible (``culmen.set_deterministic`` or torch's
    switch): the atomic scatter is then never used. (The plans read ``deterministic_enabled`` per call.)"""
    return deterministic_enabled()


def _plan(in1: Tensor, in2: Tensor, idx1: Tensor) -> IndexMulPlan:
    """The cached plan of a call signature (built, and the arguments checked, on first use)."""
    try:
        key = (in1.shape, in1.stride(), in1.dtype, in1.device, in2.shape, in2.stride(), in2.dtype, in2.device,
               idx1.shape, idx1.stride(), idx1.dtype, idx1.device)
        plan = PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors: the plan says why
        key, plan = None, None
    if plan is None:
        plan = IndexMulPlan(in1, in2, idx1)
        if key is not None:
            PLANS.put(key, plan)
    return plan


def _empty_for(t: Tensor | None, like: Tensor) -> Tensor:
    """Autograd functions here return tensors for absent gradients: an empty one."""
    return t if t is not None else like.new_empty((0,))


def _opt(t: Tensor | None) -> Tensor | None:
    """An absent gradient (an empty placeholder, or ``None``) as ``None``."""
    return None if t is None or (t.dim() == 1 and t.shape[0] == 0) else t


class _IndexMul2dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, in1, in2, idx):
        ctx.plan = plan
        ctx.save_for_backward(in1, in2, idx)
        return plan.forward(in1, in2, idx)

    @staticmethod
    def backward(ctx, gout):
        plan = ctx.plan
        in1, in2, idx = ctx.saved_tensors
        need1, need2 = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if torch.is_grad_enabled():  # create_graph: the backward is recorded for a double backward
            gin1, gin2 = _IndexMul2dBwdFn.apply(plan, gout, in1, in2, idx, need1, need2)
            return None, _opt(gin1), _opt(gin2), None
        gin1, gin2 = plan.backward(gout, in1, in2, idx, need1, need2)
        return None, gin1, gin2, None


class _IndexMul2dBwdFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, gout, in1, in2, idx, need_gin1, need_gin2):
        if not gout.is_contiguous():
            gout = gout.contiguous()
        ctx.plan = plan
        ctx.save_for_backward(gout, in1, in2, idx)
        ctx.set_materialize_grads(False)
        gin1, gin2 = plan.backward(gout, in1, in2, idx, need_gin1, need_gin2)
        return _empty_for(gin1, in1), _empty_for(gin2, in2)

    @staticmethod
    def backward(ctx, gg1, gg2):
        gout, in1, in2, idx = ctx.saved_tensors
        need = ctx.needs_input_grad
        if not (need[1] or need[2] or need[3]):
            return None, None, None, None, None, None, None
        ggout, gin1, gin2 = ctx.plan.backward_backward(_opt(gg1), _opt(gg2), gout, in1, in2, idx, need[1], need[2],
                                                       need[3])
        return None, ggout, gin1, gin2, None, None, None


def index_mul_2d(in1: Tensor, in2: Tensor, idx1: Tensor) -> Tensor:
    """``in1[idx1] * in2`` (Apex's ``index_mul_2d``), differentiable twice.

    Args:
        in1: ``(M, F)`` float16/bfloat16/float32/float64.
        in2: ``(N, F)``, the dtype of ``in1``.
        idx1: ``(N,)`` integer indices into the rows of ``in1``, in ``[0, M)`` (no negative wrap-around).

    Returns:
        ``(N, F)`` in the dtype of the inputs. The gradient of ``in1`` is a scatter-add, accumulated in
        fp32 by sorted segmented sums (bitwise reproducible); ``TUNING["scatter"] = "atomic"`` switches
        to fp32 atomics outside deterministic mode.

    Differences from Apex: bfloat16 and float64 are accepted, inputs may have padded rows, and bad
    arguments raise ``TypeError``/``ValueError`` instead of ``RuntimeError``/``AssertionError`` (index
    values are checked on CPU tensors, and on GPUs with ``culmen.ops.backend.set_check_values(True)``).
    """
    if torch.compiler.is_compiling():
        return _index_mul_2d_compiled(in1, in2, idx1)
    plan = _plan(in1, in2, idx1)
    a, b, idx = plan.prepare(in1, in2, idx1)
    if torch.is_grad_enabled() and (in1.requires_grad or in2.requires_grad):
        return _IndexMul2dFn.apply(plan, a, b, idx)
    return plan.forward(a, b, idx)


def _grad_like(name: str, t: Tensor | None, like: Tensor) -> Tensor | None:
    if t is None:
        return None
    if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
        raise ValueError(f"index_mul_2d: {name} must match {tuple(like.shape)} {like.dtype} on {like.device}, got "
                         f"{tuple(t.shape)} {t.dtype} on {t.device}")
    return t if rows_ok(t) else t.contiguous()


def index_mul_2d_backward(in1: Tensor, in2: Tensor, idx1: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor]:
    """``(grad_in1, grad_in2)`` of ``index_mul_2d(in1, in2, idx1)`` for ``grad_out`` ``(N, F)``; differentiable
    (Apex's ``index_mul_2d_backward``): its backward is the double backward."""
    plan = _plan(in1, in2, idx1)
    a, b, idx = plan.prepare(in1, in2, idx1)
    g = _grad_like("grad_out", grad_out, in2)
    return _IndexMul2dBwdFn.apply(plan, g, a, b, idx, True, True)


def index_mul_2d_backward_backward(in1: Tensor, in2: Tensor, idx1: Tensor, grad_out: Tensor,
                                   grad_grad_in1: Tensor | None, grad_grad_in2: Tensor | None
                                   ) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_grad_out, grad_in1, grad_in2)``: the double backward, not differentiable (``None`` grads are zeros)."""
    plan = _plan(in1, in2, idx1)
    a, b, idx = plan.prepare(in1, in2, idx1)
    g = _grad_like("grad_out", grad_out, in2)
    gg1 = _grad_like("grad_grad_in1", grad_grad_in1, in1)
    gg2 = _grad_like("grad_grad_in2", grad_grad_in2, in2)
    with torch.no_grad():
        return plan.backward_backward(gg1, gg2, g, a, b, idx, True, True, True)


# -------------------------------------------------------------------------- torch.compile


@torch.library.triton_op("culmen::index_mul_2d_fwd", mutates_args=())
def index_mul_2d_fwd_op(in1: Tensor, in2: Tensor, idx: Tensor) -> Tensor:
    """``in1[idx] * in2`` for ``in1`` ``(M, F)``, ``in2`` ``(N, F)`` (feature dim contiguous), a contiguous
    int32/int64 ``idx`` ``(N,)``, for ``torch.compile``."""
    return IndexMulPlan(in1, in2, idx, traced=True).forward(in1, in2, idx, traced=True)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _compiled_backward(ctx, gout):
    in1, in2, idx = ctx.saved_tensors
    plan = IndexMulPlan(in1, in2, idx, traced=True)
    gin1, gin2 = plan.backward(gout, in1, in2, idx, ctx.needs_input_grad[0], ctx.needs_input_grad[1], traced=True)
    return gin1, gin2, None


torch.library.register_autograd("culmen::index_mul_2d_fwd", _compiled_backward, setup_context=_setup_context)


def _index_mul_2d_compiled(in1: Tensor, in2: Tensor, idx1: Tensor) -> Tensor:
    """``index_mul_2d`` while ``torch.compile`` traces: the checks, the conversions as traced ops, the op."""
    check_args(in1, in2, idx1)
    idx = idx1 if idx1.dtype in (torch.int32, torch.int64) else idx1.to(torch.int64)
    a = in1 if rows_ok(in1) else in1.contiguous()
    b = in2 if rows_ok(in2) else in2.contiguous()
    return index_mul_2d_fwd_op(a, b, idx.contiguous())
