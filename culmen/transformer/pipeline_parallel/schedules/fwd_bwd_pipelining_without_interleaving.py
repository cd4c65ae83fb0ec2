"""The non-interleaved 1F1B pipeline schedule (Apex's ``forward_backward_pipelining_without_interleaving``).

Stage ``r`` of ``p`` runs ``min(p - r - 1, m)`` warm-up forwards, then alternates one forward and one
backward until every forward is done, then runs the remaining backwards (cool-down). At most
``p - r`` microbatches' activations are alive on a stage at any time, whatever ``m``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from culmen.transformer import parallel_state
from culmen.transformer.enums import ModelType
from culmen.transformer.log_util import get_transformer_logger
from culmen.transformer.pipeline_parallel import p2p_communication
from culmen.transformer.pipeline_parallel.schedules.common import (
    Batch,
    FwdStepFunc,
    PipelineConfigError,
    _GradSyncToggle,
    backward_step,
    forward_step,
    free_output_tensor,
)
from culmen.transformer.pipeline_parallel.utils import (
    get_kth_microbatch,
    get_model_type,
    get_num_microbatches,
    listify_model,
)

__all__ = ["forward_backward_pipelining_without_interleaving"]

_logger = get_transformer_logger(__name__)

ShapeList = list[Sequence[int] | None]


def get_tensor_shapes(
    rank: int,
    model_type: ModelType,
    *,
    tensor_shape: list[int] | torch.Size,
    decoder_sequence_length: int | None = None,
    sequence_parallel_enabled: bool = False,
) -> list[tuple[int, int, int]]:
    """Shapes of the tensors pipeline rank ``rank`` sends downstream.

    Args:
        rank: pipeline rank.
        model_type: encoder-decoder decoder stages send two tensors (decoder state, then encoder state).
        tensor_shape: ``(sequence_length, micro_batch_size, hidden_size)``.
        decoder_sequence_length: the decoder's sequence length (encoder-decoder models).
        sequence_parallel_enabled: the sequence dimension is split over the tensor-parallel ranks.
    """
    if tensor_shape is None or len(tensor_shape) != 3:
        raise ValueError(
            f"`tensor_shape` should be [sequence_length, micro_batch_size, hidden_size] but got {tensor_shape}")
    seq_length, micro_batch_size, hidden_size = (int(s) for s in tensor_shape)
    tp = parallel_state.get_tensor_model_parallel_world_size() if sequence_parallel_enabled else 1
    if sequence_parallel_enabled:
        seq_length //= tp
    if model_type == ModelType.encoder_and_decoder:
        if decoder_sequence_length is None:
            raise ValueError("decoder_sequence_length is required for encoder-and-decoder models")
        dec_seq_length = decoder_sequence_length // tp
        if parallel_state.is_pipeline_stage_before_split(rank):
            return [(seq_length, micro_batch_size, hidden_size)]
        return [(dec_seq_length, micro_batch_size, hidden_size), (seq_length, micro_batch_size, hidden_size)]
    return [(seq_length, micro_batch_size, hidden_size)]


def _as_list(x: Any) -> list:
    return x if isinstance(x, list) else [x]


def recv_forward(tensor_shapes: ShapeList, *, dtype: torch.dtype | None = None, async_comm: bool = False,
                 sequence_parallel_enabled: bool = False, sync_batch_comm: bool = True) -> list[Any]:
    """``p2p_communication.recv_forward`` for each shape (``None`` for a ``None`` shape)."""
    return [None if shape is None else p2p_communication.recv_forward(
        tensor_shape=shape, dtype=dtype, async_comm=async_comm,
        sequence_parallel_enabled=sequence_parallel_enabled, sync_batch_comm=sync_batch_comm)
        for shape in tensor_shapes]


def recv_backward(tensor_shapes: ShapeList, *, dtype: torch.dtype | None = None, async_comm: bool = False,
                  sequence_parallel_enabled: bool = False, sync_batch_comm: bool = True) -> list[Any]:
    """``p2p_communication.recv_backward`` for each shape (``None`` for a ``None`` shape)."""
    return [None if shape is None else p2p_communication.recv_backward(
        tensor_shape=shape, dtype=dtype, async_comm=async_comm,
        sequence_parallel_enabled=sequence_parallel_enabled, sync_batch_comm=sync_batch_comm)
        for shape in tensor_shapes]


def send_forward(output_tensors: Any, tensor_shapes: ShapeList, *, dtype: torch.dtype | None = None,
                 async_comm: bool = False, sequence_parallel_enabled: bool = False,
                 sync_batch_comm: bool = True) -> None:
    """``p2p_communication.send_forward`` for each (tensor, shape) pair with a shape."""
    for tensor, shape in zip(_as_list(output_tensors), tensor_shapes):
        if shape is not None:
            p2p_communication.send_forward(
                tensor, tensor_shape=shape, dtype=dtype, async_comm=async_comm,
                sequence_parallel_enabled=sequence_parallel_enabled, sync_batch_comm=sync_batch_comm)


def send_backward(input_tensor_grads: Any, tensor_shapes: ShapeList, *, dtype: torch.dtype | None = None,
                  async_comm: bool = False, sequence_parallel_enabled: bool = False,
                  sync_batch_comm: bool = True) -> None:
    """``p2p_communication.send_backward`` for each (gradient, shape) pair with a shape."""
    for grad, shape in zip(_as_list(input_tensor_grads), tensor_shapes):
        if shape is not None:
            p2p_communication.send_backward(
                grad, tensor_shape=shape, dtype=dtype, async_comm=async_comm,
                sequence_parallel_enabled=sequence_parallel_enabled, sync_batch_comm=sync_batch_comm)


def send_forward_recv_backward(output_tensors: Any, tensor_shapes: ShapeList, *,
                               dtype: torch.dtype | None = None, async_comm: bool = False,
                               sequence_parallel_enabled: bool = False, sync_batch_comm: bool = True) -> list[Any]:
    """``p2p_communication.send_forward_recv_backward`` for each (tensor, shape) pair."""
    return [None if shape is None else p2p_communication.send_forward_recv_backward(
        tensor, tensor_shape=shape, dtype=dtype, async_comm=async_comm,
        sequence_parallel_enabled=sequence_parallel_enabled, sync_batch_comm=sync_batch_comm)
        for tensor, shape in zip(_as_list(output_tensors), tensor_shapes)]


def send_backward_recv_forward(input_tensor_grads: Any, tensor_shapes: ShapeList, *,
                               dtype: torch.dtype | None = None, async_comm: bool = False,
                               sequence_parallel_enabled: bool = False, sync_batch_comm: bool = True) -> list[Any]:
    """``p2p_communication.send_backward_recv_forward`` for each (gradient, shape) pair."""
    return [None if shape is None else p2p_communication.send_backward_recv_forward(
        grad, tensor_shape=shape, dtype=dtype, async_comm=async_comm,
        sequence_parallel_enabled=sequence_parallel_enabled, sync_batch_comm=sync_batch_comm)
        for grad, shape in zip(_as_list(input_tensor_grads), tensor_shapes)]


def forward_backward_pipelining_without_interleaving(
    forward_step_func: FwdStepFunc,
    batch: Batch | None,
    model: torch.nn.Module | list[torch.nn.Module],
    *,
    forward_only: bool,
    tensor_shape: list[int] | torch.Size | None = None,
    decoder_sequence_length: int | None = None,
    dtype: torch.dtype | None = None,
    grad_scaler: Any | None = None,
    disable_autocast: bool = False,
    deallocate_pipeline_outputs: bool = False,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    custom_sync_context_handler: Any | None = None,
    custom_grad_sync_func: Any | None = None,
    sync_batch_comm: bool = True,
    num_micro_batches_with_partial_activation_checkpoints: int | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run the 1F1B schedule (warm-up, steady 1F1B, cool-down) on this pipeline stage.

    Args:
        forward_step_func: ``(batch, model) -> (output, loss_func)``; see ``schedules.common``.
        batch: the local minibatch (a list of tensors split along dim 0 into microbatches); stages
            that use none of it may pass ``None``.
        model: this stage's module (or a one-element list).
        forward_only: forwards only (evaluation): no activations are kept.
        tensor_shape: ``(sequence_length, micro_batch_size, hidden_size)`` of the activations
            exchanged between stages.
        decoder_sequence_length: for encoder-decoder models.
        dtype: dtype of the exchanged tensors (float32 when ``None``) and the autocast dtype.
        grad_scaler: scales the loss before backward.
        disable_autocast: never enter autocast.
        deallocate_pipeline_outputs: release each sent output's memory (experimental, warns).
        async_comm: receive asynchronously (``FutureTensor``).
        sequence_parallel_enabled: activations are split along the sequence over the TP ranks.
        custom_sync_context_handler: factory of a context that suppresses asynchronous gradient
            reduction; entered for the whole schedule except stage 0's last backward.
        custom_grad_sync_func: called (no arguments) at the end on every stage but the first, to
            launch the gradient reduction. Without either hook, a DDP-wrapped ``model`` runs under
            ``no_sync`` and its gradients are all-reduced (averaged) over its group at the end, so
            they are right for any number of data-parallel ranks (Apex's were not).
        sync_batch_comm: synchronize the device after each exchange (CUDA).
        num_micro_batches_with_partial_activation_checkpoints: when set, ``forward_step_func`` gets
            a third argument: whether this microbatch checkpoints all layers.
        **kwargs: ignored (other schedules' arguments).

    Returns:
        On the last stage, ``loss_func``'s second outputs, one per microbatch; elsewhere ``[]``.
    """
    if deallocate_pipeline_outputs:
        warnings.warn("`deallocate_pipeline_outputs` is experimental and subject to change. "
                      "This option is not recommended.", stacklevel=2)
    chunks = listify_model(model)
    if len(chunks) != 1:
        raise PipelineConfigError(f"`model` is expected be a `nn.Module`, but got a list of {len(chunks)} modules")
    model = chunks[0]

    grad_sync = _GradSyncToggle(chunks, custom_sync_context_handler, custom_grad_sync_func)
    disable_grad_sync, enable_grad_sync = grad_sync.disable, grad_sync.enable

    num_microbatches = get_num_microbatches()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    num_warmup = min(parallel_state.get_pipeline_model_parallel_world_size() - rank - 1, num_microbatches)
    num_remaining = num_microbatches - num_warmup

    # Partial activation checkpointing (https://arxiv.org/abs/2205.05198, appendix C): within a window
    # of the maximum outstanding backprops, the first microbatches checkpoint only part of the layers.
    window = num_warmup + 1 if num_micro_batches_with_partial_activation_checkpoints is not None else None

    def checkpoint_flag(k: int) -> bool | None:
        if window is None:
            return None
        return k % window >= num_micro_batches_with_partial_activation_checkpoints

    model_type = get_model_type(model)
    recv_shapes = get_tensor_shapes(rank - 1, model_type, tensor_shape=tensor_shape,
                                    decoder_sequence_length=decoder_sequence_length,
                                    sequence_parallel_enabled=sequence_parallel_enabled)
    send_shapes = get_tensor_shapes(rank, model_type, tensor_shape=tensor_shape,
                                    decoder_sequence_length=decoder_sequence_length,
                                    sequence_parallel_enabled=sequence_parallel_enabled)
    comm = dict(dtype=dtype, async_comm=async_comm, sequence_parallel_enabled=sequence_parallel_enabled,
                sync_batch_comm=sync_batch_comm)
    _logger.info("num_microbatches: %d, num_warmup_microbatches: %d, num_microbatches_remaining: %d",
                 num_microbatches, num_warmup, num_remaining)

    input_tensors: list[Any] = []
    output_tensors: list[Any] = []
    losses_reduced: list[Any] = []

    def run_forward(k: int, input_tensor: Any) -> Any:
        return forward_step(forward_step_func, get_kth_microbatch(batch, k), model, input_tensor, losses_reduced,
                            dtype, disable_autocast, checkpoint_flag(k))

    def run_backward(output_tensor_grad: Any) -> Any:
        # FIFO: the oldest outstanding microbatch is the one whose gradient arrives.
        return backward_step(input_tensors.pop(0), output_tensors.pop(0), output_tensor_grad,
                             model_type=model_type, grad_scaler=grad_scaler,
                             deallocate_pipeline_outputs=deallocate_pipeline_outputs)

    disable_grad_sync()

    # Warm-up: forwards only.
    for k in range(num_warmup):
        input_tensor = recv_forward(recv_shapes, **comm)
        output_tensor = run_forward(k, input_tensor)
        send_forward(output_tensor, send_shapes, **comm)
        if not forward_only:
            input_tensors.append(input_tensor)
            output_tensors.append(output_tensor)
            free_output_tensor(output_tensor, deallocate_pipeline_outputs)

    # Steady state: one forward, one backward.
    input_tensor: Any = recv_forward(recv_shapes, **comm) if num_remaining > 0 else None
    for i in range(num_remaining):
        last = i == num_remaining - 1
        output_tensor = run_forward(i + num_warmup, input_tensor)
        if forward_only:
            send_forward(output_tensor, send_shapes, **comm)
            if not last:
                input_tensor = recv_forward(recv_shapes, **comm)
            continue
        output_tensor_grad = send_forward_recv_backward(output_tensor, send_shapes, **comm)
        input_tensors.append(input_tensor)
        output_tensors.append(output_tensor)
        free_output_tensor(output_tensor, deallocate_pipeline_outputs)
        input_tensor_grad = run_backward(output_tensor_grad)
        if last:
            input_tensor = None
            send_backward(input_tensor_grad, recv_shapes, **comm)
        else:
            input_tensor = send_backward_recv_forward(input_tensor_grad, recv_shapes, **comm)

    # Cool-down: the backwards of the warm-up microbatches.
    if not forward_only:
        for i in range(num_warmup):
            if i == num_warmup - 1 and rank == 0:
                # The first stage lets its gradient reduction overlap its last backward.
                enable_grad_sync()
            output_tensor_grad = recv_backward(send_shapes, **comm)
            input_tensor_grad = run_backward(output_tensor_grad)
            send_backward(input_tensor_grad, recv_shapes, **comm)

    # Every other stage reduces its gradients now, in the pipeline bubble.
    enable_grad_sync()
    if rank != 0 and custom_grad_sync_func is not None:
        custom_grad_sync_func()
    grad_sync.finish(forward_only)
    return losses_reduced

