"""flash_attn 2.8's ``flash_attn.modules.mlp`` on culmen: ``Mlp``, ``GatedMlp`` and their tensor-parallel
forms ``ParallelMLP`` / ``ParallelGatedMlp`` (``fc1`` / ``fc2`` parameter names, as flash_attn's, so its
checkpoints load). ``FusedMLP`` / ``ParallelFusedMLP`` (culmen's fused GEMM + activation) are re-exported
from ``culmen.flash_attn.ops.fused_dense``, as flash_attn's module imports them.

``GatedMlp`` computes ``fc2(y * act(gate))`` with ``y, gate = fc1(x).chunk(2, -1)``; ``activation=F.sigmoid``
is a GLU (``F.glu``), ``activation=F.silu`` SwiGLU through culmen's fused ``swiglu`` kernel (one pass forward
and backward, reading the two halves of ``fc1``'s output in place); any other callable is applied as is.

In the parallel forms each rank holds its shard of ``fc1``'s rows and ``fc2``'s columns. For the gated
ones a rank's ``fc1`` rows are ``[y rows | gate rows]`` of its own hidden units (flash_attn's model
sharding helpers lay checkpoints out that way); its ``chunk(2, -1)`` then splits them locally.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from culmen.flash_attn.ops.activations import swiglu
from culmen.flash_attn.ops.fused_dense import ColumnParallelLinear, FusedMLP, ParallelFusedMLP, RowParallelLinear

__all__ = ["FusedMLP", "GatedMlp", "Mlp", "ParallelFusedMLP", "ParallelGatedMlp", "ParallelMLP"]


def _hidden(in_features: int, hidden_features: int | None, default: int) -> int:
    hidden = default if hidden_features is None else hidden_features
    if hidden <= 0:
        raise ValueError(f"hidden_features must be positive, got {hidden_features!r} (in_features={in_features})")
    return hidden


def _gated_hidden(in_features: int, hidden_features: int | None, multiple_of: int) -> int:
    if multiple_of <= 0:
        raise ValueError(f"multiple_of must be a positive int, got {multiple_of!r}")
    hidden = _hidden(in_features, hidden_features, int(8 * in_features / 3))
    return (hidden + multiple_of - 1) // multiple_of * multiple_of


def _gate(y: Tensor, activation: Callable, fused_silu: bool) -> Tensor:
    """``y[..., :h] * activation(y[..., h:])`` of ``fc1``'s output ``(..., 2h)``."""
    if activation is F.sigmoid:
        return F.glu(y, dim=-1)
    value, gate = y.chunk(2, dim=-1)
    if fused_silu and activation is F.silu:
        return swiglu(gate, value)
    return value * activation(gate)


class Mlp(nn.Module):
    """``fc2(activation(fc1(x)))``.

    Args:
        in_features: input width. hidden_features: default ``4 * in_features``.
        out_features: default ``in_features``. activation: elementwise callable (default ``F.gelu``).
        bias1, bias2: biases of ``fc1`` / ``fc2``. return_residual: ``forward`` returns ``(out, x)``.
        device, dtype: factory kwargs.

    ``forward(x)``: ``(..., in)`` -> ``(..., out)``.
    """

    def __init__(self, in_features: int, hidden_features: int | None = None, out_features: int | None = None,
                 activation: Callable = F.gelu, bias1: bool = True, bias2: bool = True, return_residual: bool = False,
                 device=None, dtype=None) -> None:
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        out_features = in_features if out_features is None else out_features
        hidden_features = _hidden(in_features, hidden_features, 4 * in_features)
        self.return_residual = return_residual
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias1, **factory)
        self.activation = activation
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory)

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        y = self.fc2(self.activation(self.fc1(x)))
        return (y, x) if self.return_residual else y


class ParallelMLP(nn.Module):
    """Tensor-parallel ``Mlp``: ``fc1`` a ``ColumnParallelLinear``, ``fc2`` a ``RowParallelLinear``.

    Args: as ``Mlp`` (no ``return_residual``), plus process_group (required) and sequence_parallel (the
    input and output are this rank's rows of the flattened tokens; else whole and replicated).
    """

    def __init__(self, in_features: int, hidden_features: int | None = None, out_features: int | None = None,
                 activation: Callable = F.gelu, process_group: ProcessGroup | None = None,
                 sequence_parallel: bool = True, bias1: bool = True, bias2: bool = True, device=None,
                 dtype=None) -> None:
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        if process_group is None:
            raise ValueError("ParallelMLP needs a process_group")
        out_features = in_features if out_features is None else out_features
        hidden_features = _hidden(in_features, hidden_features, 4 * in_features)
        self.fc1 = ColumnParallelLinear(in_features, hidden_features, process_group, bias=bias1,
                                        sequence_parallel=sequence_parallel, **factory)
        self.activation = activation
        self.fc2 = RowParallelLinear(hidden_features, out_features, process_group, bias=bias2,
                                     sequence_parallel=sequence_parallel, **factory)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.activation(self.fc1(x)))


class GatedMlp(nn.Module):
    """``fc2(y * activation(gate))`` with ``y, gate = fc1(x).chunk(2, -1)`` (GLU, SwiGLU, GeGLU, ...).

    Args:
        in_features: input width. hidden_features: default ``int(8 * in_features / 3)``, then rounded
            up to a multiple of ``multiple_of`` (default 128); ``fc1`` has ``2 * hidden`` outputs.
        out_features: default ``in_features``. activation: ``F.sigmoid`` (GLU, the default), ``F.silu``
            (SwiGLU, fused kernel) or any elementwise callable.
        bias1, bias2, return_residual, device, dtype: as ``Mlp``.
    """

    def __init__(self, in_features: int, hidden_features: int | None = None, out_features: int | None = None,
                 activation: Callable = F.sigmoid, bias1: bool = True, bias2: bool = True, multiple_of: int = 128,
                 return_residual: bool = False, device=None, dtype=None) -> None:
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        out_features = in_features if out_features is None else out_features
        hidden_features = _gated_hidden(in_features, hidden_features, multiple_of)
        self.return_residual = return_residual
        self.fc1 = nn.Linear(in_features, 2 * hidden_features, bias=bias1, **factory)
        self.activation = activation
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory)

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        y = self.fc2(_gate(self.fc1(x), self.activation, True))
        return (y, x) if self.return_residual else y


class ParallelGatedMlp(nn.Module):
    """Tensor-parallel ``GatedMlp`` (see the module docstring for the layout of a rank's ``fc1`` rows).

    Args: as ``GatedMlp`` (no ``return_residual``), with process_group second, plus sequence_parallel.
    """

    def __init__(self, in_features: int, process_group: ProcessGroup, hidden_features: int | None = None,
                 out_features: int | None = None, activation: Callable = F.sigmoid, bias1: bool = True,
                 bias2: bool = True, multiple_of: int = 128, sequence_parallel: bool = True, device=None,
                 dtype=None) -> None:
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        if process_group is None:
            raise ValueError("ParallelGatedMlp needs a process_group")
        out_features = in_features if out_features is None else out_features
        hidden_features = _gated_hidden(in_features, hidden_features, multiple_of)
        # Dealt in pairs (one y row with its gate row), so every rank's fc1 shard splits into equal halves
        # that match its fc2 columns also when the hidden units do not split evenly.
        self.fc1 = ColumnParallelLinear(in_features, 2 * hidden_features, process_group, bias=bias1,
                                        sequence_parallel=sequence_parallel, multiple_of=2, **factory)
        self.activation = activation
        self.fc2 = RowParallelLinear(hidden_features, out_features, process_group, bias=bias2,
                                     sequence_parallel=sequence_parallel, **factory)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(_gate(self.fc1(x), self.activation, True))
