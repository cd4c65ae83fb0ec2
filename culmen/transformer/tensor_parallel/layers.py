"""Tensor-parallel layers of ``apex.transformer.tensor_parallel.layers``.

``ColumnParallelLinear`` splits the weight's output rows across the tensor-parallel (TP) ranks,
``RowParallelLinear`` its input columns, ``VocabParallelEmbedding`` the vocabulary. The linear layers
run ``LinearWithGradAccumulationAndAsyncCommunication``, whose backward

* starts the input-gradient all-reduce (column layer) or reduce-scatter (sequence parallelism)
  asynchronously and computes the weight gradient while it is in flight;
* with ``gradient_accumulation_fusion``, adds the weight gradient straight into ``weight.main_grad``
  (fp32, or the 16-bit dtype of ``main_grad``) with one cuBLAS ``addmm`` (fp32 output accumulation of
  16-bit inputs through ``addmm``'s ``out_dtype`` on CUDA; an fp32 ``addmm_`` of the upcast operands
  elsewhere) instead of materialising ``weight.grad``, as Apex's ``fused_weight_gradient_mlp_cuda`` does.

With sequence parallelism the activations outside the TP region are split along the sequence (first)
dimension: the column layer all-gathers its input, the row layer reduce-scatters its output.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.nn.init as init
from torch import Tensor
from torch.nn.parameter import Parameter

from culmen.ops.common.collectives import all_gather_raw, reduce_scatter_raw
from culmen.transformer import parallel_state
from culmen.transformer.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from culmen.transformer.tensor_parallel.random import get_cuda_rng_tracker
from culmen.transformer.tensor_parallel.utils import VocabUtility, divide

__all__ = [
    "ColumnParallelLinear",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_tensor_model_parallel_attributes",
    "linear_with_grad_accumulation_and_async_allreduce",
    "linear_with_grad_accumulation_and_async_allreduce_in16bit",
    "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
]

# Always available: culmen needs no extension for the fused weight-gradient accumulation.
_grad_accum_fusion_available = True

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}


class TensorParallelConfigError(ValueError, RuntimeError):
    """An invalid combination of layer options. A ``ValueError`` (culmen's convention) and a
    ``RuntimeError`` (what Apex raises for the same cases)."""


# ------------------------------------------------------------------------------ attribute helpers


def param_is_not_tensor_parallel_duplicate(param: Tensor) -> bool:
    """True for a sharded parameter, or for a replicated one on TP rank 0 (count each weight once)."""
    return bool(getattr(param, "tensor_model_parallel", False)) or \
        parallel_state.get_tensor_model_parallel_rank() == 0


def set_tensor_model_parallel_attributes(tensor: Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """Mark ``tensor`` as (not) sharded along ``dim`` with ``stride``. ``ValueError`` if already marked."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(tensor, attribute):
            raise ValueError(f"tensor already has the tensor-parallel attribute {attribute!r}")
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: Tensor) -> None:
    """Give ``tensor`` the defaults (not parallel, dim -1, stride 1) for the attributes it lacks."""
    for attribute, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, value)


def copy_tensor_model_parallel_attributes(destination_tensor: Tensor, source_tensor: Tensor) -> None:
    """Copy the tensor-parallel attributes ``source_tensor`` has onto ``destination_tensor``."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, attribute):
            setattr(destination_tensor, attribute, getattr(source_tensor, attribute))


# ------------------------------------------------------------------------------ initialization


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _initialize_affine_weight_gpu(weight: Tensor, init_method: Callable[[Tensor], object], partition_dim: int,
                                  stride: int = 1) -> None:
    """Initialize the local shard directly, with the tracker's per-TP-rank RNG state."""
    set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=stride)
    with get_cuda_rng_tracker().fork():
        init_method(weight)


def _initialize_affine_weight_cpu(weight: Tensor, output_size: int, input_size: int, per_partition_size: int,
                                  partition_dim: int, init_method: Callable[[Tensor], object], stride: int = 1,
                                  return_master_weight: bool = False, *,
                                  params_dtype: torch.dtype = torch.float32) -> Tensor | None:
    """Initialize the full ``(output_size, input_size)`` fp32 weight on the CPU (the same on every rank
    given the same seed) and copy this rank's strided shard into ``weight``."""
    set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=stride)
    master_weight = torch.empty(output_size, input_size, dtype=torch.float, requires_grad=False)
    init_method(master_weight)
    master_weight = master_weight.to(dtype=params_dtype)
    per_partition_per_stride_size = divide(per_partition_size, stride)
    weight_list = torch.split(master_weight, per_partition_per_stride_size, dim=partition_dim)
    rank = parallel_state.get_tensor_model_parallel_rank()
    world_size = parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        weight.copy_(torch.cat(weight_list[rank::world_size], dim=partition_dim))
    return master_weight if return_master_weight else None


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


# ------------------------------------------------------------------------------ vocab embedding


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding whose ``num_embeddings`` rows are split evenly across the TP ranks.

    Args:
        num_embeddings: vocabulary size (divisible by the TP size: ``ValueError`` naming both otherwise).
        embedding_dim: hidden size.
        init_method: initializes the weight in place (default ``xavier_normal_``).
        params_dtype: the weight's dtype.
        use_cpu_initialization: build the full weight on the CPU and keep this rank's rows (identical
            to a single-process ``init_method`` under the same seed); else initialize the shard on the
            device under ``get_cuda_rng_tracker().fork()``.

    ``forward(input_)``: integer ids ``(...)`` -> ``(..., embedding_dim)`` in ``params_dtype``; ids
    outside this rank's range contribute zeros, and the ranks' results are all-reduced.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 init_method: Callable[[Tensor], object] = init.xavier_normal_,
                 *, params_dtype: torch.dtype = torch.float32, use_cpu_initialization: bool = False) -> None:
        super().__init__()
        _check_positive("num_embeddings", num_embeddings)
        _check_positive("embedding_dim", embedding_dim)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        # torch.nn.Embedding's defaults, for code that reads them.
        self.padding_idx = None
        self.max_norm = None
        self.norm_type = 2.0
        self.scale_grad_by_freq = False
        self.sparse = False
        self._weight = None
        self.tensor_model_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, parallel_state.get_tensor_model_parallel_rank(), self.tensor_model_parallel_size)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        device = None if use_cpu_initialization else _default_device()
        self.weight = Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype,
                                            device=device))
        if use_cpu_initialization:
            _initialize_affine_weight_cpu(self.weight, num_embeddings, embedding_dim,
                                          self.num_embeddings_per_partition, 0, init_method,
                                          params_dtype=params_dtype)
        else:
            _initialize_affine_weight_gpu(self.weight, init_method, partition_dim=0, stride=1)

    def forward(self, input_: Tensor) -> Tensor:
        if self.tensor_model_parallel_size > 1:
            input_mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            masked_input = (input_ - self.vocab_start_index).masked_fill_(input_mask, 0)
            output_parallel = F.embedding(masked_input, self.weight)
            output_parallel = output_parallel.masked_fill_(input_mask.unsqueeze(-1), 0.0)
            return reduce_from_tensor_model_parallel_region(output_parallel)
        return F.embedding(input_, self.weight)


# ------------------------------------------------------------------------------ linear autograd


# cuBLAS 16-bit x 16-bit -> fp32 accumulation into an fp32 tensor (addmm's out_dtype overload, CUDA
# only, torch >= 2.8). Switched off after the first failure, then the upcast addmm_ runs.
_ADDMM_DTYPE_OUT = getattr(torch.ops.aten.addmm, "dtype_out", None)


def _accumulate_wgrad(main_grad: Tensor, grad_output_2d: Tensor, input_2d: Tensor) -> None:
    """``main_grad += grad_output_2d.T @ input_2d`` in ``main_grad``'s precision (fp32 or 16-bit)."""
    global _ADDMM_DTYPE_OUT
    go_t = grad_output_2d.t()
    if go_t.dtype == main_grad.dtype and input_2d.dtype == main_grad.dtype:
        main_grad.addmm_(go_t, input_2d)
        return
    if (main_grad.dtype == torch.float32 and main_grad.is_cuda and _ADDMM_DTYPE_OUT is not None
            and go_t.dtype == input_2d.dtype and go_t.dtype in (torch.float16, torch.bfloat16)):
        try:
            _ADDMM_DTYPE_OUT(main_grad, go_t, input_2d, torch.float32, out=main_grad)
            return
        except (RuntimeError, NotImplementedError):
            _ADDMM_DTYPE_OUT = None
    main_grad.addmm_(go_t.to(main_grad.dtype), input_2d.to(main_grad.dtype))


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """``input @ weight.T + bias`` with Megatron's communication in backward (see the module docstring).

    ``input (..., in)`` (with sequence parallelism: this rank's ``(s / tp, ...)`` rows, all-gathered to
    ``(s, ..., in)`` first), ``weight (out, in)``, ``bias (out,)`` or None.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, async_grad_allreduce,
                sequence_parallel_enabled, use_16bit_in_wgrad_accum_fusion=None):
        ctx.use_bias = bias is not None and weight.requires_grad
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.async_grad_allreduce = async_grad_allreduce
        ctx.sequence_parallel_enabled = sequence_parallel_enabled
        ctx.compute_weight_gradient = weight.requires_grad
        if ctx.compute_weight_gradient:
            ctx.save_for_backward(input, weight)  # the local rows only: backward re-gathers them
        else:
            ctx.save_for_backward(weight)
        if sequence_parallel_enabled:
            total_input, _ = all_gather_raw(input, parallel_state.get_tensor_model_parallel_group())
        else:
            total_input = input
        return F.linear(total_input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.compute_weight_gradient:
            input, weight = ctx.saved_tensors
        else:
            (weight,) = ctx.saved_tensors
            input = None
        sp = ctx.sequence_parallel_enabled
        group = parallel_state.get_tensor_model_parallel_group() if (sp or ctx.async_grad_allreduce) else None

        gather_handle = None
        total_input = input
        if sp and ctx.compute_weight_gradient:
            # The weight gradient needs the full input again; gather it while the input gradient runs.
            total_input, gather_handle = all_gather_raw(input, group, async_op=True)

        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None

        comm_handle = None
        if grad_input is not None:
            if sp:
                grad_input, comm_handle = reduce_scatter_raw(grad_input, group, async_op=True)
            elif ctx.async_grad_allreduce:
                comm_handle = dist.all_reduce(grad_input, group=group, async_op=True)

        grad_weight = grad_bias = None
        if ctx.compute_weight_gradient:
            if gather_handle is not None:
                gather_handle.wait()
            go_2d = grad_output.reshape(-1, grad_output.shape[-1])
            x_2d = total_input.reshape(-1, total_input.shape[-1])
            if ctx.gradient_accumulation_fusion:
                main_grad = getattr(weight, "main_grad", None)
                if main_grad is None:
                    raise RuntimeError("gradient_accumulation_fusion needs weight.main_grad (an fp32 or 16-bit "
                                       "tensor of the weight's shape) set before backward")
                _accumulate_wgrad(main_grad, go_2d, x_2d)
            else:
                grad_weight = go_2d.t().matmul(x_2d)
            if ctx.use_bias:
                grad_bias = go_2d.sum(dim=0)

        if comm_handle is not None:
            comm_handle.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _autocast_args(input, weight, bias):
    """Apex's ``_cast_if_autocast_enabled``: under autocast, run the GEMMs in the autocast dtype."""
    dev = input.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        input, weight = input.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
        return True, input, weight, bias
    return False, input, weight, bias


def linear_with_grad_accumulation_and_async_allreduce(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    gradient_accumulation_fusion: bool,
    async_grad_allreduce: bool,
    sequence_parallel_enabled: bool,
) -> Tensor:
    """``LinearWithGradAccumulationAndAsyncCommunication`` (autocast-aware: inputs cast to the autocast
    dtype, the GEMMs then run with autocast off)."""
    autocast, input, weight, bias = _autocast_args(input, weight, bias)
    if autocast:
        with torch.autocast(input.device.type, enabled=False):
            return LinearWithGradAccumulationAndAsyncCommunication.apply(
                input, weight, bias, gradient_accumulation_fusion, async_grad_allreduce, sequence_parallel_enabled)
    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        input, weight, bias, gradient_accumulation_fusion, async_grad_allreduce, sequence_parallel_enabled)


def linear_with_grad_accumulation_and_async_allreduce_in16bit(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    gradient_accumulation_fusion: bool,
    async_grad_allreduce: bool,
    sequence_parallel_enabled: bool,
) -> Tensor:
    """Apex's 16-bit-accumulation variant. The accumulation precision now follows ``weight.main_grad``'s
    dtype (as in Apex's last release), so this is the same function."""
    return linear_with_grad_accumulation_and_async_allreduce(
        input, weight, bias, gradient_accumulation_fusion, async_grad_allreduce, sequence_parallel_enabled)


def _warn_accumulation_in_fp16(value) -> None:
    if value is not None:
        warnings.warn(f"Deprecated option `accumulation_in_fp16` is set to {value}: the accumulation "
                      "precision follows weight.main_grad's dtype", FutureWarning, stacklevel=3)


# ------------------------------------------------------------------------------ linear layers


class ColumnParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with ``A (output_size, input_size)`` split along its rows (the output features).

    Args:
        input_size, output_size: the full layer's sizes; ``output_size`` must divide by the TP size.
        bias: add a bias (sharded like the output, initialized to zero).
        gather_output: all-gather the output so every rank gets ``(..., output_size)``; else each rank
            returns its ``(..., output_size / tp)``.
        init_method: initializes the weight in place. stride: partition stride of a strided weight
            (e.g. fused QKV).
        keep_master_weight_for_test: with ``use_cpu_initialization``, keep the full weight in
            ``self.master_weight``.
        skip_bias_add: do not add the bias; return it as the second output (to fuse it later).
        no_async_tensor_model_parallel_allreduce: all-reduce the input gradient through
            ``copy_to_tensor_model_parallel_region`` instead of asynchronously inside the linear's backward.
        params_dtype: the parameters' dtype. use_cpu_initialization: see ``VocabParallelEmbedding``.
        gradient_accumulation_fusion: accumulate the weight gradient into ``weight.main_grad`` (which
            the caller sets up) instead of producing ``weight.grad``.
        accumulation_in_fp16: deprecated, ignored (the precision follows ``main_grad``'s dtype).
        sequence_parallel_enabled: the input is this rank's ``(s / tp, b, input_size)`` sequence shard;
            it is all-gathered in forward and the input gradient reduce-scattered in backward. Needs
            ``gather_output=False`` and ``no_async_tensor_model_parallel_allreduce=True``. Ignored with
            a warning for one TP rank.

    ``forward(input_)``: ``(s, b, input_size)`` (any leading dims without sequence parallelism) ->
    ``(output, output_bias)``; ``output_bias`` is the bias with ``skip_bias_add``, else None.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = True,
                 init_method: Callable[[Tensor], object] = init.xavier_normal_, stride: int = 1,
                 keep_master_weight_for_test: bool = False, skip_bias_add: bool = False, *,
                 no_async_tensor_model_parallel_allreduce: bool = False, params_dtype: torch.dtype = torch.float32,
                 use_cpu_initialization: bool = False, gradient_accumulation_fusion: bool = False,
                 accumulation_in_fp16: bool | None = None, sequence_parallel_enabled: bool = False) -> None:
        super().__init__()
        _check_positive("input_size", input_size)
        _check_positive("output_size", output_size)
        _warn_accumulation_in_fp16(accumulation_in_fp16)
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        self.output_size_per_partition = divide(output_size, world_size)
        self.skip_bias_add = skip_bias_add

        device = None if use_cpu_initialization else _default_device()
        self.weight = Parameter(torch.empty(self.output_size_per_partition, input_size, dtype=params_dtype,
                                            device=device))
        if use_cpu_initialization:
            self.master_weight = _initialize_affine_weight_cpu(
                self.weight, output_size, input_size, self.output_size_per_partition, 0, init_method,
                stride=stride, return_master_weight=keep_master_weight_for_test, params_dtype=params_dtype)
        else:
            _initialize_affine_weight_gpu(self.weight, init_method, partition_dim=0, stride=stride)
        if bias:
            self.bias = Parameter(torch.zeros(self.output_size_per_partition, dtype=params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)

        self.async_tensor_model_parallel_allreduce = not no_async_tensor_model_parallel_allreduce and world_size > 1
        if sequence_parallel_enabled and world_size <= 1:
            warnings.warn(f"`sequence_parallel_enabled` is set to `True`, but got world_size of {world_size}",
                          stacklevel=2)
            sequence_parallel_enabled = False
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        if self.async_tensor_model_parallel_allreduce and self.sequence_parallel_enabled:
            raise TensorParallelConfigError(
                "`async_tensor_model_parallel_allreduce` and `sequence_parallel_enabled` cannot be enabled at "
                "the same time (pass no_async_tensor_model_parallel_allreduce=True with sequence parallelism)")
        if self.sequence_parallel_enabled and gather_output:
            raise TensorParallelConfigError("gather_output=True cannot be used with sequence_parallel_enabled=True")
        self._copy_input = not (self.async_tensor_model_parallel_allreduce or self.sequence_parallel_enabled) \
            and world_size > 1
        self._gather = gather_output and world_size > 1
        self._forward_impl = linear_with_grad_accumulation_and_async_allreduce

    def forward(self, input_: Tensor) -> tuple[Tensor, Tensor | None]:
        bias = None if self.skip_bias_add else self.bias
        input_parallel = copy_to_tensor_model_parallel_region(input_) if self._copy_input else input_
        output = self._forward_impl(input_parallel, self.weight, bias, self.gradient_accumulation_fusion,
                                    self.async_tensor_model_parallel_allreduce, self.sequence_parallel_enabled)
        if self._gather:
            output = gather_from_tensor_model_parallel_region(output)
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with ``A (output_size, input_size)`` split along its columns (the input features).

    Args:
        input_size, output_size: the full layer's sizes; ``input_size`` must divide by the TP size.
        bias: add a (replicated) bias, initialized to zero.
        input_is_parallel: the input is already this rank's ``(..., input_size / tp)`` slice (the output
            of a ``ColumnParallelLinear`` with ``gather_output=False``); else it is scattered here.
        init_method, stride, keep_master_weight_for_test, skip_bias_add, params_dtype,
        use_cpu_initialization, gradient_accumulation_fusion, accumulation_in_fp16: as in
        ``ColumnParallelLinear``.
        sequence_parallel_enabled: reduce-scatter the output along the sequence (first) dimension
            instead of all-reducing it (needs ``input_is_parallel``). The bias is then added to each
            rank's rows and marked ``bias.sequence_parallel_enabled``: its gradient must be summed over
            the TP ranks (the optimizer's grad all-reduce does it in Megatron).

    ``forward(input_)``: ``(s, b, input_size[/tp])`` -> ``(output, output_bias)`` with ``output``
    ``(s, b, output_size)`` (``(s / tp, b, output_size)`` under sequence parallelism).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = False,
                 init_method: Callable[[Tensor], object] = init.xavier_normal_, stride: int = 1,
                 keep_master_weight_for_test: bool = False, skip_bias_add: bool = False, *,
                 params_dtype: torch.dtype = torch.float32, use_cpu_initialization: bool = False,
                 gradient_accumulation_fusion: bool = False, accumulation_in_fp16: bool | None = None,
                 sequence_parallel_enabled: bool = False) -> None:
        super().__init__()
        _check_positive("input_size", input_size)
        _check_positive("output_size", output_size)
        _warn_accumulation_in_fp16(accumulation_in_fp16)
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        self.input_size_per_partition = divide(input_size, world_size)
        self.skip_bias_add = skip_bias_add
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.sequence_parallel_enabled = sequence_parallel_enabled
        if sequence_parallel_enabled and not input_is_parallel:
            raise TensorParallelConfigError("To enable `sequence_parallel_enabled`, `input_is_parallel` must be `True`")

        device = None if use_cpu_initialization else _default_device()
        self.weight = Parameter(torch.empty(output_size, self.input_size_per_partition, dtype=params_dtype,
                                            device=device))
        if use_cpu_initialization:
            self.master_weight = _initialize_affine_weight_cpu(
                self.weight, output_size, input_size, self.input_size_per_partition, 1, init_method,
                stride=stride, return_master_weight=keep_master_weight_for_test, params_dtype=params_dtype)
        else:
            _initialize_affine_weight_gpu(self.weight, init_method, partition_dim=1, stride=stride)
        if bias:
            self.bias = Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
            self.bias.sequence_parallel_enabled = sequence_parallel_enabled
        else:
            self.register_parameter("bias", None)
        self._scatter_input = not input_is_parallel and world_size > 1
        self._reduce_scatter = sequence_parallel_enabled and world_size > 1
        self._reduce = not sequence_parallel_enabled and world_size > 1
        self._forward_impl = linear_with_grad_accumulation_and_async_allreduce

    def forward(self, input_: Tensor) -> tuple[Tensor, Tensor | None]:
        input_parallel = scatter_to_tensor_model_parallel_region(input_) if self._scatter_input else input_
        output = self._forward_impl(input_parallel, self.weight, None, self.gradient_accumulation_fusion, False, False)
        if self._reduce_scatter:
            output = reduce_scatter_to_sequence_parallel_region(output)
        elif self._reduce:
            output = reduce_from_tensor_model_parallel_region(output)
        if self.skip_bias_add:
            return output, self.bias
        if self.bias is not None:
            output = output + self.bias
        return output, None
