"""``layer_norm``, the op-level entry point every norm API of culmen calls (Apex's ``normalization``,
``contrib.layer_norm``, flash_attn's ``layer_norm_fn`` ...), its eager autograd, and the
``torch.library`` ops ``culmen::layer_norm_fwd`` / ``culmen::layer_norm_bwd`` that ``torch.compile``
traces. It normalizes over the last dim.

The call path (DESIGN.md): an eager call builds a key from its signature and looks up a cached
``NormPlan`` (validation ran when the plan was built); with autograd recording it goes through
``_LayerNormFn`` (a plain ``autograd.Function``), otherwise straight to the plan's forward. Under
``torch.compile`` a call without dropout traces the plain-PyTorch formula of ``export.py`` (fp32 statistics
and affine step, as the kernels), which Inductor fuses with the surrounding ops, unless
``culmen.set_compile_fusion(False)``; with dropout, or with the switch off, the ops are ``triton_op``s whose
bodies launch through ``wrap_triton``, so Inductor launches the kernels itself.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from culmen.ops.backend import compile_fusion_enabled, register_op
from culmen.ops.common.function import raw_apply
from culmen.ops.common.launch import traceable_kernels
from culmen.ops.layer_norm.export import ONNX_TS, layer_norm_export
from culmen.ops.layer_norm.launch import PLANS, NormPlan
from culmen.ops.layer_norm.reference import layer_norm_bwd_ref, layer_norm_fwd_ref

register_op("layer_norm_fwd", "normalization", "dropout + rowscale + x1 + residual, then LayerNorm/RMSNorm")
register_op("layer_norm_bwd", "normalization", "backward of layer_norm_fwd (dx, dresidual, dx1, dw, db, dw1, db1)")

_F32 = torch.float32


class LayerNormOutput(NamedTuple):
    """Outputs of ``layer_norm``; fields that were not asked for are ``None``."""

    y: Tensor
    y1: Tensor | None
    residual_out: Tensor | None
    dropout_mask: Tensor | None
    dropout_mask1: Tensor | None


# ------------------------------------------------------------------------------ reference path


def _forward_ref(plan: NormPlan, x, weight, bias, residual, x1, weight1, bias1, rowscale, seed, store_stats):
    """The plan's forward on the PyTorch reference (CPU, fp64, ``CULMEN_BACKEND=reference``)."""
    M, N, shape = plan.M, plan.N, plan.shape

    def rows(t):
        return None if t is None else t.reshape(M, N)

    rs = None if rowscale is None else rowscale.reshape(M)
    w, b, w1, b1 = (None if t is None else t.reshape(N) for t in (weight, bias, weight1, bias1))
    y, y1, mean, rstd, res_out, mask, mask1 = layer_norm_fwd_ref(
        rows(x), w, b, rows(residual), rows(x1), w1, b1, rs, seed, plan.eps, plan.dropout_p, plan.is_rms,
        plan.zero_centered, plan.residual_dtype, plan.out_dtype, plan.store_res, plan.store_mask)
    stats = (rstd if plan.is_rms else torch.stack((mean, rstd))) if store_stats else None

    def back(t):
        return None if t is None else t.reshape(shape)

    y, y1, res_out, mask, mask1 = (back(t) for t in (y, y1, res_out, mask, mask1))
    xs = y if plan.memory_efficient else (res_out if plan.store_res else x)
    return y, y1, stats, res_out, mask, mask1, xs


def _backward_ref(plan: NormPlan, dy, dy1, dres_out, xs, weight, bias, weight1, bias1, rowscale, seed, stats):
    M, N, shape = plan.M, plan.N, plan.shape

    def rows(t):
        return None if t is None else t.reshape(M, N)

    mean, rstd = (None, stats) if plan.is_rms else (stats[0], stats[1])
    rs = None if rowscale is None else rowscale.reshape(M)
    w, b, w1, b1 = (None if t is None else t.reshape(N) for t in (weight, bias, weight1, bias1))
    dx, dw, db, dw1, db1, dres, dx1 = layer_norm_bwd_ref(
        rows(dy), rows(dy1), rows(dres_out), rows(xs), w, b, w1, b1, rs, seed, mean, rstd, plan.eps, plan.dropout_p,
        plan.is_rms, plan.zero_centered, plan.memory_efficient, plan.has[2], plan.has[3], plan.x_dtype,
        plan.x1_dtype, plan.residual_dtype, plan.store_dres)

    def back(t):
        return None if t is None else t.reshape(shape)

    def vec(t, like):
        return None if t is None else t.reshape(like.shape)

    dres = back(dres if plan.store_dres else dx) if plan.has[2] else None
    return (back(dx), vec(dw, weight), vec(db, bias), dres, back(dx1), vec(dw1, weight1), vec(db1, bias1))


def _forward(plan, x, weight, bias, residual, x1, weight1, bias1, rowscale, seed, store_stats):
    if plan.use_kernel:
        return plan.forward(x, weight, bias, residual, x1, weight1, bias1, rowscale, seed, store_stats)
    return _forward_ref(plan, x, weight, bias, residual, x1, weight1, bias1, rowscale, seed, store_stats)


def _grad_rows(g: Tensor | None) -> Tensor | None:
    """An incoming gradient in the row layout of the output it belongs to (our outputs are contiguous)."""
    if g is None or g.is_contiguous():
        return g
    return g.contiguous()


# ------------------------------------------------------------------------------------- eager


class _LayerNormFn(torch.autograd.Function):
    """Eager autograd: the plan's kernels called directly (no ``torch.library`` dispatch). Few, positional
    arguments: ``apply`` costs host time per argument."""

    @staticmethod
    def forward(ctx, plan, seed, x, weight, bias, residual, x1, weight1, bias1, rowscale):
        y, y1, stats, res_out, mask, mask1, xs = _forward(plan, x, weight, bias, residual, x1, weight1, bias1,
                                                          rowscale, seed, True)
        ctx.plan = plan
        ctx.save_for_backward(xs, weight, bias, weight1, bias1, rowscale, seed, stats)
        if mask is not None:
            ctx.mark_non_differentiable(*(m for m in (mask, mask1) if m is not None))
        ctx.set_materialize_grads(False)
        return y, y1, res_out, mask, mask1

    @staticmethod
    def backward(ctx, dy, dy1, dres_out, _dmask, _dmask1):
        plan = ctx.plan
        xs, weight, bias, weight1, bias1, rowscale, seed, stats = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros(plan.shape, dtype=plan.out_dtype, device=plan.device)
        if plan.has[4] and dy1 is None:
            dy1 = torch.zeros_like(dy)
        if not (plan.store_res and plan.return_residual):
            dres_out = None
        dy, dy1, dres_out = _grad_rows(dy), _grad_rows(dy1), _grad_rows(dres_out)
        if plan.use_kernel:
            g = plan.backward(dy, dy1, dres_out, xs, weight, bias, weight1, bias1, rowscale, seed, stats)
        else:
            g = _backward_ref(plan, dy, dy1, dres_out, xs, weight, bias, weight1, bias1, rowscale, seed, stats)
        return (None, None, *g, None)


_apply = raw_apply(_LayerNormFn)


def layer_norm(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    residual: Tensor | None = None,
    x1: Tensor | None = None,
    weight1: Tensor | None = None,
    bias1: Tensor | None = None,
    eps: float = 1e-5,
    dropout_p: float = 0.0,
    rowscale: Tensor | None = None,
    is_rms_norm: bool = False,
    zero_centered_weight: bool = False,
    residual_in_fp32: bool = False,
    out_dtype: torch.dtype | None = None,
    return_residual: bool = False,
    return_dropout_mask: bool = False,
    memory_efficient: bool = False,
) -> LayerNormOutput:
    """Fused ``norm(dropout(x * rowscale) + dropout(x1) + residual)`` over the last dim, differentiable.

    Args:
        x: ``(..., N)`` fp16/bf16/fp32/fp64.
        weight, bias, weight1, bias1: ``(N,)`` (any float dtype) or ``None``. ``weight1``/``bias1``
            give a second output ``y1`` from the same normalized values (parallel blocks).
        residual, x1: like ``x`` or ``None``. ``rowscale``: ``x.shape[:-1]``, scales ``x`` only.
        dropout_p: in ``[0, 1)``; applied to ``x`` and ``x1`` with independent Philox masks.
        is_rms_norm: RMSNorm (no mean subtraction) instead of LayerNorm.
        zero_centered_weight: use ``1 + weight`` (Gemma-style).
        residual_in_fp32: the pre-norm sum is kept in fp32 when there is no ``residual``.
        out_dtype: dtype of ``y``/``y1`` (default ``x.dtype``).
        return_residual: also return the pre-norm sum (``prenorm``), in the residual dtype.
        return_dropout_mask: also return the bool keep-masks (``None`` when ``dropout_p == 0``).
        memory_efficient: save ``y`` instead of the input for backward (needs no ``weight1``).

    Statistics are fp32; returns a ``LayerNormOutput``. Any layout of ``x`` works; outputs are contiguous.
    """
    if torch.compiler.is_compiling():
        # torch.onnx.export(dynamo=True), and torch.compile with the fusion switch on (no dropout: its masks
        # come from culmen's Philox streams): plain ops (export.py), which Inductor fuses with their neighbours
        if torch.onnx.is_in_onnx_export() or (compile_fusion_enabled() and dropout_p == 0.0):
            return LayerNormOutput(*layer_norm_export(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p,
                                                      rowscale, is_rms_norm, zero_centered_weight, residual_in_fp32,
                                                      out_dtype, return_residual, return_dropout_mask))
        return _layer_norm_compiled(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale,
                                    is_rms_norm, zero_centered_weight, residual_in_fp32, out_dtype, return_residual,
                                    return_dropout_mask, memory_efficient)
    if ONNX_TS.in_onnx_export:  # torch.onnx.export(dynamo=False) traces this path: plain ops (export.py)
        return LayerNormOutput(*layer_norm_export(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p,
                                                  rowscale, is_rms_norm, zero_centered_weight, residual_in_fp32,
                                                  out_dtype, return_residual, return_dropout_mask))
    try:
        key = (x.shape, x.stride(), x.dtype, x.device,
               None if weight is None else (weight.shape, weight.stride(), weight.dtype, weight.device),
               None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
               None if residual is None else (residual.shape, residual.stride(), residual.dtype, residual.device),
               None if x1 is None else (x1.shape, x1.stride(), x1.dtype, x1.device),
               None if weight1 is None else (weight1.shape, weight1.stride(), weight1.dtype, weight1.device),
               None if bias1 is None else (bias1.shape, bias1.stride(), bias1.dtype, bias1.device),
               None if rowscale is None else (rowscale.shape, rowscale.stride(), rowscale.dtype, rowscale.device),
               eps, dropout_p, is_rms_norm, zero_centered_weight, residual_in_fp32, out_dtype, return_residual,
               return_dropout_mask, memory_efficient)
        plan = PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors / unhashable scalars: the plan reports it
        key, plan = None, None
    if plan is None:
        plan = NormPlan(x, weight, bias, residual, x1, weight1, bias1, rowscale, eps, dropout_p, is_rms_norm,
                        zero_centered_weight, residual_in_fp32, out_dtype, return_residual, return_dropout_mask,
                        memory_efficient)
        if key is not None:
            PLANS.put(key, plan)
    seed = torch.randint(0, 2**62, (1,), device=plan.device, dtype=torch.int64) if plan.has_dropout else None
    if torch.is_grad_enabled() and (
            x.requires_grad or (weight is not None and weight.requires_grad)
            or (bias is not None and bias.requires_grad) or (residual is not None and residual.requires_grad)
            or (x1 is not None and x1.requires_grad) or (weight1 is not None and weight1.requires_grad)
            or (bias1 is not None and bias1.requires_grad)):
        y, y1, res_out, mask, mask1 = _apply(plan, seed, x, weight, bias, residual, x1, weight1, bias1,
                                                         rowscale)
    else:
        y, y1, _, res_out, mask, mask1, _ = _forward(plan, x, weight, bias, residual, x1, weight1, bias1, rowscale,
                                                     seed, False)
    residual_out = (res_out if plan.store_res else x) if plan.return_residual else None
    return LayerNormOutput(y, y1, residual_out, mask, mask1)


# -------------------------------------------------------------------------- torch.compile


def _empty(t: Tensor | None, like: Tensor, dtype: torch.dtype) -> Tensor:
    """Custom ops cannot return ``None``: an absent output is a fresh empty tensor."""
    return t if t is not None else like.new_empty((0,), dtype=dtype)


def _plan_from(x, weight, bias, residual, x1, weight1, bias1, rowscale, eps, dropout_p, is_rms_norm,
               zero_centered_weight, residual_in_fp32, out_dtype, return_residual, store_mask, memory_efficient):
    """An uncached plan for traced code (sizes may be symbolic). Triton's CPU interpreter cannot be
    traced, so there the compiled graph takes the (traceable) reference path."""
    plan = NormPlan(x, weight, bias, residual, x1, weight1, bias1, rowscale, eps, dropout_p, is_rms_norm,
                    zero_centered_weight, residual_in_fp32, out_dtype, return_residual, store_mask,
                    memory_efficient)
    plan.use_kernel = plan.use_kernel and traceable_kernels()
    return plan


@torch.library.triton_op("culmen::layer_norm_fwd", mutates_args=())
def layer_norm_fwd_op(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None, x1: Tensor | None,
    weight1: Tensor | None, bias1: Tensor | None, rowscale: Tensor | None, seed: Tensor | None, eps: float,
    dropout_p: float, is_rms_norm: bool, zero_centered_weight: bool, residual_in_fp32: bool,
    out_dtype: torch.dtype, return_residual: bool, store_mask: bool, memory_efficient: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Forward of ``layer_norm`` for ``torch.compile``: ``(y, y1, stats, residual_out, mask, mask1)``,
    absent outputs as empty tensors (custom ops cannot return ``None``)."""
    plan = _plan_from(x, weight, bias, residual, x1, weight1, bias1, rowscale, eps, dropout_p, is_rms_norm,
                      zero_centered_weight, residual_in_fp32, out_dtype, return_residual, store_mask,
                      memory_efficient)
    if plan.use_kernel:
        y, y1, stats, res, mask, mask1, _ = plan.forward(x, weight, bias, residual, x1, weight1, bias1, rowscale,
                                                         seed, True, traced=True)
    else:
        y, y1, stats, res, mask, mask1, _ = _forward_ref(plan, x, weight, bias, residual, x1, weight1, bias1,
                                                         rowscale, seed, True)
    return (y, _empty(y1, x, plan.out_dtype), _empty(stats, x, _F32), _empty(res, x, plan.residual_dtype),
            _empty(mask, x, torch.bool), _empty(mask1, x, torch.bool))




def _setup_context(ctx, inputs, output):
    # Runs while torch.compile traces (never in eager calls): the plan rides on ctx to the backward,
    # which launches the kernels itself through wrap_triton (no custom op needed there).
    plan = _plan_from(*inputs[:8], *inputs[9:])
    y, _, stats, res, _, _ = output
    x = inputs[0]
    xs = y if plan.memory_efficient else (res if plan.store_res else x)
    ctx.plan = plan
    ctx.save_for_backward(xs, inputs[1], inputs[2], inputs[5], inputs[6], inputs[7], inputs[8], stats)


def _compiled_backward(ctx, dy, dy1, dstats, dres_out, dmask, dmask1):
    plan = ctx.plan
    xs, weight, bias, weight1, bias1, rowscale, seed, stats = ctx.saved_tensors
    dy = dy.contiguous()
    dy1 = dy1.contiguous() if plan.has[4] else None
    dres_out = dres_out.contiguous() if (plan.store_res and plan.return_residual) else None
    if plan.use_kernel:
        g = plan.backward(dy, dy1, dres_out, xs, weight, bias, weight1, bias1, rowscale, seed, stats, traced=True)
    else:
        g = _backward_ref(plan, dy, dy1, dres_out, xs, weight, bias, weight1, bias1, rowscale, seed, stats)
    return (*g, None, None, None, None, None, None, None, None, None, None, None)


torch.library.register_autograd("culmen::layer_norm_fwd", _compiled_backward, setup_context=_setup_context)


def _layer_norm_compiled(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, is_rms_norm,
                         zero_centered_weight, residual_in_fp32, out_dtype, return_residual, return_dropout_mask,
                         memory_efficient) -> LayerNormOutput:
    """``layer_norm`` while ``torch.compile`` traces: the ``triton_op``s, no plan cache."""
    store_mask = bool(return_dropout_mask and dropout_p > 0.0)
    seed = torch.randint(0, 2**62, (1,), device=x.device, dtype=torch.int64) if dropout_p > 0.0 else None
    residual_dtype = residual.dtype if residual is not None else (_F32 if residual_in_fp32 else x.dtype)
    out_dtype = out_dtype or x.dtype
    y, y1, _, res, mask, mask1 = layer_norm_fwd_op(
        x, weight, bias, residual, x1, weight1, bias1, rowscale, seed, float(eps), float(dropout_p),
        bool(is_rms_norm), bool(zero_centered_weight), bool(residual_in_fp32), out_dtype, bool(return_residual),
        store_mask, bool(memory_efficient))
    store_res = (residual is not None or residual_dtype != x.dtype or dropout_p > 0.0 or rowscale is not None
                 or x1 is not None)
    residual_out = (res if store_res else x) if return_residual else None
    return LayerNormOutput(y, y1 if weight1 is not None else None, residual_out, mask if store_mask else None,
                           mask1 if (store_mask and x1 is not None) else None)
