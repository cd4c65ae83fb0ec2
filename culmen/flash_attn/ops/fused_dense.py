"""``flash_attn.ops.fused_dense`` on culmen: ``FusedDense``, ``FusedMLP``, their functionals and the
tensor-parallel ``ColumnParallelLinear`` / ``RowParallelLinear`` / ``ParallelFusedMLP``.

GEMMs are cuBLAS (bias in the cuBLASLt epilogue; bias + ReLU too); the activation and its backward are
single Triton passes, the backward also reducing ``bias1``'s gradient (``culmen.ops.activations.dense``).
``activation``: ``gelu_approx`` (tanh GELU), ``relu``, ``sqrelu``. ``checkpoint_lvl``: 0 saves the
pre-activation and the activation output, 1 only the pre-activation (the output is recomputed inside
the fused backward pass), 2 neither (the first GEMM is redone). ReLU saves only its output at levels
0 and 1: its derivative needs nothing else.

With a ``process_group`` and ``sequence_parallel=True`` the input is all-gathered along dim 0 before the
first GEMM and the input gradient reduce-scattered; without sequence parallelism the input is already
whole and its gradient is all-reduced (as flash_attn). The collectives are differentiable functions
around the fused GEMMs, issued synchronously (flash_attn overlaps them with the weight-gradient GEMM).
On gloo, reduce-scatter is an all-reduce plus a slice.

Differences from flash_attn, on purpose: ``heuristic`` (cuBLASLt algorithm choice) is accepted and
ignored; every dtype and CPU tensors take the fused path (flash_attn falls back to ``F.linear`` outside
CUDA fp16/bf16, and then rejects ``process_group``); ``FusedMLPFunc`` / ``FusedDenseFunc`` expose
``apply`` with flash_attn's arguments but are compositions, not ``autograd.Function`` subclasses.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from culmen.flash_attn.utils.distributed import (
    AllGatherFunc,
    _all_reduce_copy,
    all_gather,
    all_reduce,
    get_dim_for_local_rank,
    reduce_scatter,
)
from culmen.normalization.fused_layer_norm import _autocast_off, _cast_if_autocast_enabled
from culmen.ops.activations.dense import checked_linear, linear_act_linear

__all__ = [
    "ColumnParallelLinear",
    "FusedDense",
    "FusedDenseFunc",
    "FusedMLP",
    "FusedMLPFunc",
    "ParallelFusedMLP",
    "RowParallelLinear",
    "all_gather",
    "all_reduce",
    "fused_dense_func",
    "fused_mlp_func",
    "reduce_scatter",
]

_MLP_ACTS = {"gelu_approx": "gelu_tanh", "relu": "relu", "sqrelu": "sqrelu"}


# ----------------------------------------------------------------------------- collectives (dim 0)
# The collectives live in culmen.flash_attn.utils.distributed (flash_attn's home for them); fused_dense
# re-exports all_gather / reduce_scatter / all_reduce as before.


class _CopyToRegion(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient (an input shared by every rank of the group)."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce_copy(g, ctx.pg), None


def _parallel_input(x: Tensor, pg: ProcessGroup | None, sequence_parallel: bool) -> Tensor:
    if pg is None:
        return x
    return AllGatherFunc.apply(x, pg) if sequence_parallel else _CopyToRegion.apply(x, pg)


# ------------------------------------------------------------------------------------- dense


def fused_dense_func(x: Tensor, weight: Tensor, bias: Tensor | None = None, return_residual: bool = False,
                     process_group: ProcessGroup | None = None, sequence_parallel: bool = True):
    """``x @ weight^T + bias``: ``x`` ``(..., in)`` (local rows when sequence parallel), ``weight``
    ``(out, in)``. Returns ``(..., out)``, or ``(out, x)`` with ``return_residual``. The arguments are
    checked once per call signature."""
    device_type = x.device.type if isinstance(x, Tensor) else "cuda"
    if torch.is_autocast_enabled(device_type):
        x, weight, bias = _cast_if_autocast_enabled(device_type, x, weight, bias)
        with _autocast_off(device_type):
            out = _dense(x, weight, bias, process_group, sequence_parallel)
    else:
        out = _dense(x, weight, bias, process_group, sequence_parallel)
    return (out, x) if return_residual else out


def _dense(x, weight, bias, process_group, sequence_parallel):
    return checked_linear(_parallel_input(x, process_group, sequence_parallel), weight, bias, "x")


class FusedDenseFunc:
    """flash_attn's ``FusedDenseFunc.apply(x, weight, bias, return_residual=False, process_group=None,
    sequence_parallel=True)``."""

    @staticmethod
    def apply(x, weight, bias, return_residual=False, process_group=None, sequence_parallel=True):
        return fused_dense_func(x, weight, bias, return_residual, process_group, sequence_parallel)


class FusedDense(nn.Linear):
    """flash_attn's ``FusedDense(in_features, out_features, bias=True, return_residual=False, device=None,
    dtype=None)``: an ``nn.Linear`` whose ``forward(x, process_group=None)`` runs ``fused_dense_func``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, return_residual: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.return_residual = return_residual

    def forward(self, x: Tensor, process_group: ProcessGroup | None = None):
        return fused_dense_func(x, self.weight, self.bias, return_residual=self.return_residual,
                                process_group=process_group)


class ColumnParallelLinear(nn.Linear):
    """flash_attn's ``ColumnParallelLinear(in_features, out_features, process_group, bias=True,
    sequence_parallel=True, multiple_of=1, device=None, dtype=None)``: this rank holds its share of the
    weight's rows, dealt in blocks of ``multiple_of`` (the first ranks take one block more when the
    blocks do not split evenly, see ``get_dim_for_local_rank``); the (sequence-parallel) input is
    gathered first."""

    def __init__(self, in_features: int, out_features: int, process_group: ProcessGroup, bias: bool = True,
                 sequence_parallel: bool = True, multiple_of: int = 1, device=None, dtype=None) -> None:
        world = dist.get_world_size(process_group)
        if multiple_of <= 0 or out_features % multiple_of:
            raise ValueError(f"out_features ({out_features}) must be a multiple of multiple_of ({multiple_of})")
        local = get_dim_for_local_rank(out_features, world, dist.get_rank(process_group), multiple_of)
        super().__init__(in_features, local, bias=bias, device=device, dtype=dtype)
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        return fused_dense_func(x, self.weight, self.bias, process_group=self.process_group,
                                sequence_parallel=self.sequence_parallel)


class RowParallelLinear(nn.Linear):
    """flash_attn's ``RowParallelLinear(in_features, out_features, process_group, bias=True,
    sequence_parallel=True, multiple_of=1, device=None, dtype=None)``: this rank holds its share of the
    weight's columns, dealt in blocks of ``multiple_of`` as in ``ColumnParallelLinear`` (the bias lives
    on rank 0); the partial outputs are reduce-scattered (sequence parallel) or all-reduced."""

    def __init__(self, in_features: int, out_features: int, process_group: ProcessGroup, bias: bool = True,
                 sequence_parallel: bool = True, multiple_of: int = 1, device=None, dtype=None) -> None:
        world = dist.get_world_size(process_group)
        rank = dist.get_rank(process_group)
        if multiple_of <= 0 or in_features % multiple_of:
            raise ValueError(f"in_features ({in_features}) must be a multiple of multiple_of ({multiple_of})")
        local = get_dim_for_local_rank(in_features, world, rank, multiple_of)
        super().__init__(local, out_features, bias=bias and rank == 0, device=device, dtype=dtype)
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        out = fused_dense_func(x, self.weight, self.bias)
        return (reduce_scatter if self.sequence_parallel else all_reduce)(out, self.process_group)


# --------------------------------------------------------------------------------------- MLP


def _check_mlp_args(activation: str, checkpoint_lvl: int, heuristic) -> None:
    if activation not in _MLP_ACTS:
        raise ValueError(f"activation must be one of {list(_MLP_ACTS)}, got {activation!r}")
    if checkpoint_lvl not in (0, 1, 2):
        raise ValueError(f"checkpoint_lvl must be 0, 1 or 2, got {checkpoint_lvl!r}")
    if heuristic != "auto" and not (isinstance(heuristic, int) and -1 <= heuristic <= 4):
        raise ValueError(f"heuristic must be 'auto' or an int in [-1, 4], got {heuristic!r}")


def fused_mlp_func(x: Tensor, weight1: Tensor, weight2: Tensor, bias1: Tensor | None = None,
                   bias2: Tensor | None = None, activation: str = "gelu_approx", save_pre_act: bool = True,
                   return_residual: bool = False, checkpoint_lvl: int = 0, heuristic=0,
                   process_group: ProcessGroup | None = None, sequence_parallel: bool = True):
    """``act(x @ weight1^T + bias1) @ weight2^T + bias2``.

    Args:
        x: ``(..., in)``; weight1 ``(hidden, in)``; weight2 ``(out, hidden)``; biases or None; one dtype
            (under autocast everything is cast to the autocast dtype).
        activation: ``gelu_approx`` / ``relu`` / ``sqrelu``.
        save_pre_act: False forces ``checkpoint_lvl=2`` (as flash_attn; modules pass ``self.training``).
        checkpoint_lvl: 0 / 1 / 2, see the module docstring. heuristic: accepted, ignored.
        process_group / sequence_parallel: tensor parallelism, see the module docstring (the output is
            this rank's partial sum; ``FusedMLP`` reduce-scatters it).

    Returns ``(..., out)``, or ``(out, x)`` with ``return_residual``.
    """
    _check_mlp_args(activation, checkpoint_lvl, heuristic)
    if not save_pre_act:
        checkpoint_lvl = 2
    act = _MLP_ACTS[activation]
    device_type = x.device.type if isinstance(x, Tensor) else "cuda"
    if torch.is_autocast_enabled(device_type):
        x, weight1, bias1, weight2, bias2 = _cast_if_autocast_enabled(device_type, x, weight1, bias1, weight2, bias2)
        with _autocast_off(device_type):
            out = linear_act_linear(_parallel_input(x, process_group, sequence_parallel), weight1, bias1, weight2,
                                    bias2, act, checkpoint_lvl, "x")
    else:
        xin = x if process_group is None else _parallel_input(x, process_group, sequence_parallel)
        out = linear_act_linear(xin, weight1, bias1, weight2, bias2, act, checkpoint_lvl, "x")
    return (out, x) if return_residual else out


class FusedMLPFunc:
    """flash_attn's ``FusedMLPFunc.apply(x, weight1, bias1, weight2, bias2, activation='gelu_approx',
    save_pre_act=True, return_residual=False, checkpoint_lvl=0, heuristic=0, process_group=None,
    sequence_parallel=True)`` (note: biases interleaved with the weights, unlike ``fused_mlp_func``)."""

    @staticmethod
    def apply(x, weight1, bias1, weight2, bias2, activation="gelu_approx", save_pre_act=True, return_residual=False,
              checkpoint_lvl=0, heuristic=0, process_group=None, sequence_parallel=True):
        return fused_mlp_func(x, weight1, weight2, bias1, bias2, activation, save_pre_act, return_residual,
                              checkpoint_lvl, heuristic, process_group, sequence_parallel)


class FusedMLP(nn.Module):
    """flash_attn's ``FusedMLP(in_features, hidden_features=None, out_features=None, bias1=True, bias2=True,
    activation='gelu_approx', return_residual=False, checkpoint_lvl=0, heuristic='auto', device=None,
    dtype=None)``: ``fc2(act(fc1(x)))`` with ``fc1``/``fc2`` ``nn.Linear``.

    ``hidden_features`` defaults to ``4 * in_features``, ``out_features`` to ``in_features``.
    ``forward(x, process_group=None)``: input ``(..., in)``, output ``(..., out)`` (``(out, x)`` with
    ``return_residual``); with a process group the output is reduce-scattered.
    """

    def __init__(self, in_features: int, hidden_features: int | None = None, out_features: int | None = None,
                 bias1: bool = True, bias2: bool = True, activation: str = "gelu_approx",
                 return_residual: bool = False, checkpoint_lvl: int = 0, heuristic="auto", device=None,
                 dtype=None) -> None:
        _check_mlp_args(activation, checkpoint_lvl, heuristic)
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        hidden_features = hidden_features if hidden_features is not None else 4 * in_features
        out_features = out_features if out_features is not None else in_features
        self.activation = activation
        self.return_residual = return_residual
        self.checkpoint_lvl = checkpoint_lvl
        self.heuristic = heuristic if activation != "sqrelu" else -1
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias1, **factory)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory)

    def forward(self, x: Tensor, process_group: ProcessGroup | None = None):
        out = fused_mlp_func(x, self.fc1.weight, self.fc2.weight, self.fc1.bias, self.fc2.bias,
                             activation=self.activation, save_pre_act=self.training,
                             return_residual=self.return_residual, checkpoint_lvl=self.checkpoint_lvl,
                             process_group=process_group)
        if self.return_residual:
            out, x = out
        if process_group is not None:
            out = reduce_scatter(out, process_group)
        return (out, x) if self.return_residual else out


class ParallelFusedMLP(nn.Module):
    """flash_attn's ``ParallelFusedMLP(in_features, hidden_features=None, out_features=None,
    activation='gelu_approx', process_group=None, bias1=True, bias2=True, sequence_parallel=True,
    checkpoint_lvl=0, heuristic='auto', device=None, dtype=None)``: ``fc1`` column-parallel, ``fc2``
    row-parallel; ``process_group`` is required."""

    def __init__(self, in_features: int, hidden_features: int | None = None, out_features: int | None = None,
                 activation: str = "gelu_approx", process_group: ProcessGroup | None = None, bias1: bool = True,
                 bias2: bool = True, sequence_parallel: bool = True, checkpoint_lvl: int = 0, heuristic="auto",
                 device=None, dtype=None) -> None:
        _check_mlp_args(activation, checkpoint_lvl, heuristic)
        if process_group is None:
            raise ValueError("ParallelFusedMLP needs a process_group")
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        hidden_features = hidden_features if hidden_features is not None else 4 * in_features
        out_features = out_features if out_features is not None else in_features
        self.activation = activation
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel
        self.checkpoint_lvl = checkpoint_lvl
        self.heuristic = heuristic if activation != "sqrelu" else -1
        self.fc1 = ColumnParallelLinear(in_features, hidden_features, process_group, bias=bias1, **factory)
        self.fc2 = RowParallelLinear(hidden_features, out_features, process_group, bias=bias2, **factory)

    def forward(self, x: Tensor) -> Tensor:
        out = fused_mlp_func(x, self.fc1.weight, self.fc2.weight, self.fc1.bias, self.fc2.bias,
                             activation=self.activation, save_pre_act=self.training,
                             checkpoint_lvl=self.checkpoint_lvl, process_group=self.process_group,
                             sequence_parallel=self.sequence_parallel)
        return (reduce_scatter if self.sequence_parallel else all_reduce)(out, self.process_group)
