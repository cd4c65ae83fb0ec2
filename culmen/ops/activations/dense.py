"""Dense layers with fused epilogues: cuBLAS GEMMs (``F.linear`` / ``mm``) plus the Triton activation
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
hidden activations, written in place over the GEMM's ``dL/d(out)`` buffer: no extra ``(tokens, hidden)``
buffer is allocated.

Host cost matters as much as device time here (an 8192 x 1024-4096-1024 bf16 step is ~0.7 ms of GPU
work, about what a Python autograd step of these compositions costs on a slow host). So the call path
of DESIGN.md: the API functions check their arguments once per call signature (``checked``) and get a
``DensePlan`` that keeps the activation plans of every layer (``launch.ActPlan`` / ``ActBwdPlan``, built
on first use); a cached call makes the GEMMs, the activation launches and the allocations, nothing
else. Under ``torch.compile`` the same bodies run with ``plan=None``: the activations then go through
the traced ops (``op.act_fwd`` / ``op.act_bwd``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from culmen.ops.activations.launch import ActBwdPlan, ActPlan
from culmen.ops.activations.op import act_bwd, act_fwd
from culmen.ops.common.function import raw_apply
from culmen.ops.common.plans import PlanCache

TUNING = {
    # Fuse bias + ReLU into the cuBLASLt GEMM epilogue (torch._addmm_activation) instead of a
    # separate in-place Triton pass over the GEMM output. Read per call (a benchmark toggles it around
    # single calls; the plans do not depend on it).
    "relu_epilogue": True,
}

DENSE_PLANS = PlanCache("dense")


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
        if not isinstance(w, Tensor) or (b is not None and not isinstance(b, Tensor)):
            raise TypeError(f"{name} and its bias must be torch.Tensors")
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


class DensePlan:
    """What a dense composition derives from one call signature (its checks passed): the activation
    and the activation plans of its layers, built from the first call's tensors (the hidden tensors
    are fresh contiguous GEMM outputs, so one signature has one geometry). Holds no tensors."""

    __slots__ = ("act", "fwd", "bwd")

    def __init__(self, act: str) -> None:
        self.act = act
        self.fwd: dict = {}
        self.bwd: dict = {}


def dense_plan(key: tuple, act: str, check) -> DensePlan:
    """The cached ``DensePlan`` of ``key``; ``check()`` (raising on bad arguments) runs on a miss. A key
    that cannot be hashed (``None``: not tensors) is checked on every call and never cached."""
    plan = DENSE_PLANS.get(key) if key is not None else None
    if plan is None:
        check()
        plan = DensePlan(act)
        if key is not None:
            DENSE_PLANS.put(key, plan)
    return plan


# ------------------------------------------------------------------------------ activations


def _act(plan: DensePlan | None, slot, t: Tensor, act: str, inplace: bool) -> Tensor:
    """``act(t)`` (``t`` a fresh contiguous GEMM output), in place when ``inplace``."""
    if plan is None:
        return act_fwd(t, None, act, inplace=inplace)
    ap = plan.fwd.get(slot)
    if ap is None:
        ap = plan.fwd[slot] = ActPlan(t, None, act)
    return ap.forward(t, None, t if inplace and ap.inplace_ok else None)


def _act_grad(plan: DensePlan | None, slot, g: Tensor, t: Tensor, act: str, from_output: bool,
              db_dtype: torch.dtype | None, store_out: bool, inplace: bool) -> tuple:
    """``(dL/dpre, dbias, act(pre))`` from ``g = dL/d act(pre)`` (contiguous) and ``t`` (the pre-activation,
    or the output with ``from_output``), in one pass; ``dL/dpre`` over ``g`` when ``inplace``."""
    if plan is None:
        return act_bwd(g, t, None, act, from_output=from_output, dbias_dtype=db_dtype, store_out=store_out,
                       inplace=inplace)
    key = (slot, db_dtype, store_out)
    bp = plan.bwd.get(key)
    if bp is None:
        bp = plan.bwd[key] = ActBwdPlan(g, t, None, act, from_output, db_dtype is not None, db_dtype or t.dtype,
                                        store_out)
    return bp.run(g, t, None, g if inplace and bp.inplace_ok else None)


def _mm_bias_act(plan: DensePlan | None, slot, x2: Tensor, weight: Tensor, bias: Tensor | None, act: str) -> Tensor:
    """``act(x2 @ weight^T + bias)``: ReLU in the GEMM epilogue when it can be, else one in-place pass."""
    if act == "relu" and bias is not None and TUNING["relu_epilogue"]:
        return torch._addmm_activation(bias, x2, weight.t())
    out = F.linear(x2, weight, bias)
    if act == "none":
        return out
    return _act(plan, slot, out, act, True)


def _rows(t: Tensor) -> Tensor:
    """``t`` as 2-D ``(rows, features)`` (itself when it already is; a view when the strides allow)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _unrows(t: Tensor, shape: torch.Size) -> Tensor:
    """A 2-D result ``t`` back in the caller's leading dims ``shape[:-1]``."""
    return t if len(shape) == 2 else t.view(*shape[:-1], t.shape[-1])


# ------------------------------------------------------------------------------------------ linear


def linear_forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Forward of ``y = x @ W^T + b`` (any leading dims: ``F.linear`` folds them); saves what
    ``linear_backward`` needs on ``ctx``."""
    # The weight gradient needs x; without it only W is kept.
    ctx.save_for_backward(x if weight.requires_grad else None, weight)
    ctx.has_bias = bias is not None
    return F.linear(x, weight, bias)


def linear_backward(ctx, g: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dx, dW, db)`` of ``linear_forward`` (``None`` where ``ctx.needs_input_grad`` says so)."""
    x, weight = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_x, need_w, need_b = need[0], need[1], ctx.has_bias and need[2]
    dx = dw = db = None
    if need_x:
        dx = g.matmul(weight)
    if need_w or need_b:
        g2 = _rows(g)
        if need_w:
            dw = torch.mm(g2.t(), _rows(x))
        if need_b:
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
    """Differentiable ``x @ weight^T + bias`` (``x`` ``(..., K)``; result ``(..., N)`` in ``x``'s dtype).
    Unchecked: the API functions check once per signature (``checked_linear``)."""
    return _LINEAR_APPLY(x, weight, bias)


def checked_linear(x: Tensor, weight: Tensor, bias: Tensor | None, x_name: str = "input") -> Tensor:
    """``linear`` with ``check_layers``' checks, run once per call signature."""
    try:
        key = ("linear", x_name, x.shape, x.dtype, x.device, weight.shape, weight.dtype, weight.device,
               None if bias is None else (bias.shape, bias.dtype, bias.device))
    except AttributeError:
        key = None
    dense_plan(key, "none", lambda: check_layers(x, [("weight", weight, bias)], x_name))
    return _LINEAR_APPLY(x, weight, bias)


# ------------------------------------------------------------------------------- linear-act-linear


def linear_act_linear_forward(ctx, plan: DensePlan | None, x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor,
                              b2: Tensor | None, act: str, checkpoint_lvl: int) -> Tensor:
    """Forward of ``act(x @ W1^T + b1) @ W2^T + b2``; saves per ``checkpoint_lvl`` on ``ctx``. ``plan``:
    the cached activation plans (``None`` under ``torch.compile``)."""
    x2 = _rows(x)
    relu = act == "relu"
    if relu:
        out1 = _mm_bias_act(plan, 0, x2, w1, b1, "relu")
        pre = None
    else:
        pre = F.linear(x2, w1, b1)
        out1 = _act(plan, 0, pre, act, False)
    out2 = F.linear(out1, w2, b2)
    if checkpoint_lvl == 2:
        ctx.save_for_backward(x2, w1, b1, w2, None, None)
    elif relu:
        ctx.save_for_backward(x2, w1, b1, w2, None, out1)  # ReLU' comes from its output: no pre-activation
    elif checkpoint_lvl == 1:
        ctx.save_for_backward(x2, w1, b1, w2, pre, None)
    else:
        ctx.save_for_backward(x2, w1, b1, w2, pre, out1)
    ctx.state = (plan, act, x.shape, b1 is not None, b2 is not None)
    return _unrows(out2, x.shape)


def linear_act_linear_backward(ctx, g: Tensor, first: int = 0) -> tuple:
    """``(dx, dW1, db1, dW2, db2)`` of ``linear_act_linear_forward``; ``first``: the index of ``x`` among the
    autograd function's inputs."""
    x2, w1, b1, w2, pre, out1 = ctx.saved_tensors
    plan, act, x_shape, has_b1, has_b2 = ctx.state
    need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[first:first + 5]
    need_b1 = need_b1 and has_b1
    g2 = _rows(g)
    relu = act == "relu"
    if pre is None and out1 is None:  # checkpoint_lvl 2: redo the first GEMM
        if relu:
            out1 = _mm_bias_act(plan, 0, x2, w1, b1, "relu")
        else:
            pre = F.linear(x2, w1, b1)
    dpre = db1 = None
    if need_x or need_w1 or need_b1:
        d_out1 = torch.mm(g2, w2)
        # dL/dpre in place over d_out1 (fresh, contiguous), the bias grad and, when not saved, act(pre): one pass.
        dpre, db1, y = _act_grad(plan, 0, d_out1, out1 if relu else pre, act, relu, b1.dtype if need_b1 else None,
                                 out1 is None, True)
        if out1 is None:
            out1 = y
    elif out1 is None:
        out1 = _act(plan, 0, pre, act, False)
    dw2 = torch.mm(g2.t(), out1) if need_w2 else None
    db2 = g2.sum(0) if (need_b2 and has_b2) else None
    dx = _unrows(torch.mm(dpre, w1), x_shape) if need_x else None
    dw1 = torch.mm(dpre.t(), x2) if need_w1 else None
    return dx, dw1, db1, dw2, db2


class LinearActLinearFunction(torch.autograd.Function):
    """``act(x @ W1^T + b1) @ W2^T + b2``; see the module docstring for ``checkpoint_lvl``. Unchecked:
    ``linear_act_linear`` checks once per signature."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, act, checkpoint_lvl):
        return linear_act_linear_forward(ctx, None, x, w1, b1, w2, b2, act, checkpoint_lvl)

    @staticmethod
    def backward(ctx, g):
        return (*linear_act_linear_backward(ctx, g), None, None)


class _LinearActLinearPlanned(torch.autograd.Function):
    """``LinearActLinearFunction`` with the call's cached ``DensePlan`` (eager mode)."""

    @staticmethod
    def forward(ctx, plan, x, w1, b1, w2, b2, act, checkpoint_lvl):
        return linear_act_linear_forward(ctx, plan, x, w1, b1, w2, b2, act, checkpoint_lvl)

    @staticmethod
    def backward(ctx, g):
        return (None, *linear_act_linear_backward(ctx, g, 1), None, None)


_LAL_APPLY = raw_apply(_LinearActLinearPlanned)


def linear_act_linear(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None,
                      activation: str, checkpoint_lvl: int = 0, x_name: str = "input",
                      names: tuple[str, str] = ("weight1", "weight2")) -> Tensor:
    """Differentiable ``act(x @ w1^T + b1) @ w2^T + b2``, checked once per call signature.

    Args:
        x: ``(..., K)``; w1: ``(H, K)``; b1: ``(H,)`` or None; w2: ``(N, H)``; b2: ``(N,)`` or None, one dtype.
        activation: ``gelu`` / ``gelu_tanh`` / ``relu`` / ``sqrelu`` / ``silu`` / ``sigmoid`` / ``none``.
        checkpoint_lvl: 0, 1 or 2 (what is saved for the backward, see the module docstring).
        x_name, names: the argument names the errors use.

    Returns ``(..., N)`` in ``x``'s dtype.
    """
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        check_layers(x, [(names[0], w1, b1), (names[1], w2, b2)], x_name)
        return LinearActLinearFunction.apply(x, w1, b1, w2, b2, activation, checkpoint_lvl)
    try:
        key = ("lal", x_name, names, x.shape, x.dtype, x.device, w1.shape, w1.dtype, w1.device,
               None if b1 is None else (b1.shape, b1.dtype, b1.device), w2.shape, w2.dtype, w2.device,
               None if b2 is None else (b2.shape, b2.dtype, b2.device), activation, checkpoint_lvl)
    except AttributeError:
        key = None
    plan = dense_plan(key, activation,
                      lambda: check_layers(x, [(names[0], w1, b1), (names[1], w2, b2)], x_name))
    return _LAL_APPLY(plan, x, w1, b1, w2, b2, activation, checkpoint_lvl)


# ------------------------------------------------------------------------------------ MLP stacks


def mlp_forward(x2: Tensor, weights: list[Tensor], biases: list[Tensor] | None, act: str,
                plan: DensePlan | None = None) -> list[Tensor]:
    """Outputs of every layer of ``h -> act(h @ W_i^T + b_i)`` (2-D ``x2``); the last one is the result."""
    outs = []
    h = x2
    for i, w in enumerate(weights):
        h = _mm_bias_act(plan, i, h, w, biases[i] if biases else None, act)
        outs.append(h)
    return outs


def mlp_backward(g: Tensor, x2: Tensor, weights: list[Tensor], outputs: list[Tensor], act: str, has_bias: bool,
                 need_x: bool, plan: DensePlan | None = None) -> tuple[Tensor | None, list[Tensor], list[Tensor]]:
    """``(dx, [dW_i], [db_i])`` of ``mlp_forward`` from its saved outputs (``act`` in none/relu/sigmoid)."""
    n = len(weights)
    dws: list = [None] * n
    dbs: list = [None] * n
    if not g.is_contiguous():
        g = g.contiguous()
    owned = False  # the first g belongs to autograd: never overwrite it
    for i in range(n - 1, -1, -1):
        w = weights[i]
        if act == "none":
            dpre = g
            if has_bias:
                dbs[i] = g.sum(0)
        else:
            dpre, dbs[i], _ = _act_grad(plan, i, g, outputs[i], act, True, w.dtype if has_bias else None, False,
                                        owned)
        dws[i] = torch.mm(dpre.t(), outputs[i - 1] if i > 0 else x2)
        if i > 0 or need_x:
            g = torch.mm(dpre, w)
            owned = True
    return (g if need_x else None), dws, dbs
