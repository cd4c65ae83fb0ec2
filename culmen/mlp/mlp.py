"""``apex.mlp``: ``MLP`` and ``mlp_function``, a stack of linear layers run by one autograd function.

As in Apex, the activation follows every layer (the last one included), parameters are
``weight_i`` / ``bias_i`` (also listed in ``weights`` / ``biases``), and weights are initialised
normal(0, sqrt(2 / (fan_in + fan_out))), biases normal(0, sqrt(1 / fan_out)). Each layer is a cuBLAS
GEMM with bias (+ ReLU) in its epilogue or one fused Triton pass; the backward fuses the activation
derivative with the bias-gradient reduction. Only the layer outputs are saved (ReLU and sigmoid
derivatives come from them), which is also what Apex keeps.

Differences from Apex, on purpose: any leading shape ``(..., mlp_sizes[0])`` is accepted (Apex needs 2-D
input); CPU tensors work (the reference path); mixed dtypes raise ``TypeError`` instead of reading
memory as the wrong type.
"""

from __future__ import annotations

import math
from copy import copy

import torch
from torch import Tensor, nn

from culmen.normalization.fused_layer_norm import _autocast_off, _cast_if_autocast_enabled
from culmen.ops.activations.dense import DENSE_PLANS, DensePlan, mlp_backward, mlp_forward
from culmen.ops.common.function import raw_apply

__all__ = ["MLP", "MlpFunction", "mlp_function"]

_ACT_NAMES = {0: "none", 1: "relu", 2: "sigmoid"}
_ACT_CODES = {"none": 0, "relu": 1, "sigmoid": 2}


def _split_args(bias: int, args: tuple) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    if len(args) < 2:
        raise ValueError(f"mlp_function needs the input and at least one weight, got {len(args)} tensors")
    rest = list(args[1:])
    if bias:
        if len(rest) % 2:
            raise ValueError(f"with bias, mlp_function needs as many biases as weights; got {len(rest)} tensors "
                             "after the input")
        n = len(rest) // 2
        return args[0], rest[:n], rest[n:]
    return args[0], rest, []


def _validate(x: Tensor, weights: list[Tensor], biases: list[Tensor]) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"MLP input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError("MLP input must have at least one dimension")
    feats = x.shape[-1]
    for i, w in enumerate(weights):
        if w.dim() != 2 or w.shape[1] != feats:
            raise ValueError(f"weight_{i} must have shape (out_features, {feats}), got {tuple(w.shape)}")
        feats = w.shape[0]
        if biases and tuple(biases[i].shape) != (w.shape[0],):
            raise ValueError(f"bias_{i} must have shape ({w.shape[0]},), got {tuple(biases[i].shape)}")
    for name, t in [("weight", w) for w in weights] + [("bias", b) for b in biases]:
        if t.dtype != x.dtype:
            raise TypeError(f"MLP needs the input and all parameters in one dtype: input is {x.dtype}, a {name} "
                            f"is {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"MLP parameters must be on the input's device {x.device}, a {name} is on {t.device}")


def _check(bias: int, activation: int, args: tuple) -> tuple[int, str]:
    """Validate ``mlp_function``'s arguments; return the layer count and the activation name."""
    if activation not in _ACT_NAMES:
        raise ValueError(f"activation must be 0 (none), 1 (relu) or 2 (sigmoid), got {activation!r}")
    x, weights, biases = _split_args(bias, args)
    _validate(x, weights, biases)
    return len(weights), _ACT_NAMES[activation]


class _MlpPlan(DensePlan):
    """A checked ``mlp_function`` signature: layer count, bias flag, activation name, and (from
    ``DensePlan``) the activation plans of every layer."""

    __slots__ = ("n", "bias")

    def __init__(self, bias: int, activation: int, args: tuple) -> None:
        n, act = _check(bias, activation, args)
        super().__init__(act)
        self.n = n
        self.bias = bool(bias)


def _forward(ctx, plan: _MlpPlan | None, n: int, has_bias: bool, act: str, args: tuple) -> Tensor:
    x = args[0]
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    weights = args[1:1 + n]
    outs = mlp_forward(x2, weights, args[1 + n:] if has_bias else None, act, plan)
    ctx.save_for_backward(x2, *weights, *outs)
    ctx.state = (plan, n, has_bias, act, x.shape)
    y = outs[-1]
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


def _backward(ctx, grad_o: Tensor) -> tuple:
    plan, n, has_bias, act, x_shape = ctx.state
    saved = ctx.saved_tensors
    x2, weights, outs = saved[0], saved[1:1 + n], saved[1 + n:]
    g2 = grad_o if grad_o.dim() == 2 else grad_o.reshape(-1, grad_o.shape[-1])
    # The input is the first of the 1 + n (+ n biases) trailing tensor arguments.
    need_x = ctx.needs_input_grad[-(1 + n + (n if has_bias else 0))]
    dx, dws, dbs = mlp_backward(g2, x2, weights, outs, act, has_bias, need_x, plan)
    if dx is not None and len(x_shape) != 2:
        dx = dx.view(x_shape)
    return (dx, *dws, *(dbs if has_bias else ()))


class MlpFunction(torch.autograd.Function):
    """Apex's ``MlpFunction.apply(bias, activation, input, *weights, *biases)``.

    ``bias``: 0/1; ``activation``: 0 none, 1 relu, 2 sigmoid; ``input`` ``(..., sizes[0])``; returns
    ``(..., sizes[-1])`` in the input's dtype. Checks its arguments on every call (``mlp_function``
    checks once per signature).
    """

    @staticmethod
    def forward(ctx, bias, activation, *args):
        n, act = _check(bias, activation, args)
        return _forward(ctx, None, n, bool(bias), act, args)

    @staticmethod
    def backward(ctx, grad_o):
        return (None, None, *_backward(ctx, grad_o))


class _MlpPlanned(torch.autograd.Function):
    """``MlpFunction`` with the call's cached plan (eager mode)."""

    @staticmethod
    def forward(ctx, plan, *args):
        return _forward(ctx, plan, plan.n, plan.bias, plan.act, args)

    @staticmethod
    def backward(ctx, grad_o):
        return (None, *_backward(ctx, grad_o))


_MLP_APPLY = raw_apply(_MlpPlanned)


def mlp_function(bias: int, activation: int, *args: Tensor) -> Tensor:
    """``MlpFunction.apply`` with Apex's autocast behaviour (``amp.half_function``): under autocast the
    input and parameters are cast to the autocast dtype and the op runs with autocast off.

    ``args``: ``input (..., sizes[0]), *weights, *biases``. The arguments are checked once per call
    signature (shapes, dtypes and devices of all tensors).
    """
    if not args:
        raise ValueError("mlp_function needs the input tensor")
    x = args[0]
    device_type = x.device.type if isinstance(x, Tensor) else "cpu"
    if (torch.is_autocast_enabled(device_type) or torch.compiler.is_compiling()
            or torch._C._are_functorch_transforms_active()):
        args = _cast_if_autocast_enabled(device_type, *args)
        with _autocast_off(device_type):
            return MlpFunction.apply(bias, activation, *args)
    try:
        key = ("mlp", bias, activation, *[(t.shape, t.dtype, t.device) for t in args])
        plan = DENSE_PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors / unhashable flags: the checks say why
        key, plan = None, None
    if plan is None:
        plan = _MlpPlan(bias, activation, args)
        if key is not None:
            DENSE_PLANS.put(key, plan)
    return _MLP_APPLY(plan, *args)


class MLP(nn.Module):
    """Apex's ``MLP(mlp_sizes, bias=True, activation='relu')``.

    Args:
        mlp_sizes: layer widths, e.g. ``[1024, 4096, 1024]`` gives two layers.
        bias: add a bias to every layer.
        activation: ``'none'``, ``'relu'`` or ``'sigmoid'``, applied after every layer.

    Input ``(..., mlp_sizes[0])``, output ``(..., mlp_sizes[-1])``. Parameters are created in fp32 on
    the CPU (as Apex's); move them with ``.cuda()`` / ``.to()``.
    """

    def __init__(self, mlp_sizes, bias: bool = True, activation: str = "relu") -> None:
        super().__init__()
        sizes = list(mlp_sizes)
        if len(sizes) < 2 or any(int(s) != s or s < 1 for s in sizes):
            raise ValueError(f"mlp_sizes must hold at least two positive ints, got {mlp_sizes!r}")
        if activation not in _ACT_CODES:
            # Apex raises TypeError here; kept for callers that catch it.
            raise TypeError(f"activation must be one of {list(_ACT_CODES)}, got {activation!r}")
        self.num_layers = len(sizes) - 1
        self.mlp_sizes = copy(mlp_sizes)
        self.bias = 1 if bias else 0
        self.activation = _ACT_CODES[activation]
        self.weights: list[nn.Parameter] = []
        self.biases: list[nn.Parameter] = []
        for i in range(self.num_layers):
            w = nn.Parameter(torch.empty(sizes[i + 1], sizes[i]))
            self.weights.append(w)
            setattr(self, f"weight_{i}", w)
            if self.bias:
                b = nn.Parameter(torch.empty(sizes[i + 1]))
                self.biases.append(b)
                setattr(self, f"bias_{i}", b)
        self.reset_parameters()

    def _apply(self, fn, recurse=True):
        # .cuda() / .to() / .half() replace the Parameter objects: keep the lists pointing at them.
        super()._apply(fn, recurse)
        self.weights = [getattr(self, f"weight_{i}") for i in range(self.num_layers)]
        self.biases = [getattr(self, f"bias_{i}") for i in range(self.num_layers)] if self.bias else []
        return self

    def reset_parameters(self) -> None:
        """Apex's init: weights normal(0, sqrt(2/(fan_in+fan_out))), biases normal(0, sqrt(1/fan_out))."""
        with torch.no_grad():
            for w in self.weights:
                nn.init.normal_(w, 0.0, math.sqrt(2.0 / float(w.size(0) + w.size(1))))
            for b in self.biases:
                nn.init.normal_(b, 0.0, math.sqrt(1.0 / float(b.size(0))))

    def forward(self, input: Tensor) -> Tensor:
        return mlp_function(self.bias, self.activation, input, *self.weights, *self.biases)

    def extra_repr(self) -> str:
        return f"MLP sizes: {self.mlp_sizes}, Bias={self.bias}, activation={self.activation}"
