"""Apex's compiled ``mlp_cuda`` extension, in Python (``culmen.compat`` maps ``import mlp_cuda`` here).

* ``forward(use_bias, activation, inputs) -> [output, reserved_space]``
* ``backward(use_bias, activation, grad_o, fprop_outputs, inputs) -> [d_input, *d_weights, *d_biases]``

``inputs`` is ``[input (batch, in), *weights, *biases]``; ``activation`` 0 none, 1 relu, 2 sigmoid.
``reserved_space`` is culmen's own layout (every layer's output, flattened and concatenated), only
meaningful to ``backward``. As in Apex, ``d_input`` is computed only when ``input.requires_grad``
(zeros otherwise, where Apex leaves the memory unwritten).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.activations.dense import mlp_backward, mlp_forward

_ACT_NAMES = {0: "none", 1: "relu", 2: "sigmoid"}


def _split(use_bias: int, inputs) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    inputs = list(inputs)
    n = (len(inputs) - 1) // 2 if use_bias else len(inputs) - 1
    return inputs[0], inputs[1:1 + n], (inputs[1 + n:1 + 2 * n] if use_bias else [])


def _act(activation: int) -> str:
    if activation not in _ACT_NAMES:
        raise ValueError(f"activation must be 0 (none), 1 (relu) or 2 (sigmoid), got {activation!r}")
    return _ACT_NAMES[activation]


def forward(use_bias: int, activation: int, inputs) -> list[Tensor]:
    """Run the MLP; returns ``[output (batch, out), reserved_space (1-D)]``."""
    x, weights, biases = _split(use_bias, inputs)
    if x.dim() != 2:
        raise ValueError(f"mlp_cuda.forward needs a 2-D input (batch, features), got shape {tuple(x.shape)}")
    with torch.no_grad():
        outs = mlp_forward(x, weights, biases, _act(activation))
        reserved = torch.cat([o.reshape(-1) for o in outs])
    return [outs[-1], reserved]


def backward(use_bias: int, activation: int, grad_o: Tensor, fprop_outputs, inputs) -> list[Tensor]:
    """Gradients ``[d_input, *d_weights, *d_biases]`` from ``forward``'s ``fprop_outputs``."""
    x, weights, biases = _split(use_bias, inputs)
    batch = x.shape[0]
    reserved = fprop_outputs[1]
    outs, off = [], 0
    for w in weights:
        n = batch * w.shape[0]
        outs.append(reserved[off:off + n].view(batch, w.shape[0]))
        off += n
    with torch.no_grad():
        dx, dws, dbs = mlp_backward(grad_o, x, weights, outs, _act(activation), bool(use_bias),
                                    bool(x.requires_grad))
    if dx is None:
        dx = torch.zeros_like(x)
    return [dx, *dws, *(dbs if use_bias else [])]
