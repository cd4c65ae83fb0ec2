"""Custom ops ``culmen::layer_norm_fwd`` / ``culmen::layer_norm_bwd``, their autograd, and ``layer_norm``.

``layer_norm`` is the op-level entry point every norm API of culmen (Apex's ``normalization``,
``contrib.layer_norm``, flash_attn's ``layer_norm_fn`` ...) calls. It normalizes over the last dim.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from culmen.ops.backend import choose_backend, register_op
from culmen.ops.common.outputs import nothing
from culmen.ops.layer_norm.reference import layer_norm_bwd_ref, layer_norm_fwd_ref

register_op("layer_norm_fwd", "normalization", "dropout + rowscale + x1 + residual, then LayerNorm/RMSNorm")
register_op("layer_norm_bwd", "normalization", "backward of layer_norm_fwd (dx, dresidual, dx1, dw, db, dw1, db1)")

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fwd_impl(*args):
    """Forward on the chosen backend; absent outputs are ``None``."""
    x = args[0]
    if choose_backend(x.device) == "triton" and x.numel() > 0:
        from culmen.ops.layer_norm.launch import layer_norm_fwd

        return layer_norm_fwd(*args)
    return layer_norm_fwd_ref(*args)


def _bwd_impl(*args):
    """Backward on the chosen backend; absent outputs are ``None``."""
    dy = args[0]
    if choose_backend(dy.device) == "triton" and dy.numel() > 0:
        from culmen.ops.layer_norm.launch import layer_norm_bwd

        return layer_norm_bwd(*args)
    return layer_norm_bwd_ref(*args)


def _filled(out, like: Tensor, dtypes=None):
    """Custom ops cannot return ``None``: absent outputs become fresh empty tensors (as the fake impls)."""
    dtypes = dtypes or (like.dtype,) * len(out)
    return tuple(t if t is not None else nothing(like.device, d) for t, d in zip(out, dtypes))


@torch.library.custom_op("culmen::layer_norm_fwd", mutates_args=())
def layer_norm_fwd_op(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    x1: Tensor | None,
    weight1: Tensor | None,
    bias1: Tensor | None,
    rowscale: Tensor | None,
    seed: Tensor | None,
    eps: float,
    dropout_p: float,
    is_rms_norm: bool,
    zero_centered_weight: bool,
    residual_dtype: torch.dtype,
    out_dtype: torch.dtype,
    store_residual_out: bool,
    store_mask: bool,
    save_output: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Forward on 2-D ``(M, N)`` inputs (last dim contiguous). Returns ``(y, y1, mean, rstd,
    residual_out, mask, mask1)``; absent outputs are empty tensors. ``save_output`` only changes what
    autograd saves (Apex's ``memory_efficient``)."""
    return _filled(_fwd_impl(x, weight, bias, residual, x1, weight1, bias1, rowscale, seed, eps, dropout_p,
                             is_rms_norm, zero_centered_weight, residual_dtype, out_dtype, store_residual_out,
                             store_mask), x,
                   (x.dtype, x.dtype, torch.float32, torch.float32, x.dtype, torch.bool, torch.bool))


@layer_norm_fwd_op.register_fake
def _(x, weight, bias, residual, x1, weight1, bias1, rowscale, seed, eps, dropout_p, is_rms_norm,
      zero_centered_weight, residual_dtype, out_dtype, store_residual_out, store_mask, save_output):
    M, N = x.shape
    f32 = torch.float32
    y = x.new_empty((M, N), dtype=out_dtype)
    y1 = x.new_empty((M, N), dtype=out_dtype) if weight1 is not None else nothing(x.device, x.dtype)
    mean = x.new_empty((M,), dtype=f32) if not is_rms_norm else nothing(x.device, f32)
    rstd = x.new_empty((M,), dtype=f32)
    res = x.new_empty((M, N), dtype=residual_dtype) if store_residual_out else nothing(x.device, x.dtype)
    mask = x.new_empty((M, N), dtype=torch.bool) if store_mask else nothing(x.device, torch.bool)
    mask1 = x.new_empty((M, N), dtype=torch.bool) if (store_mask and x1 is not None) else nothing(x.device, torch.bool)
    return y, y1, mean, rstd, res, mask, mask1


@torch.library.custom_op("culmen::layer_norm_bwd", mutates_args=())
def layer_norm_bwd_op(
    dy: Tensor,
    dy1: Tensor | None,
    dres_out: Tensor | None,
    xs: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    weight1: Tensor | None,
    bias1: Tensor | None,
    rowscale: Tensor | None,
    seed: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    eps: float,
    dropout_p: float,
    is_rms_norm: bool,
    zero_centered_weight: bool,
    recompute_from_y: bool,
    has_residual: bool,
    has_x1: bool,
    x_dtype: torch.dtype,
    x1_dtype: torch.dtype,
    residual_dtype: torch.dtype,
    store_dres: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward on 2-D inputs. ``xs`` is the saved pre-norm sum (or ``y`` when ``recompute_from_y``).
    Returns ``(dx, dw, db, dw1, db1, dresidual, dx1)``; absent outputs are empty tensors."""
    # The forward op returns an empty placeholder for RMSNorm's mean; the implementations take None.
    mean = None if is_rms_norm else mean
    out = _bwd_impl(dy, dy1, dres_out, xs, weight, bias, weight1, bias1, rowscale, seed, mean, rstd, eps, dropout_p,
                    is_rms_norm, zero_centered_weight, recompute_from_y, has_residual, has_x1, x_dtype, x1_dtype,
                    residual_dtype, store_dres)
    # The parameter grads are rows of one reduced buffer; custom-op outputs may not alias each other.
    out = tuple(t.clone() if t is not None and t._base is not None else t for t in out)
    return _filled(out, dy)


@layer_norm_bwd_op.register_fake
def _(dy, dy1, dres_out, xs, weight, bias, weight1, bias1, rowscale, seed, mean, rstd, eps, dropout_p,
      is_rms_norm, zero_centered_weight, recompute_from_y, has_residual, has_x1, x_dtype, x1_dtype, residual_dtype,
      store_dres):
    M, N = dy.shape

    def like(t):
        return torch.empty_like(t) if t is not None else nothing(dy.device, dy.dtype)

    dx = dy.new_empty((M, N), dtype=x_dtype)
    dres = dy.new_empty((M, N), dtype=residual_dtype) if store_dres else nothing(dy.device, dy.dtype)
    dx1 = dy.new_empty((M, N), dtype=x1_dtype) if has_x1 else nothing(dy.device, dy.dtype)
    return dx, like(weight), like(bias), like(weight1), like(bias1), dres, dx1


_FWD_ARGS = ("x", "weight", "bias", "residual", "x1", "weight1", "bias1", "rowscale", "seed", "eps", "dropout_p",
             "is_rms_norm", "zero_centered_weight", "residual_dtype", "out_dtype", "store_residual_out",
             "store_mask", "save_output")


def _setup_context(ctx, inputs, output):
    a = dict(zip(_FWD_ARGS, inputs))
    y, y1, mean, rstd, res_out, _, _ = output
    x = a["x"]
    if a["save_output"]:
        xs = y
    elif a["store_residual_out"]:
        xs = res_out
    else:
        xs = x
    ctx.save_for_backward(xs, a["weight"], a["bias"], a["weight1"], a["bias1"], a["rowscale"], a["seed"], mean,
                          rstd)
    ctx.eps = a["eps"]
    ctx.dropout_p = a["dropout_p"]
    ctx.is_rms_norm = a["is_rms_norm"]
    ctx.zero_centered_weight = a["zero_centered_weight"]
    ctx.recompute_from_y = a["save_output"]
    ctx.has_residual = a["residual"] is not None
    ctx.has_x1 = a["x1"] is not None
    ctx.x_dtype = x.dtype
    ctx.x1_dtype = a["x1"].dtype if a["x1"] is not None else x.dtype
    ctx.residual_dtype = a["residual"].dtype if a["residual"] is not None else x.dtype
    # dresidual equals dx unless dropout / rowscale / x1 sit between them or the dtypes differ.
    ctx.store_dres = ctx.has_residual and (
        a["dropout_p"] > 0.0 or a["rowscale"] is not None or ctx.has_x1 or ctx.residual_dtype != x.dtype
    )
    ctx.has_weight1 = a["weight1"] is not None
    ctx.store_residual_out = a["store_residual_out"]
    ctx.out_dtype = a["out_dtype"]


def _backward(ctx, dy, dy1, dmean, drstd, dres_out, dmask, dmask1, bwd=None):
    xs, weight, bias, weight1, bias1, rowscale, seed, mean, rstd = ctx.saved_tensors
    dy = dy.contiguous() if dy is not None else torch.zeros_like(xs, dtype=ctx.out_dtype)
    dy1 = dy1.contiguous() if (ctx.has_weight1 and dy1 is not None) else (
        torch.zeros_like(dy) if ctx.has_weight1 else None)
    dres_out = dres_out.contiguous() if (ctx.store_residual_out and dres_out is not None) else None
    dx, dw, db, dw1, db1, dres, dx1 = (bwd or layer_norm_bwd_op)(
        dy, dy1, dres_out, xs, weight, bias, weight1, bias1, rowscale, seed, mean, rstd, ctx.eps, ctx.dropout_p,
        ctx.is_rms_norm, ctx.zero_centered_weight, ctx.recompute_from_y, ctx.has_residual, ctx.has_x1, ctx.x_dtype,
        ctx.x1_dtype, ctx.residual_dtype, ctx.store_dres)
    dresidual = (dres if ctx.store_dres else dx) if ctx.has_residual else None
    return (dx, dw if weight is not None else None, db if bias is not None else None, dresidual,
            dx1 if ctx.has_x1 else None, dw1 if weight1 is not None else None, db1 if bias1 is not None else None,
            None, None, None, None, None, None, None, None, None, None, None)


torch.library.register_autograd("culmen::layer_norm_fwd", _backward, setup_context=_setup_context)


class _LayerNormFn(torch.autograd.Function):
    """Eager path: the same implementation and backward as the custom ops, without the Python cost of
    ``torch.library`` dispatch (several hundred microseconds per call on a slow host, more than the
    kernels themselves). ``torch.compile`` traces the custom ops instead (see ``layer_norm``)."""

    @staticmethod
    def forward(ctx, *inputs):
        out = _fwd_impl(*inputs[:-1])
        _setup_context(ctx, inputs, out)
        ctx.mark_non_differentiable(*(t for t in (out[2], out[3], out[5], out[6]) if t is not None))
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, *grads):
        return _backward(ctx, *grads, bwd=_bwd_impl)


class LayerNormOutput(NamedTuple):
    """Outputs of ``layer_norm``; fields that were not asked for are ``None``."""

    y: Tensor
    y1: Tensor | None
    residual_out: Tensor | None
    dropout_mask: Tensor | None
    dropout_mask1: Tensor | None


def _check_float(name: str, t: Tensor | None) -> None:
    if t is not None and t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be a floating-point tensor (float16/bfloat16/float32/float64), got {t.dtype}")


def _as_rows(name: str, t: Tensor | None, shape: torch.Size, N: int) -> Tensor | None:
    if t is None:
        return None
    if t.shape != shape:
        raise ValueError(f"{name} must have the shape of x {tuple(shape)}, got {tuple(t.shape)}")
    t2 = t.reshape(-1, N) if N else t.reshape(-1, 0)
    return t2 if (t2.stride(-1) == 1 or N <= 1) else t2.contiguous()


def _as_vec(name: str, t: Tensor | None, N: int) -> Tensor | None:
    if t is None:
        return None
    if t.numel() != N:
        raise ValueError(f"{name} must have {N} elements (the normalized size), got shape {tuple(t.shape)}")
    return t.reshape(N).contiguous()


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

    Statistics are fp32; returns a ``LayerNormOutput``.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("residual", residual), ("x1", x1),
                    ("weight1", weight1), ("bias1", bias1), ("rowscale", rowscale)):
        _check_float(name, t)
    if not (0.0 <= float(dropout_p) < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if float(eps) < 0.0:
        raise ValueError(f"eps must be non-negative, got {eps}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    if memory_efficient and weight1 is not None:
        raise ValueError("memory_efficient=True does not support weight1/bias1")
    if (weight1 is None) and (bias1 is not None):
        raise ValueError("bias1 needs weight1")
    shape = x.shape
    N = shape[-1]
    x2 = _as_rows("x", x, shape, N)
    res2 = _as_rows("residual", residual, shape, N)
    x12 = _as_rows("x1", x1, shape, N)
    w, b, w1, b1 = (_as_vec(n, t, N) for n, t in (("weight", weight), ("bias", bias), ("weight1", weight1),
                                                   ("bias1", bias1)))
    M = x2.shape[0]
    rs = None
    if rowscale is not None:
        if rowscale.numel() != M:
            raise ValueError(f"rowscale must have x.shape[:-1] = {tuple(shape[:-1])} elements, got "
                             f"{tuple(rowscale.shape)}")
        rs = rowscale.reshape(M).contiguous()
    residual_dtype = residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else x.dtype)
    out_dtype = out_dtype or x.dtype
    store_residual_out = (residual is not None or residual_dtype != x.dtype or dropout_p > 0.0
                          or rs is not None or x1 is not None)
    seed = None
    if dropout_p > 0.0:
        seed = torch.randint(0, 2**62, (1,), device=x.device, dtype=torch.int64)
    store_mask = bool(return_dropout_mask and dropout_p > 0.0)
    fn = layer_norm_fwd_op if torch.compiler.is_compiling() else _LayerNormFn.apply
    y, y1, _, _, res_out, mask, mask1 = fn(
        x2, w, b, res2, x12, w1, b1, rs, seed, float(eps), float(dropout_p), bool(is_rms_norm),
        bool(zero_centered_weight), residual_dtype, out_dtype, store_residual_out, store_mask,
        bool(memory_efficient))
    y = y.reshape(shape)
    y1 = y1.reshape(shape) if weight1 is not None else None
    residual_out = None
    if return_residual:
        residual_out = res_out.reshape(shape) if store_residual_out else x
    m = mask.reshape(shape) if store_mask else None
    m1 = mask1.reshape(shape) if (store_mask and x1 is not None) else None
    return LayerNormOutput(y, y1, residual_out, m, m1)
