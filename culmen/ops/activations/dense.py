"""Dense layers with fused epilogues: cuBLAS GEMMs (``torch.addmm`` / ``mm``) plus the Triton activation
kernels of this package, and one autograd function per composition that saves only what its
backward needs.

* ``linear``: ``x @ W^T + b`` (Apex's / flash_attn's ``FusedDense``). The bias add rides on the GEMM
  (cuBLASLt's bias epilogue inside ``addmm``); the backward is three cuBLAS calls and a column sum.
* ``linear_act_linear``: ``act(x @ W1^T + b1) @ W2^T + b2`` (``FusedDenseGeluDense``, flash_attn's
  ``FusedMLP``), with flash_attn's ``checkpoint_lvl``: 0 saves the pre-activation and the activation
  output, 1 saves only the pre-activation (the output is recomputed inside the fused backward kernel,
  at no extra read), 2 saves neither (the first GEMM is redone). ReLU needs no pre-activation at all:
  its derivative comes from its output, so only the output is saved, and the forward fuses bias + ReLU
  into the GEMM epilogue (``torch._addmm_activation``).
* ``mlp_forward`` / ``mlp_backward``: Apex's ``MLP`` stack (activation after every layer), saving
  only the layer outputs (ReLU / sigmoid derivatives come from the outputs).

In every backward the activation derivative and the bias gradient come from ONE Triton pass over the
hidden activations (``act_bwd`` with a fused column reduction), written in place over the GEMM's
``dL/d(out)`` buffer: no extra ``(tokens, hidden)`` buffer is allocated.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.activations.op import act_bwd, act_fwd

TUNING = {
    # Fuse bias + ReLU into the cuBLASLt GEMM epilogue (torch._addmm_activation) instead of a
    # separate in-place Triton pass over the GEMM output.
    "relu_epilogue": True,
}


def check_layers(x: Tensor, layers: list[tuple[str, Tensor, Tensor | None]], x_name: str = "input") -> None:
    """Validate consecutive linear layers ``(name, weight (out, in), bias (out,) | None)`` applied to
    ``x (..., in)``: shapes chain, one dtype and one device; errors name the argument."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{x_name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{x_name} must have at least one dimension")
    feats = x.shape[-1]
    for name, w, b in layers:
        if w.dim() != 2 or w.shape[1] != feats:
            raise ValueError(f"{name} must have shape (out_features, {feats}), got {tuple(w.shape)}")
        if b is not None and tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"the bias of {name} must have shape ({w.shape[0]},), got {tuple(b.shape)}")
        for t in (w, b):
            if t is not None and t.dtype != x.dtype:
                raise TypeError(f"{x_name} is {x.dtype} but {name}'s parameters are {t.dtype}; use one dtype "
                                "(or autocast)")
            if t is not None and t.device != x.device:
                raise ValueError(f"{x_name} is on {x.device} but {name}'s parameters are on {t.device}")
        feats = w.shape[0]


def _mm_bias(x2: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x2 @ weight^T (+ bias)``: ``x2`` ``(M, K)``, ``weight`` ``(N, K)``, ``bias`` ``(N,)``."""
    if bias is None:
        return torch.mm(x2, weight.t())
    return torch.addmm(bias, x2, weight.t())


def _mm_bias_act(x2: Tensor, weight: Tensor, bias: Tensor | None, act: str) -> Tensor:
    """``act(x2 @ weight^T + bias)``: ReLU in the GEMM epilogue when it can be, else one in-place pass."""
    if act == "relu" and bias is not None and TUNING["relu_epilogue"]:
        return torch._addmm_activation(bias, x2, weight.t())
    out = _mm_bias(x2, weight, bias)
    if act == "none":
        return out
    return act_fwd(out, None, act, inplace=True)


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


# ------------------------------------------------------------------------------------------ linear


# The forward / backward bodies are plain functions taking ``ctx`` so that the Apex- and
# flash_attn-named autograd functions can share them (torch.compile does not trace one
# autograd.Function calling another's staticmethods).


def linear_forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Forward of ``y = x @ W^T + b``; saves what ``linear_backward`` needs on ``ctx``."""
    x2 = _rows(x)
    y = _mm_bias(x2, weight, bias)
    # The weight gradient needs x; without it only W is kept.
    ctx.save_for_backward(x2 if weight.requires_grad else None, weight)
    ctx.x_shape = x.shape
    ctx.has_bias = bias is not None
    return y.reshape(*x.shape[:-1], weight.shape[0])


def linear_backward(ctx, g: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dx, dW, db)`` of ``linear_forward`` (``None`` where ``ctx.needs_input_grad`` says so)."""
    x2, weight = ctx.saved_tensors
    g2 = _rows(g)
    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        dx = torch.mm(g2, weight).reshape(ctx.x_shape)
    if ctx.needs_input_grad[1]:
        dw = torch.mm(g2.t(), x2)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        db = g2.sum(0)
    return dx, dw, db


class LinearFunction(torch.autograd.Function):
    """``y = x @ W^T + b`` for ``x`` ``(..., K)``, ``W`` ``(N, K)``, ``b`` ``(N,)`` or None."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return linear_forward(ctx, x, weight, bias)

    @staticmethod
    def backward(ctx, g: Tensor):
        return linear_backward(ctx, g)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Differentiable ``x @ weight^T + bias`` (``x`` ``(..., K)``; result ``(..., N)`` in ``x``'s dtype)."""
    return LinearFunction.apply(x, weight, bias)


# ------------------------------------------------------------------------------- linear-act-linear


def linear_act_linear_forward(ctx, x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None,
                              act: str, checkpoint_lvl: int) -> Tensor:
    """Forward of ``act(x @ W1^T + b1) @ W2^T + b2``; saves per ``checkpoint_lvl`` on ``ctx``."""
    x2 = _rows(x)
    relu = act == "relu"
    if relu:
        out1 = _mm_bias_act(x2, w1, b1, "relu")
        pre = None
    else:
        pre = _mm_bias(x2, w1, b1)
        out1 = act_fwd(pre, None, act)
    out2 = _mm_bias(out1, w2, b2)
    if checkpoint_lvl == 2:
        saved = (None, None)
    elif relu:
        saved = (None, out1)  # ReLU' comes from its output: the pre-activation is never needed
    elif checkpoint_lvl == 1:
        saved = (pre, None)
    else:
        saved = (pre, out1)
    ctx.save_for_backward(x2, w1, b1, w2, *saved)
    ctx.act = act
    ctx.x_shape = x.shape
    ctx.has_b1 = b1 is not None
    ctx.has_b2 = b2 is not None
    return out2.reshape(*x.shape[:-1], w2.shape[0])


def linear_act_linear_backward(ctx, g: Tensor) -> tuple:
    """``(dx, dW1, db1, dW2, db2, None, None)`` of ``linear_act_linear_forward``."""
    x2, w1, b1, w2, pre, out1 = ctx.saved_tensors
    act = ctx.act
    need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
    need_b1 = need_b1 and ctx.has_b1
    need_first = need_x or need_w1 or need_b1
    g2 = _rows(g)
    if pre is None and out1 is None:  # checkpoint_lvl 2: redo the first GEMM
        if act == "relu":
            out1 = _mm_bias_act(x2, w1, b1, "relu")
        else:
            pre = _mm_bias(x2, w1, b1)
    dpre = db1 = None
    if need_first:
        d_out1 = torch.mm(g2, w2)
        if act == "relu":
            dpre, db1, _ = act_bwd(d_out1, out1, None, "relu", from_output=True,
                                   dbias_dtype=b1.dtype if need_b1 else None, inplace=True)
        else:
            # One pass: dL/dpre (in place over d_out1), the bias grad and, when not saved, act(pre).
            dpre, db1, y = act_bwd(d_out1, pre, None, act, dbias_dtype=b1.dtype if need_b1 else None,
                                   store_out=out1 is None, inplace=True)
            if out1 is None:
                out1 = y
    elif out1 is None:
        out1 = act_fwd(pre, None, act)
    dw2 = torch.mm(g2.t(), out1) if need_w2 else None
    db2 = g2.sum(0) if (need_b2 and ctx.has_b2) else None
    dx = torch.mm(dpre, w1).reshape(ctx.x_shape) if need_x else None
    dw1 = torch.mm(dpre.t(), x2) if need_w1 else None
    return dx, dw1, db1, dw2, db2, None, None


class LinearActLinearFunction(torch.autograd.Function):
    """``act(x @ W1^T + b1) @ W2^T + b2``; see the module docstring for ``checkpoint_lvl``."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, act, checkpoint_lvl):
        return linear_act_linear_forward(ctx, x, w1, b1, w2, b2, act, checkpoint_lvl)

    @staticmethod
    def backward(ctx, g):
        return linear_act_linear_backward(ctx, g)


def linear_act_linear(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None,
                      activation: str, checkpoint_lvl: int = 0) -> Tensor:
    """Differentiable ``act(x @ w1^T + b1) @ w2^T + b2``.

    Args:
        x: ``(..., K)``; w1: ``(H, K)``; b1: ``(H,)`` or None; w2: ``(N, H)``; b2: ``(N,)`` or None, one dtype.
        activation: ``gelu`` / ``gelu_tanh`` / ``relu`` / ``sqrelu`` / ``silu`` / ``sigmoid`` / ``none``.
        checkpoint_lvl: 0, 1 or 2 (what is saved for the backward, see the module docstring).

    Returns ``(..., N)`` in ``x``'s dtype.
    """
    return LinearActLinearFunction.apply(x, w1, b1, w2, b2, activation, checkpoint_lvl)


# ------------------------------------------------------------------------------------ MLP stacks


def mlp_forward(x2: Tensor, weights: list[Tensor], biases: list[Tensor] | None, act: str) -> list[Tensor]:
    """Outputs of every layer of ``h -> act(h @ W_i^T + b_i)`` (2-D ``x2``); the last one is the result."""
    outs = []
    h = x2
    for i, w in enumerate(weights):
        h = _mm_bias_act(h, w, biases[i] if biases else None, act)
        outs.append(h)
    return outs


def mlp_backward(g: Tensor, x2: Tensor, weights: list[Tensor], outputs: list[Tensor], act: str, has_bias: bool,
                 need_x: bool) -> tuple[Tensor | None, list[Tensor], list[Tensor]]:
    """``(dx, [dW_i], [db_i])`` of ``mlp_forward`` from its saved outputs (``act`` in none/relu/sigmoid)."""
    n = len(weights)
    dws: list[Tensor] = [None] * n  # type: ignore[list-item]
    dbs: list[Tensor] = [None] * n  # type: ignore[list-item]
    g = g.contiguous()
    owned = False  # the first g belongs to autograd: never overwrite it
    for i in reversed(range(n)):
        bias_dtype = weights[i].dtype if has_bias else None
        if act == "none":
            dpre = g
            if has_bias:
                dbs[i] = g.sum(0)
        else:
            dpre, dbs[i], _ = act_bwd(g, outputs[i], None, act, from_output=True, dbias_dtype=bias_dtype,
                                      inplace=owned)
        h = outputs[i - 1] if i > 0 else x2
        dws[i] = torch.mm(dpre.t(), h)
        if i > 0 or need_x:
            g = torch.mm(dpre, weights[i])
            owned = True
    return (g if need_x else None), dws, dbs
