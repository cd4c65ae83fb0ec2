"""Pure-PyTorch references of the activation ops: the test oracle and the CPU path.

``act_ref`` / ``act_grad_ref`` / ``glu_ref`` compute in the dtype of their inputs (run on float64
copies they are the oracle; in bf16 they are PyTorch's own low-precision baseline). The ``*_fwd_ref`` /
``*_bwd_ref`` functions are what the ops run on CPU: they compute in fp32 (fp64 for fp64 inputs) and
return the input dtype, like the kernels.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

_K0 = math.sqrt(2.0 / math.pi)
_K1 = 0.044715


def act_ref(x: Tensor, act: str) -> Tensor:
    """``act(x)`` in ``x``'s dtype, from PyTorch's own functions where they exist."""
    if act == "none":
        return x.clone()
    if act in ("relu", "relu_ge0"):
        return F.relu(x)
    if act == "sigmoid":
        return torch.sigmoid(x)
    if act == "gelu":
        return F.gelu(x)
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act == "sqrelu":
        r = F.relu(x)
        return r * r
    if act == "silu":
        return F.silu(x)
    raise ValueError(f"unknown activation {act!r}")


def act_grad_ref(x: Tensor, act: str) -> Tensor:
    """``act'(x)`` in ``x``'s dtype (closed forms; the tests check them against autograd of ``act_ref``)."""
    if act == "none":
        return torch.ones_like(x)
    if act == "relu":
        return (x > 0).to(x.dtype)
    if act == "relu_ge0":
        return (x >= 0).to(x.dtype)
    if act == "sigmoid":
        s = torch.sigmoid(x)
        return s * (1 - s)
    if act == "gelu":
        return 0.5 * (1 + torch.erf(x * (1 / math.sqrt(2)))) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    if act == "gelu_tanh":
        t = torch.tanh(_K0 * (x + _K1 * x * x * x))
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _K0 * (1 + 3 * _K1 * x * x)
    if act == "sqrelu":
        return 2 * F.relu(x)
    if act == "silu":
        s = torch.sigmoid(x)
        return s * (1 + x * (1 - s))
    raise ValueError(f"unknown activation {act!r}")


def grad_from_output_ref(y: Tensor, act: str) -> Tensor:
    """``act'`` through the output ``y = act(x)``, for none / relu / sigmoid."""
    if act == "none":
        return torch.ones_like(y)
    if act == "sigmoid":
        return y * (1 - y)
    if act in ("relu", "relu_ge0"):
        return (y > 0).to(y.dtype)
    raise ValueError(f"act' from the output is not defined for {act!r}")


def glu_ref(x: Tensor, u: Tensor, act: str) -> Tensor:
    """``act(x) * u`` in the inputs' dtype."""
    return act_ref(x, act) * u


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def act_fwd_ref(x: Tensor, bias: Tensor | None, act: str) -> Tensor:
    """CPU path of ``act_fwd``: ``act(x + bias)`` in fp32, returned in ``x``'s dtype (a fresh tensor)."""
    cd = _compute_dtype(x.dtype)
    h = x.to(cd)
    if bias is not None:
        h = h + bias.to(cd)
    # Contiguous, as the kernels' outputs and the custom ops' fake impls.
    return act_ref(h, act).to(x.dtype).contiguous()


def act_bwd_ref(g: Tensor, x: Tensor, bias: Tensor | None, act: str, from_output: bool, want_dbias: bool,
                dbias_dtype: torch.dtype, store_out: bool = False
                ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """CPU path of ``act_bwd``: ``(dx, dbias, y)``, see ``launch.act_bwd``."""
    cd = _compute_dtype(x.dtype)
    h = x.to(cd)
    if bias is not None:
        h = h + bias.to(cd)
    d = grad_from_output_ref(h, act) if from_output else act_grad_ref(h, act)
    dx = g.to(cd) * d
    dbias = dx.reshape(-1, x.shape[-1]).sum(0).to(dbias_dtype) if want_dbias else None
    y = act_ref(h, act).to(x.dtype).contiguous() if (store_out and not from_output) else None
    return dx.to(x.dtype).contiguous(), dbias, y


def glu_fwd_ref(x: Tensor, u: Tensor, act: str) -> Tensor:
    """CPU path of ``glu_fwd``: ``act(x) * u`` in fp32, returned in ``x``'s dtype."""
    cd = _compute_dtype(x.dtype)
    return glu_ref(x.to(cd), u.to(cd), act).to(x.dtype).contiguous()


def glu_bwd_ref(g: Tensor, x: Tensor, u: Tensor, act: str) -> tuple[Tensor, Tensor]:
    """CPU path of ``glu_bwd``: ``(g * u * act'(x), g * act(x))`` in the dtypes of ``x`` and ``u``."""
    cd = _compute_dtype(x.dtype)
    xc, uc, gc = x.to(cd), u.to(cd), g.to(cd)
    return ((gc * uc * act_grad_ref(xc, act)).to(x.dtype).contiguous(),
            (gc * act_ref(xc, act)).to(u.dtype).contiguous())
