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

Host cost matters as much as device time here: an 8192 x 1024-4096-1024 bf16 step is ~0.7 ms of GPU
work, about what a Python autograd step of these compositions costs on a slow host. So the GEMMs are
``F.linear`` (the transpose happens in C++), 2-D contiguous inputs are used as they are, the backend is
chosen once per autograd node (``_fast``), and the activation launchers are called directly in eager mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from culmen.ops.activations.op import _launch, _use_triton, act_bwd, act_fwd, apply_function, raw_apply

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
    shape = x.shape
    if not shape:
        raise ValueError(f"{x_name} must have at least one dimension")
    feats = shape[-1]
    dtype, device = x.dtype, x.device
    for name, w, b in layers:
        ws = w.shape
        if len(ws) != 2 or ws[1] != feats:
            raise ValueError(f"{name} must have shape (out_features, {feats}), got {tuple(ws)}")
        feats = ws[0]
        if b is not None and (len(b.shape) != 1 or b.shape[0] != feats):
            raise ValueError(f"the bias of {name} must have shape ({feats},), got {tuple(b.shape)}")
        for t in (w, b):
            if t is None:
                continue
            if t.dtype != dtype:
                raise TypeError(f"{x_name} is {dtype} but {name}'s parameters are {t.dtype}; use one dtype "
                                "(or autocast)")
            if t.device != device:
                raise ValueError(f"{x_name} is on {device} but {name}'s parameters are on {t.device}")


def _mm_bias(x2: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x2 @ weight^T (+ bias)``: ``x2`` ``(M, K)``, ``weight`` ``(N, K)``, ``bias`` ``(N,)``. ``F.linear``
    is cuBLAS(Lt) ``addmm`` with the bias epilogue, transposing in C++ (a Python ``.t()`` costs
    microseconds of host time)."""
    return F.linear(x2, weight, bias)


def _fast(t: Tensor) -> bool:
    """Whether the activation launchers can be called directly (eager mode, Triton backend): one
    backend decision per autograd node instead of one per op-level call."""
    return not torch.compiler.is_compiling() and _use_triton(t)


def _mm_bias_act(x2: Tensor, weight: Tensor, bias: Tensor | None, act: str) -> Tensor:
    """``act(x2 @ weight^T + bias)``: ReLU in the GEMM epilogue when it can be, else one in-place pass."""
    if act == "relu" and bias is not None and TUNING["relu_epilogue"]:
        return torch._addmm_activation(bias, x2, weight.t())
    out = _mm_bias(x2, weight, bias)
    if act == "none":
        return out
    return act_fwd(out, None, act, inplace=True)


def _rows(t: Tensor) -> Tensor:
    """``t`` as a contiguous 2-D ``(rows, features)`` tensor (itself when it already is one)."""
    if t.dim() == 2 and t.is_contiguous():
        return t
    return t.reshape(-1, t.shape[-1]).contiguous()


def _unrows(t: Tensor, shape: torch.Size) -> Tensor:
    """A 2-D result ``t`` back in the caller's leading dims ``shape[:-1]``."""
    return t if len(shape) == 2 else t.reshape(*shape[:-1], t.shape[-1])


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
    return _unrows(y, x.shape)


def linear_backward(ctx, g: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dx, dW, db)`` of ``linear_forward`` (``None`` where ``ctx.needs_input_grad`` says so)."""
    x2, weight = ctx.saved_tensors
    g2 = _rows(g)
    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        dx = _unrows(torch.mm(g2, weight), ctx.x_shape)
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


_LINEAR_APPLY = raw_apply(LinearFunction)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Differentiable ``x @ weight^T + bias`` (``x`` ``(..., K)``; result ``(..., N)`` in ``x``'s dtype)."""
    return apply_function(LinearFunction, _LINEAR_APPLY, x, weight, bias)


# ------------------------------------------------------------------------------- linear-act-linear


def linear_act_linear_forward(ctx, x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None,
                              act: str, checkpoint_lvl: int) -> Tensor:
    """Forward of ``act(x @ W1^T + b1) @ W2^T + b2``; saves per ``checkpoint_lvl`` on ``ctx``."""
    x2 = _rows(x)
    relu = act == "relu"
    fast = _fast(x2)
    if relu:
        out1 = _mm_bias_act(x2, w1, b1, "relu")
        pre = None
    else:
        pre = _mm_bias(x2, w1, b1)
        out1 = _launch().act_fwd(pre, None, act) if fast else act_fwd(pre, None, act)
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
    ctx.state = (act, x.shape, b1 is not None, b2 is not None, fast)
    return _unrows(out2, x.shape)


def linear_act_linear_backward(ctx, g: Tensor) -> tuple:
    """``(dx, dW1, db1, dW2, db2, None, None)`` of ``linear_act_linear_forward``."""
    x2, w1, b1, w2, pre, out1 = ctx.saved_tensors
    act, x_shape, has_b1, has_b2, fast = ctx.state
    need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
    need_b1 = need_b1 and has_b1
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
        if fast:
            # The launcher directly: dL/dpre in place over d_out1 (fresh, contiguous), the bias grad and,
            # when not saved, act(pre), in one pass.
            relu = act == "relu"
            dpre, db1, y = _launch().act_bwd(d_out1, out1 if relu else pre, None, act, relu, need_b1,
                                             b1.dtype if need_b1 else x2.dtype, out1 is None, d_out1)
            if out1 is None:
                out1 = y
        elif act == "relu":
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
    db2 = g2.sum(0) if (need_b2 and has_b2) else None
    dx = _unrows(torch.mm(dpre, w1), x_shape) if need_x else None
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


_LAL_APPLY = raw_apply(LinearActLinearFunction)


def linear_act_linear(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None,
                      activation: str, checkpoint_lvl: int = 0) -> Tensor:
    """Differentiable ``act(x @ w1^T + b1) @ w2^T + b2``.

    Args:
        x: ``(..., K)``; w1: ``(H, K)``; b1: ``(H,)`` or None; w2: ``(N, H)``; b2: ``(N,)`` or None, one dtype.
        activation: ``gelu`` / ``gelu_tanh`` / ``relu`` / ``sqrelu`` / ``silu`` / ``sigmoid`` / ``none``.
        checkpoint_lvl: 0, 1 or 2 (what is saved for the backward, see the module docstring).

    Returns ``(..., N)`` in ``x``'s dtype.
    """
    return apply_function(LinearActLinearFunction, _LAL_APPLY, x, w1, b1, w2, b2, activation, checkpoint_lvl)


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
    fast = act != "none" and _fast(x2)
    for i in reversed(range(n)):
        bias_dtype = weights[i].dtype if has_bias else None
        if act == "none":
            dpre = g
            if has_bias:
                dbs[i] = g.sum(0)
        elif fast:
            y = outputs[i]
            dpre, dbs[i], _ = _launch().act_bwd(g, y, None, act, True, has_bias, bias_dtype or y.dtype, False,
                                                g if owned else None)
        else:
            dpre, dbs[i], _ = act_bwd(g, outputs[i], None, act, from_output=True, dbias_dtype=bias_dtype,
                                      inplace=owned)
        h = outputs[i - 1] if i > 0 else x2
        dws[i] = torch.mm(dpre.t(), h)
        if i > 0 or need_x:
            g = torch.mm(dpre, weights[i])
            owned = True
    return (g if need_x else None), dws, dbs
