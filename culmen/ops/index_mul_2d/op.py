"""Custom ops ``culmen::index_mul_2d_fwd`` / ``_bwd`` / ``_bwd_bwd``, their autograd, and ``index_mul_2d``.

``index_mul_2d`` is the op-level entry point of ``culmen.contrib.index_mul_2d``. The backward is
itself differentiable (double backward, as in Apex); the double backward is not.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import choose_backend, deterministic_enabled, register_op
from culmen.ops.common.checks import check_values_enabled
from culmen.ops.common.outputs import nothing
from culmen.ops.index_mul_2d.reference import index_mul_2d_bwd_bwd_ref, index_mul_2d_bwd_ref, index_mul_2d_fwd_ref

register_op("index_mul_2d_fwd", "indexing", "out = in1[idx] * in2 over rows")
register_op("index_mul_2d_bwd", "indexing", "backward of index_mul_2d (scatter-add for in1, atomic or sorted)")
register_op("index_mul_2d_bwd_bwd", "indexing", "double backward of index_mul_2d")

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _triton(t: Tensor) -> bool:
    return choose_backend(t.device) == "triton"


def _fwd_impl(in1, in2, idx):
    if _triton(in2):
        from culmen.ops.index_mul_2d.launch import index_mul_2d_fwd

        return index_mul_2d_fwd(in1, in2, idx)
    return index_mul_2d_fwd_ref(in1, in2, idx)


def _bwd_impl(gout, in1, in2, idx, need_gin1, need_gin2, deterministic):
    if _triton(in2):
        from culmen.ops.index_mul_2d.launch import index_mul_2d_bwd

        return index_mul_2d_bwd(gout, in1, in2, idx, need_gin1, need_gin2, deterministic)
    return index_mul_2d_bwd_ref(gout, in1, in2, idx, need_gin1, need_gin2)


def _bwd_bwd_impl(gg1, gg2, gout, in1, in2, idx, need_ggout, need_gin1, need_gin2, deterministic):
    if _triton(in2):
        from culmen.ops.index_mul_2d.launch import index_mul_2d_bwd_bwd

        return index_mul_2d_bwd_bwd(gg1, gg2, gout, in1, in2, idx, need_ggout, need_gin1, need_gin2, deterministic)
    return index_mul_2d_bwd_bwd_ref(gg1, gg2, gout, in1, in2, idx, need_ggout, need_gin1, need_gin2)


def _fill(t: Tensor | None, like: Tensor) -> Tensor:
    return t if t is not None else nothing(like.device, like.dtype)


def _opt(t: Tensor | None) -> Tensor | None:
    """Custom ops return empty tensors for absent outputs; autograd wants ``None``."""
    return None if t is None or (t.numel() == 0 and t.dim() == 1 and t.shape[0] == 0) else t


@torch.library.custom_op("culmen::index_mul_2d_fwd", mutates_args=())
def index_mul_2d_fwd_op(in1: Tensor, in2: Tensor, idx: Tensor) -> Tensor:
    """``in1[idx] * in2`` for ``in1`` ``(M, F)``, ``in2`` ``(N, F)`` (feature dim contiguous), ``idx`` ``(N,)``."""
    return _fwd_impl(in1, in2, idx)


@index_mul_2d_fwd_op.register_fake
def _(in1, in2, idx):
    return in2.new_empty(in2.shape)


@torch.library.custom_op("culmen::index_mul_2d_bwd", mutates_args=())
def index_mul_2d_bwd_op(gout: Tensor, in1: Tensor, in2: Tensor, idx: Tensor, need_gin1: bool, need_gin2: bool,
                        deterministic: bool) -> tuple[Tensor, Tensor]:
    """``(gin1, gin2)`` for ``gout`` ``(N, F)``; an output not needed is an empty tensor."""
    gin1, gin2 = _bwd_impl(gout, in1, in2, idx, need_gin1, need_gin2, deterministic)
    return _fill(gin1, in1), _fill(gin2, in2)


@index_mul_2d_bwd_op.register_fake
def _(gout, in1, in2, idx, need_gin1, need_gin2, deterministic):
    gin1 = in1.new_empty(in1.shape) if need_gin1 else nothing(in1.device, in1.dtype)
    gin2 = in2.new_empty(in2.shape) if need_gin2 else nothing(in2.device, in2.dtype)
    return gin1, gin2


@torch.library.custom_op("culmen::index_mul_2d_bwd_bwd", mutates_args=())
def index_mul_2d_bwd_bwd_op(gg1: Tensor | None, gg2: Tensor | None, gout: Tensor, in1: Tensor, in2: Tensor,
                            idx: Tensor, need_ggout: bool, need_gin1: bool, need_gin2: bool, deterministic: bool
                            ) -> tuple[Tensor, Tensor, Tensor]:
    """``(ggout, gin1, gin2)``: the double backward given the grads ``gg1``/``gg2`` of ``(gin1, gin2)``."""
    ggout, gin1, gin2 = _bwd_bwd_impl(gg1, gg2, gout, in1, in2, idx, need_ggout, need_gin1, need_gin2,
                                      deterministic)
    return _fill(ggout, gout), _fill(gin1, in1), _fill(gin2, in2)


@index_mul_2d_bwd_bwd_op.register_fake
def _(gg1, gg2, gout, in1, in2, idx, need_ggout, need_gin1, need_gin2, deterministic):
    ggout = gout.new_empty(gout.shape) if need_ggout else nothing(gout.device, gout.dtype)
    gin1 = in1.new_empty(in1.shape) if need_gin1 else nothing(in1.device, in1.dtype)
    gin2 = in2.new_empty(in2.shape) if need_gin2 else nothing(in2.device, in2.dtype)
    return ggout, gin1, gin2


def _deterministic() -> bool:
    return deterministic_enabled()


# ---- autograd of the custom ops (the torch.compile path) -------------------------------------


def _fwd_setup(ctx, inputs, output):
    in1, in2, idx = inputs
    ctx.save_for_backward(in1, in2, idx)


def _fwd_backward(ctx, gout):
    in1, in2, idx = ctx.saved_tensors
    gin1, gin2 = index_mul_2d_bwd_op(gout.contiguous(), in1, in2, idx, ctx.needs_input_grad[0],
                                     ctx.needs_input_grad[1], _deterministic())
    return _opt(gin1), _opt(gin2), None


def _bwd_setup(ctx, inputs, output):
    gout, in1, in2, idx, _, _, _ = inputs
    ctx.save_for_backward(gout, in1, in2, idx)


def _bwd_backward(ctx, gg1, gg2):
    gout, in1, in2, idx = ctx.saved_tensors
    need = ctx.needs_input_grad
    ggout, gin1, gin2 = index_mul_2d_bwd_bwd_op(
        _opt(gg1).contiguous() if _opt(gg1) is not None else None,
        _opt(gg2).contiguous() if _opt(gg2) is not None else None,
        gout, in1, in2, idx, need[0], need[1], need[2], _deterministic())
    return _opt(ggout), _opt(gin1), _opt(gin2), None, None, None, None


torch.library.register_autograd("culmen::index_mul_2d_fwd", _fwd_backward, setup_context=_fwd_setup)
torch.library.register_autograd("culmen::index_mul_2d_bwd", _bwd_backward, setup_context=_bwd_setup)


# ---- the eager path: the same implementations without torch.library dispatch overhead ---------


class _IndexMul2dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, in1, in2, idx):
        ctx.save_for_backward(in1, in2, idx)
        return _fwd_impl(in1, in2, idx)

    @staticmethod
    def backward(ctx, gout):
        in1, in2, idx = ctx.saved_tensors
        gin1, gin2 = _IndexMul2dBwdFn.apply(gout.contiguous(), in1, in2, idx, ctx.needs_input_grad[0],
                                            ctx.needs_input_grad[1])
        return _opt(gin1), _opt(gin2), None


class _IndexMul2dBwdFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gout, in1, in2, idx, need_gin1, need_gin2):
        ctx.save_for_backward(gout, in1, in2, idx)
        ctx.set_materialize_grads(False)
        gin1, gin2 = _bwd_impl(gout, in1, in2, idx, need_gin1, need_gin2, _deterministic())
        return _fill(gin1, in1), _fill(gin2, in2)

    @staticmethod
    def backward(ctx, gg1, gg2):
        gout, in1, in2, idx = ctx.saved_tensors
        gg1, gg2 = _opt(gg1), _opt(gg2)
        need = ctx.needs_input_grad
        if not (need[0] or need[1] or need[2]):
            return None, None, None, None, None, None
        ggout, gin1, gin2 = _bwd_bwd_impl(gg1.contiguous() if gg1 is not None else None,
                                          gg2.contiguous() if gg2 is not None else None, gout, in1, in2, idx,
                                          need[0], need[1], need[2], _deterministic())
        return ggout, gin1, gin2, None, None, None


def _rows_contiguous(t: Tensor) -> Tensor:
    """``t`` itself when its feature dim is contiguous (any row stride), else a contiguous copy."""
    return t if (t.stride(1) == 1 or t.shape[1] <= 1) and t.stride(0) >= 0 else t.contiguous()


def _prepare(in1: Tensor, in2: Tensor, idx1: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Validate the arguments of ``index_mul_2d``; return ``(in1, in2, idx)`` ready for the kernels."""
    for name, t in (("in1", in1), ("in2", in2)):
        if not isinstance(t, Tensor) or t.dtype not in _FLOATS:
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(f"index_mul_2d: {name} must be a float16/bfloat16/float32/float64 tensor, got {got}")
    if in1.dtype != in2.dtype:
        raise TypeError(f"index_mul_2d: in1 and in2 must share a dtype, got {in1.dtype} and {in2.dtype}")
    if not isinstance(idx1, Tensor) or idx1.dtype.is_floating_point or idx1.dtype.is_complex or \
            idx1.dtype == torch.bool:
        got = idx1.dtype if isinstance(idx1, Tensor) else type(idx1).__name__
        raise TypeError(f"index_mul_2d: idx1 must be an integer tensor, got {got}")
    if in1.dim() != 2 or in2.dim() != 2:
        raise ValueError(f"index_mul_2d: in1 and in2 must be 2-D, got shapes {tuple(in1.shape)} and "
                         f"{tuple(in2.shape)}")
    if idx1.dim() != 1:
        raise ValueError(f"index_mul_2d: idx1 must be 1-D, got shape {tuple(idx1.shape)}")
    if in2.shape[0] != idx1.shape[0]:
        raise ValueError(f"index_mul_2d: in2 has {in2.shape[0]} rows but idx1 has {idx1.shape[0]} indices")
    if in1.shape[1] != in2.shape[1]:
        raise ValueError(f"index_mul_2d: in1 and in2 must have the same number of columns (no broadcast), got "
                         f"{in1.shape[1]} and {in2.shape[1]}")
    if not (in1.device == in2.device == idx1.device):
        raise ValueError(f"index_mul_2d: in1, in2 and idx1 must be on one device, got {in1.device}, {in2.device} "
                         f"and {idx1.device}")
    M = in1.shape[0]
    if idx1.numel() and check_values_enabled(idx1):
        lo, hi = (int(v) for v in torch.aminmax(idx1))
        if lo < 0 or hi >= M:
            raise ValueError(f"index_mul_2d: idx1 must be in [0, {M}) (the rows of in1), got values in [{lo}, {hi}]")
    idx = idx1.contiguous()
    if idx.dtype not in (torch.int32, torch.int64):
        idx = idx.to(torch.int64)
    return _rows_contiguous(in1), _rows_contiguous(in2), idx


def index_mul_2d(in1: Tensor, in2: Tensor, idx1: Tensor) -> Tensor:
    """``in1[idx1] * in2`` (Apex's ``index_mul_2d``), differentiable twice.

    Args:
        in1: ``(M, F)`` float16/bfloat16/float32/float64.
        in2: ``(N, F)``, the dtype of ``in1``.
        idx1: ``(N,)`` integer indices into the rows of ``in1``, in ``[0, M)`` (no negative wrap-around).

    Returns:
        ``(N, F)`` in the dtype of the inputs. The gradient of ``in1`` is a scatter-add, accumulated in
        fp32; it is bitwise reproducible under ``torch.use_deterministic_algorithms(True)`` (sorted
        segmented sums) and uses atomics otherwise.

    Differences from Apex: bfloat16 and float64 are accepted, inputs may have padded rows, and bad
    arguments raise ``TypeError``/``ValueError`` instead of ``RuntimeError``/``AssertionError``.
    """
    a, b, idx = _prepare(in1, in2, idx1)
    if torch.compiler.is_compiling():
        return index_mul_2d_fwd_op(a, b, idx)
    return _IndexMul2dFn.apply(a, b, idx)


def _grad_like(name: str, t: Tensor | None, like: Tensor) -> Tensor | None:
    if t is None:
        return None
    if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
        raise ValueError(f"index_mul_2d: {name} must match {tuple(like.shape)} {like.dtype} on {like.device}, got "
                         f"{tuple(t.shape)} {t.dtype} on {t.device}")
    return _rows_contiguous(t)


def index_mul_2d_backward(in1: Tensor, in2: Tensor, idx1: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor]:
    """``(grad_in1, grad_in2)`` of ``index_mul_2d(in1, in2, idx1)`` for ``grad_out`` ``(N, F)``; differentiable
    (Apex's ``index_mul_2d_backward``): its backward is the double backward."""
    a, b, idx = _prepare(in1, in2, idx1)
    g = _grad_like("grad_out", grad_out, in2)
    gin1, gin2 = _IndexMul2dBwdFn.apply(g, a, b, idx, True, True)
    return gin1, gin2


def index_mul_2d_backward_backward(in1: Tensor, in2: Tensor, idx1: Tensor, grad_out: Tensor,
                                   grad_grad_in1: Tensor | None, grad_grad_in2: Tensor | None
                                   ) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_grad_out, grad_in1, grad_in2)``: the double backward, not differentiable (``None`` grads are zeros)."""
    a, b, idx = _prepare(in1, in2, idx1)
    g = _grad_like("grad_out", grad_out, in2)
    gg1 = _grad_like("grad_grad_in1", grad_grad_in1, in1)
    gg2 = _grad_like("grad_grad_in2", grad_grad_in2, in2)
    with torch.no_grad():
        return _bwd_bwd_impl(gg1, gg2, g, a, b, idx, True, True, True, _deterministic())
