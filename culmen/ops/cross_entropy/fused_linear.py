"""Fused linear + cross-entropy: ``CE(hidden @ weight.T + bias, labels)`` without the ``(N, V)`` logits.

Algorithm (token chunks; culmen's addition, flash_attn and Apex have no such op): for each chunk of
``C`` rows,

1. ``logits_c = hidden_c @ weight.T (+ bias)`` with cuBLAS into one reused ``(C, V)`` buffer;
2. the cross-entropy kernel computes the chunk's loss / z-loss / LSE in fp32 and overwrites the buffer
   with ``d loss / d logits_c`` (already scaled by ``1 / #valid`` for a mean);
3. ``grad_hidden_c = dlogits_c @ weight``, ``grad_weight += dlogits_c.T @ hidden_c`` (``addmm_``),
   ``grad_bias += dlogits_c.sum(0)``.

For ``reduction="mean"``/``"sum"`` this all happens in the forward, so the backward only multiplies the
gradients by the incoming scalar: three matmuls in all, and the extra memory is the gradients plus one
``(C, V)`` buffer. ``C`` comes from a byte budget (``TUNING["chunk_bytes"]``) or ``chunk_size``. For
``reduction="none"`` the forward only computes losses and LSEs, and the backward recomputes each
chunk's logits and applies the per-row upstream gradient.

Precision: logits and their gradient are in the input dtype (as in the unfused bf16 matmul), all
softmax statistics in fp32 (safe at any vocab size). ``grad_weight`` accumulates over the chunks in
``accum_dtype``: the weight's dtype by default (one rounding per chunk, the memory of the gradient
itself, as Liger-Kernel does), or ``torch.float32`` for one rounding in all at ``4 V H`` more bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import register_op
from culmen.ops.common.outputs import nothing
from culmen.ops.cross_entropy.op import bwd_impl, check_float, check_int_labels, check_labels, check_scalars, fwd_impl

register_op("fused_linear_cross_entropy", "loss", "hidden @ W.T (+ b) -> cross-entropy in token chunks, "
            "gradients computed in the forward")
register_op("fused_linear_cross_entropy_bwd", "loss", "recompute-based backward of the reduction='none' case")

TUNING = {
    # Bytes of the reused (C, V) logits buffer; C is rounded down to a multiple of "chunk_multiple".
    "chunk_bytes": 128 << 20,
    "chunk_multiple": 128,
    # Rows of the vocab slice used to accumulate grad_weight into an fp32 buffer (accum_dtype=float32).
    "fp32_accum_rows": 16384,
}

_REDUCTIONS = ("mean", "sum", "none")


def _chunk_rows(N: int, V: int, elem: int, chunk_size: int) -> int:
    if chunk_size > 0:
        return max(1, min(N, chunk_size))
    rows = TUNING["chunk_bytes"] // max(1, V * elem)
    mult = TUNING["chunk_multiple"]
    rows = (rows // mult) * mult if rows >= mult else max(1, rows)
    return max(1, min(N, rows))


def _grads_of_chunk(lg: Tensor, h_c: Tensor, weight: Tensor, gh: Tensor | None, gw: Tensor | None,
                    gb: Tensor | None, r0: int, r1: int) -> None:
    """Consume ``lg`` (the chunk's ``d loss / d logits``) into the three gradients."""
    if gh is not None:
        torch.mm(lg, weight, out=gh[r0:r1])
    if gw is not None:
        if gw.dtype == lg.dtype:
            # The first chunk writes grad_weight (allocated empty: no zero-fill pass over V x H).
            if r0 == 0:
                torch.mm(lg.t(), h_c, out=gw)
            else:
                gw.addmm_(lg.t(), h_c)
        else:
            # fp32 accumulation of low-precision products: cuBLAS cannot add a bf16 product into an
            # fp32 C everywhere, so the product is formed per vocab slice and added (bounded temp).
            step = TUNING["fp32_accum_rows"]
            for v0 in range(0, gw.shape[0], step):
                gw[v0:v0 + step].add_(torch.mm(lg[:, v0:v0 + step].t(), h_c))
    if gb is not None:
        gb.add_(lg.sum(0, dtype=torch.float32))


def _alloc_grads(hidden: Tensor, weight: Tensor, need_hidden: bool, need_weight: bool, need_bias: bool,
                 accum_dtype: torch.dtype | None):
    """Gradient buffers: grad_hidden (each chunk writes its rows), grad_weight (empty when accumulated in
    the weight's dtype: the first chunk writes it; zeros for an fp32 accumulator), fp32 grad_bias."""
    V, H = weight.shape
    acc = accum_dtype or weight.dtype
    gh = torch.empty_like(hidden) if need_hidden else None
    gw = None
    if need_weight:
        fresh = acc == hidden.dtype and hidden.shape[0] > 0
        gw = (torch.empty if fresh else torch.zeros)((V, H), device=hidden.device, dtype=acc)
    gb = torch.zeros((V,), device=hidden.device, dtype=torch.float32) if need_bias else None
    return gh, gw, gb


def _logits_chunk(buf: Tensor, h_c: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    lg = buf[: h_c.shape[0]]
    if bias is None:
        torch.mm(h_c, weight.t(), out=lg)
    else:
        torch.addmm(bias, h_c, weight.t(), out=lg)
    return lg


def flce_fwd_impl(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, ignore_index: int,
                  label_smoothing: float, lse_square_scale: float, softcap: float, reduction: str,
                  need_hidden: bool, need_weight: bool, need_bias: bool, chunk_size: int,
                  accum_dtype: torch.dtype | None):
    """Forward (and, for mean/sum with a needed gradient, all gradients) on ``hidden (N, H)``.

    Returns ``(loss, z_loss, lse, grad_hidden, grad_weight, grad_bias)``: losses fp32, 0-dim for
    mean/sum and ``(N,)`` for none; ``lse (N,)`` fp32; gradients (``None`` where not computed) are
    of ``d (reduced loss) / d input`` for an upstream gradient of 1.
    """
    N, V = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    want_grad = reduction != "none" and (need_hidden or need_weight or need_bias)
    loss_rows = torch.empty((N,), device=dev, dtype=torch.float32)
    z_rows = torch.empty((N,), device=dev, dtype=torch.float32)
    lse = torch.empty((N,), device=dev, dtype=torch.float32)
    n_valid = (labels != ignore_index).sum().to(torch.float32)
    gh = gw = gb = scale = None
    if want_grad:
        # The mean's 1/#valid is applied inside the kernel so the gradients come out final (clamped:
        # with every row ignored the loss is NaN like PyTorch's, but the gradients are 0, not NaN).
        scale = (1.0 / n_valid.clamp_min(1.0)) if reduction == "mean" else torch.ones((), device=dev)
        scale = scale.reshape(1).to(torch.float32)
        gh, gw, gb = _alloc_grads(hidden, weight, need_hidden, need_weight, need_bias, accum_dtype)
    C = _chunk_rows(N, V, hidden.element_size(), chunk_size)
    buf = torch.empty((min(C, N), V), device=dev, dtype=hidden.dtype)
    for r0 in range(0, N, C):
        r1 = min(N, r0 + C)
        h_c = hidden[r0:r1]
        lg = _logits_chunk(buf, h_c, weight, bias)
        out = fwd_impl(lg, labels[r0:r1], None, label_smoothing, 1.0, lse_square_scale, ignore_index, softcap, 0, V,
                       True, grad_scale=scale)
        loss_rows[r0:r1], z_rows[r0:r1], lse[r0:r1] = out
        if want_grad:
            _grads_of_chunk(lg, h_c, weight, gh, gw, gb, r0, r1)
    del buf
    if gw is not None and gw.dtype != weight.dtype:
        gw = gw.to(weight.dtype)
    if gb is not None:
        gb = gb.to(bias.dtype)
    if reduction == "none":
        loss, zl = loss_rows, z_rows
    elif reduction == "sum":
        loss, zl = loss_rows.sum(), z_rows.sum()
    else:
        loss, zl = loss_rows.sum() / n_valid, z_rows.sum() / n_valid
    return loss, zl, lse, gh, gw, gb


def flce_bwd_impl(dloss: Tensor, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, lse: Tensor,
                  ignore_index: int, label_smoothing: float, lse_square_scale: float, softcap: float,
                  need_hidden: bool, need_weight: bool, need_bias: bool, chunk_size: int,
                  accum_dtype: torch.dtype | None):
    """Backward of ``reduction="none"``: recompute each chunk's logits, apply ``dloss (N,)``.

    Returns ``(grad_hidden, grad_weight, grad_bias)`` (``None`` where not needed).
    """
    N, V = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    gh, gw, gb = _alloc_grads(hidden, weight, need_hidden, need_weight, need_bias, accum_dtype)
    C = _chunk_rows(N, V, hidden.element_size(), chunk_size)
    buf = torch.empty((min(C, N), V), device=dev, dtype=hidden.dtype)
    for r0 in range(0, N, C):
        r1 = min(N, r0 + C)
        h_c = hidden[r0:r1]
        lg = _logits_chunk(buf, h_c, weight, bias)
        bwd_impl(dloss[r0:r1], lg, lse[r0:r1], labels[r0:r1], label_smoothing, 1.0, lse_square_scale, ignore_index,
                 softcap, 0, V, out=lg)
        _grads_of_chunk(lg, h_c, weight, gh, gw, gb, r0, r1)
    del buf
    if gw is not None and gw.dtype != weight.dtype:
        gw = gw.to(weight.dtype)
    if gb is not None:
        gb = gb.to(bias.dtype)
    return gh, gw, gb


# ------------------------------------------------------------------------------------ custom ops


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
    """``(loss, z_loss, lse, grad_hidden, grad_weight, grad_bias)``; absent gradients are empty tensors."""
    out = flce_fwd_impl(hidden, weight, bias, labels, ignore_index, label_smoothing, lse_square_scale, softcap,
                        reduction, need_hidden, need_weight, need_bias, chunk_size, accum_dtype)
    return out[:3] + _filled(out[3:], hidden)


@fused_linear_cross_entropy_op.register_fake
def _(hidden, weight, bias, labels, ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
      need_hidden, need_weight, need_bias, chunk_size, accum_dtype):
    N = hidden.shape[0]
    f32 = torch.float32
    shape = (N,) if reduction == "none" else ()
    grads = reduction != "none"
    return (hidden.new_empty(shape, dtype=f32), hidden.new_empty(shape, dtype=f32), hidden.new_empty((N,), dtype=f32),
            torch.empty_like(hidden) if grads and need_hidden else nothing(hidden.device, hidden.dtype),
            torch.empty_like(weight) if grads and need_weight else nothing(hidden.device, hidden.dtype),
            torch.empty_like(bias) if grads and need_bias else nothing(hidden.device, hidden.dtype))


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
    return _filled(flce_bwd_impl(dloss, hidden, weight, bias, labels, lse, ignore_index, label_smoothing,
                                 lse_square_scale, softcap, need_hidden, need_weight, need_bias, chunk_size,
                                 accum_dtype), hidden)


@fused_linear_cross_entropy_bwd_op.register_fake
def _(dloss, hidden, weight, bias, labels, lse, ignore_index, label_smoothing, lse_square_scale, softcap,
      need_hidden, need_weight, need_bias, chunk_size, accum_dtype):
    return (torch.empty_like(hidden) if need_hidden else nothing(hidden.device, hidden.dtype),
            torch.empty_like(weight) if need_weight else nothing(hidden.device, hidden.dtype),
            torch.empty_like(bias) if need_bias else nothing(hidden.device, hidden.dtype))


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
        gh, gw, gb = (g * dloss.to(g.dtype) for g in ctx.saved_tensors)
    hn, wn, bn = ctx.needs
    return (gh if hn else None, gw if wn else None, gb if bn else None) + (None,) * (n_in - 3)


torch.library.register_autograd("culmen::fused_linear_cross_entropy", _op_backward, setup_context=_setup_context)


class _FusedLinearCEFn(torch.autograd.Function):
    """Eager path: the implementations without dispatch cost; the backward scales the saved gradients
    in place (they belong to this call), so it may run only once per forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, label_smoothing, lse_square_scale, softcap,
                reduction, need_hidden, need_weight, need_bias, chunk_size, accum_dtype):
        loss, zl, lse, gh, gw, gb = flce_fwd_impl(hidden, weight, bias, labels, ignore_index, label_smoothing,
                                                  lse_square_scale, softcap, reduction, need_hidden, need_weight,
                                                  need_bias, chunk_size, accum_dtype)
        ctx.reduction = reduction
        ctx.needs = (need_hidden, need_weight, need_bias)
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, bias, labels, lse)
            ctx.consts = (ignore_index, label_smoothing, lse_square_scale, softcap)
            ctx.chunk = (chunk_size, accum_dtype)
        else:
            ctx.grads = [gh, gw, gb]
        ctx.mark_non_differentiable(zl, lse)
        ctx.set_materialize_grads(False)
        return loss, zl, lse

    @staticmethod
    def backward(ctx, dloss, dzl, dlse):
        if dloss is None:
            return (None,) * 14
        if ctx.reduction == "none":
            hidden, weight, bias, labels, lse = ctx.saved_tensors
            gh, gw, gb = flce_bwd_impl(dloss, hidden, weight, bias, labels, lse, *ctx.consts, *ctx.needs, *ctx.chunk)
        else:
            if ctx.grads is None:
                raise RuntimeError("fused_linear_cross_entropy: backward through the same forward twice "
                                   "(retain_graph=True) is not supported; its gradients were computed in the "
                                   "forward and handed out by the first backward")
            # Scale in place (no second copy of grad_weight); then drop our reference so autograd owns it.
            gh, gw, gb = (None if g is None else g.mul_(dloss.to(g.dtype)) for g in ctx.grads)
            ctx.grads = None
        return (gh, gw, gb) + (None,) * 11


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
    for name, t in (("hidden", hidden), ("weight", weight)):
        check_float(name, t)
    if bias is not None:
        check_float("bias", bias)
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (V, H) with H = hidden.shape[-1]; got hidden {tuple(hidden.shape)}, "
                         f"weight {tuple(weight.shape)}")
    V, H = weight.shape
    if V == 0:
        raise ValueError("weight must have at least one row (V >= 1)")
    if bias is not None and tuple(bias.shape) != (V,):
        raise ValueError(f"bias must have shape ({V},), got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    check_scalars(label_smoothing, lse_square_scale, softcap)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")
    if accum_dtype not in (None, torch.float32, weight.dtype):
        raise ValueError(f"accum_dtype must be None, torch.float32 or the weight's dtype, got {accum_dtype}")
    lead = tuple(hidden.shape[:-1])
    check_int_labels(labels, lead, hidden.device)
    check_labels(labels, V, ignore_index)
    dev_type = hidden.device.type
    if dev_type in ("cuda", "cpu") and torch.is_autocast_enabled(dev_type):
        dt = torch.get_autocast_dtype(dev_type)
        hidden, weight = hidden.to(dt), weight.to(dt)
        bias = bias.to(dt) if bias is not None else None
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise TypeError(f"hidden, weight and bias must share one dtype; got hidden {hidden.dtype}, weight "
                        f"{weight.dtype}, bias {None if bias is None else bias.dtype}")
    h2 = hidden.reshape(-1, H)
    if h2.stride(-1) != 1 and H > 1:
        h2 = h2.contiguous()
    lab = labels.reshape(-1).contiguous()
    grad_on = torch.is_grad_enabled()
    needs = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
             grad_on and bias is not None and bias.requires_grad)
    args = (h2, weight, bias, lab, int(ignore_index), float(label_smoothing), float(lse_square_scale),
            float(softcap or 0.0), reduction, *needs, int(chunk_size or 0), accum_dtype)
    if torch.compiler.is_compiling():
        loss, zl, _ = fused_linear_cross_entropy_op(*args)[:3]
    else:
        loss, zl, _ = _FusedLinearCEFn.apply(*args)
    if reduction == "none":
        loss, zl = loss.reshape(lead), zl.reshape(lead)
    return (loss, zl) if return_z_loss else loss


def default_chunk_rows(n_rows: int, vocab: int, dtype: torch.dtype) -> int:
    """The chunk the default budget gives for ``n_rows`` tokens of ``vocab`` classes (for benchmarks)."""
    return _chunk_rows(n_rows, vocab, torch.empty((), dtype=dtype).element_size(), 0)


__all__ = ["TUNING", "default_chunk_rows", "fused_linear_cross_entropy"]
