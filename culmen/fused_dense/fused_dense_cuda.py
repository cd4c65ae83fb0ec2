"""Apex's compiled ``fused_dense_cuda`` extension (and flash_attn's ``fused_dense_lib``), in Python.

``culmen.compat`` maps ``import fused_dense_cuda`` and ``import fused_dense_lib`` here. Inputs are 2-D
``(batch, features)``; weights ``(out, in)``.

Apex's ops: ``linear_bias_forward``, ``linear_bias_backward``, ``linear_gelu_linear_forward``,
``linear_gelu_linear_backward`` (exact GELU, see ``culmen.fused_dense``). flash_attn's:
``linear_bias_wgrad``, ``linear_act_forward``, ``bias_act_linear_dgrad_bgrad`` (GELU there is the tanh
approximation, as flash_attn's cuBLASLt epilogue; ``heuristic`` is accepted and ignored).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.activations.op import act_bwd, act_fwd


def _mm_bias(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return torch.mm(x, w.t()) if b is None else torch.addmm(b, x, w.t())


@torch.no_grad()
def linear_bias_forward(input: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``input @ weight^T + bias``, the product rounded to the input dtype before the bias add (Apex's
    ``FusedDense`` numerics, see ``culmen.fused_dense``)."""
    return torch.mm(input, weight.t()).add_(bias)


@torch.no_grad()
def linear_bias_backward(input: Tensor, weight: Tensor, d_output: Tensor) -> list[Tensor]:
    """``[d_input, d_weight, d_bias]``."""
    return [torch.mm(d_output, weight), torch.mm(d_output.t(), input), d_output.sum(0)]


@torch.no_grad()
def linear_gelu_linear_forward(input: Tensor, weight1: Tensor, bias1: Tensor, weight2: Tensor, bias2: Tensor
                               ) -> list[Tensor]:
    """``[output1 = gelu(gelu_in), output2 = output1 @ weight2^T + bias2, gelu_in = input @ weight1^T + bias1]``
    (each product rounded to the input dtype before its bias add, as ``culmen.fused_dense``)."""
    gelu_in = torch.mm(input, weight1.t()).add_(bias1)
    output1 = act_fwd(gelu_in, None, "gelu")
    return [output1, torch.mm(output1, weight2.t()).add_(bias2), gelu_in]


@torch.no_grad()
def linear_gelu_linear_backward(input: Tensor, gelu_in: Tensor, output1: Tensor, weight1: Tensor, weight2: Tensor,
                                d_output2: Tensor) -> list[Tensor]:
    """``[d_input, d_weight1, d_bias1, d_weight2, d_bias2]``."""
    d_out1 = torch.mm(d_output2, weight2)
    d_pre, d_bias1, _ = act_bwd(d_out1, gelu_in, None, "gelu", dbias_dtype=weight1.dtype, inplace=True)
    return [torch.mm(d_pre, weight1), torch.mm(d_pre.t(), input), d_bias1, torch.mm(d_output2.t(), output1),
            d_output2.sum(0)]


@torch.no_grad()
def linear_bias_wgrad(input: Tensor, d_output: Tensor, has_d_bias: bool) -> list[Tensor | None]:
    """flash_attn: ``[d_weight = d_output^T @ input, d_bias = column sums of d_output (or None)]``."""
    return [torch.mm(d_output.t(), input), d_output.sum(0) if has_d_bias else None]


@torch.no_grad()
def linear_act_forward(input: Tensor, weight: Tensor, bias: Tensor | None, is_gelu: bool, save_pre_act: bool,
                       heuristic: int = 0) -> list[Tensor]:
    """flash_attn: ``[act(pre_act), pre_act]`` (``[act(pre_act)]`` without ``save_pre_act``); act is the
    tanh GELU when ``is_gelu``, else ReLU. The pre-activation is stored in full (not as a bit-mask)."""
    pre = _mm_bias(input, weight, bias)
    out = act_fwd(pre, None, "gelu_tanh" if is_gelu else "relu")
    return [out, pre] if save_pre_act else [out]


@torch.no_grad()
def bias_act_linear_dgrad_bgrad(weight: Tensor, d_output: Tensor, pre_act: Tensor, is_gelu: bool,
                                heuristic: int = 0) -> list[Tensor]:
    """flash_attn: ``[d_pre_act = (d_output @ weight) * act'(pre_act), d_bias = its column sums]``."""
    d_in = torch.mm(d_output, weight)
    d_pre, d_bias, _ = act_bwd(d_in, pre_act, None, "gelu_tanh" if is_gelu else "relu",
                               dbias_dtype=pre_act.dtype, inplace=True)
    return [d_pre, d_bias]
