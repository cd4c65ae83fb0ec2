"""The interleaved 1F1B schedule (Apex's ``_forward_backward_pipelining_with_interleaving``).

Each of the ``p`` stages holds ``v`` model chunks; chunk ``c`` of stage ``r`` is virtual stage
``c * p + r``. Microbatches go through the chunks in groups of ``p``: forward step ``k`` of a stage runs
chunk ``(k mod p*v) // p`` on microbatch ``curr_iters[chunk]``; backward steps visit the chunks in
reverse. Warm-up is ``2 (p - r - 1) + (v - 1) p`` forwards (all of them when ``m == p`` or forward-only),
then 1F1B, then the remaining backwards. The number of microbatches ``m`` must be a multiple of ``p``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from culmen.transformer import parallel_state
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
from culmen.transformer.pipeline_parallel.utils import get_kth_microbatch, get_model_type, get_num_microbatches

__all__ = ["_forward_backward_pipelining_with_interleaving"]

_logger = get_transformer_logger(__name__)


def _wait(handles: Sequence[Any] | None) -> None:
    if handles:
        for h in handles:
            h.wait()


def _forward_backward_pipelining_with_interleaving(
    forward_step_func: FwdStepFunc,
    batch: Batch | None,
    model: list[torch.nn.Module],
    *,
    forward_only: bool,
    tensor_shape: list[int] | torch.Size | None = None,
    dtype: torch.dtype | None = None,
    grad_scaler: Any | None = None,
    disable_autocast: bool = False,
    deallocate_pipeline_outputs: bool = False,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    custom_sync_context_handler: Callable | None = None,
    custom_grad_sync_func: Callable | None = None,
    custom_param_sync_func: Callable | None = None,
    sync_batch_comm: bool = True,
    num_micro_batches_with_partial_activation_checkpoints: int | None = None,
    overlap_p2p_comm: bool = False,
    batch_p2p_comm: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run the interleaved 1F1B schedule over this stage's model chunks.

    Args:
        forward_step_func: ``(batch, model) -> (output, loss_func)``; see ``schedules.common``.
        batch: the local minibatch (list of tensors split along dim 0); every chunk reads the same one.
        model: this stage's chunks, a list of ``virtual_pipeline_model_parallel_size`` modules
            (``build_model(..., virtual_pipeline_model_parallel_size=v)``).
        forward_only: forwards only.
        tensor_shape: ``(sequence_length, micro_batch_size, hidden_size)`` of the exchanged activations.
        dtype: dtype of the exchanged tensors (float32 when ``None``) and the autocast dtype.
        grad_scaler: scales the loss before backward.
        disable_autocast: never enter autocast.
        deallocate_pipeline_outputs: release each sent output's memory (experimental, warns).
        async_comm: receive asynchronously (``FutureTensor``).
        sequence_parallel_enabled: the sequence dimension of ``tensor_shape`` is divided by the
            tensor-parallel size.
        custom_sync_context_handler: factory of a context that suppresses asynchronous gradient
            reduction; left only for each chunk's last backward (or for ``custom_grad_sync_func``).
        custom_grad_sync_func: called with a chunk's ``parameters()`` once its last backward is
            done on every stage (launches its gradient reduction); chunks not reached during the
            schedule are synchronized at its end. Without either hook, DDP-wrapped chunks run under
            ``no_sync`` and their gradients are all-reduced (averaged) over their group at the end.
        custom_param_sync_func: called with a chunk's ``parameters()`` before its first forward
            (chunks 0 and 1 at the start, the later ones just ahead of their first microbatch).
        sync_batch_comm: synchronize the device after each exchange (CUDA).
        num_micro_batches_with_partial_activation_checkpoints: when set, ``forward_step_func``
            gets a third argument (whether the microbatch checkpoints all layers).
        overlap_p2p_comm: post the sends/receives and wait for them only before their data is
            needed, overlapping communication with the next forward or backward.
        batch_p2p_comm: post the operations through ``batch_isend_irecv``.
        **kwargs: ignored (other schedules' arguments).

    Returns:
        On the last stage, ``loss_func``'s second outputs, one per microbatch; elsewhere ``[]``.

    Raises:
        PipelineConfigError (``ValueError`` / ``RuntimeError``): ``model`` is not a list, its length is
        not the virtual pipeline size of ``parallel_state``, or the number of microbatches is not a
        multiple of the pipeline size.
    """
    if not isinstance(model, list):
        raise PipelineConfigError("`model` must be a list of `nn.Module`'s'")
    num_model_chunks = len(model)
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp != num_model_chunks:
        raise PipelineConfigError(
            f"the interleaved schedule got {num_model_chunks} model chunks but the virtual pipeline size of "
            f"parallel_state is {vpp}: pass virtual_pipeline_model_parallel_size_={num_model_chunks} to "
            "initialize_model_parallel")
    if deallocate_pipeline_outputs:
        warnings.warn("`deallocate_pipeline_outputs` is experimental and subject to change. "
                      "This option is not recommended.", stacklevel=2)
    if tensor_shape is not None and sequence_parallel_enabled:
        seq_length, micro_batch, hidden = tensor_shape
        tensor_shape = (seq_length // parallel_state.get_tensor_model_parallel_world_size(), micro_batch, hidden)

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    num_microbatches = get_num_microbatches()
    if num_microbatches % pp != 0:
        raise PipelineConfigError(
            f"number of microbatches ({num_microbatches}) is not divisible by pipeline-parallel size ({pp}) "
            "when using interleaved schedule")
    total = num_microbatches * num_model_chunks
    group_size = pp * num_model_chunks

    all_warmup = False
    if forward_only:
        num_warmup = total
    elif num_microbatches == pp:
        # Every forward fits before the first backward arrives.
        num_warmup = total
        all_warmup = True
    else:
        num_warmup = min((pp - rank - 1) * 2 + (num_model_chunks - 1) * pp, total)
    num_remaining = total - num_warmup
    _logger.info("num_microbatches: %d, num_warmup_microbatches: %d, num_microbatches_remaining: %d",
                 total, num_warmup, num_remaining)

    window = num_warmup + 1 if num_micro_batches_with_partial_activation_checkpoints is not None else None

    def checkpoint_flag(k: int) -> bool | None:
        if window is None:
            return None
        return k % window >= num_micro_batches_with_partial_activation_checkpoints

    def chunk_id(k: int, forward: bool) -> int:
        c = (k % group_size) // pp
        return c if forward else num_model_chunks - c - 1

    def is_first_microbatch_for_chunk(k: int) -> bool:
        return k // group_size == 0 and (k % group_size) % pp == 0

    def is_last_microbatch_for_chunk(k: int) -> bool:
        return k // group_size == total // group_size - 1 and (k % group_size) % pp == pp - 1

    grad_sync = _GradSyncToggle(model, custom_sync_context_handler, custom_grad_sync_func)
    disable_grad_sync, enable_grad_sync = grad_sync.disable, grad_sync.enable

    input_tensors: list[list[Any]] = [[] for _ in range(num_model_chunks)]
    output_tensors: list[list[Any]] = [[] for _ in range(num_model_chunks)]
    output_tensor_grads: list[list[Any]] = [[] for _ in range(num_model_chunks)]
    curr_iters = [0] * num_model_chunks
    losses_reduced: list[Any] = []
    grad_synced: set[int] = set()
    comm = dict(tensor_shape=tensor_shape, dtype=dtype, async_comm=async_comm,
                sequence_parallel_enabled=sequence_parallel_enabled, sync_batch_comm=sync_batch_comm,
                batch_p2p_comm=batch_p2p_comm)

    def forward_step_helper(k: int) -> Any:
        c = chunk_id(k, forward=True)
        parallel_state.set_virtual_pipeline_model_parallel_rank(c)
        if custom_param_sync_func is not None:
            # Launch the next chunk's parameter sync `rank` steps ahead of its first microbatch.
            sync_k = k + rank
            if sync_k < total and is_first_microbatch_for_chunk(sync_k):
                sync_c = chunk_id(sync_k, forward=True) + 1
                if 1 < sync_c < num_model_chunks:
                    custom_param_sync_func(model[sync_c].parameters())
        if parallel_state.is_pipeline_first_stage() and len(input_tensors[c]) == len(output_tensors[c]):
            input_tensors[c].append(None)
        output_tensor = forward_step(forward_step_func, get_kth_microbatch(batch, curr_iters[c]), model[c],
                                     input_tensors[c][-1], losses_reduced, dtype, disable_autocast,
                                     checkpoint_flag(k))
        curr_iters[c] += 1
        output_tensors[c].append(output_tensor)
        if forward_only:
            input_tensors[c].pop()
            output_tensors[c].pop()
        return output_tensor

    def backward_step_helper(k: int) -> Any:
        c = chunk_id(k, forward=False)
        parallel_state.set_virtual_pipeline_model_parallel_rank(c)
        if custom_grad_sync_func is None and is_last_microbatch_for_chunk(k):
            # The chunk's last backward runs with the (DDP) gradient reduction enabled.
            enable_grad_sync()
        if parallel_state.is_pipeline_last_stage() and not output_tensor_grads[c]:
            output_tensor_grads[c].append(None)
        input_tensor_grad = backward_step(
            input_tensors[c].pop(0), output_tensors[c].pop(0), output_tensor_grads[c].pop(0),
            model_type=get_model_type(model[c]), grad_scaler=grad_scaler,
            deallocate_pipeline_outputs=deallocate_pipeline_outputs)
        if custom_grad_sync_func is not None:
            # A chunk's gradients are final on every stage `rank` backward steps after its last one here.
            sync_k = k - rank
            if sync_k >= 0 and is_last_microbatch_for_chunk(sync_k):
                sync_c = chunk_id(sync_k, forward=False)
                enable_grad_sync()
                custom_grad_sync_func(model[sync_c].parameters())
                grad_synced.add(sync_c)
        disable_grad_sync()
        return input_tensor_grad

    def next_forward_chunk(fk: int) -> tuple[bool, int]:
        """(receive an activation?, the chunk it is for) after forward step ``fk`` in the steady state."""
        if parallel_state.is_pipeline_first_stage(ignore_virtual=True):
            # The first stage is pp - 1 forward steps ahead of the last stage that feeds it.
            c = chunk_id(fk - (pp - 1), forward=True)
            return c != num_model_chunks - 1, c + 1
        return True, chunk_id(fk + 1, forward=True)

    def next_backward_chunk(bk: int) -> tuple[bool, int]:
        """(receive a gradient?, the chunk it is for) after backward step ``bk`` in the steady state."""
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            c = chunk_id(bk - (pp - 1), forward=False)
            return c != 0, c - 1
        return True, chunk_id(bk + 1, forward=False)

    disable_grad_sync()
    if custom_param_sync_func is not None:
        for c in range(min(2, num_model_chunks)):
            custom_param_sync_func(model[c].parameters())

    # Warm-up forwards.
    fwd_handles: list | None = None
    bwd_handles: list | None = None
    parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    input_tensors[0].append(p2p_communication.recv_forward(
        tensor_shape=tensor_shape, dtype=dtype, async_comm=async_comm,
        sequence_parallel_enabled=sequence_parallel_enabled, sync_batch_comm=sync_batch_comm,
        batch_p2p_comm=batch_p2p_comm))
    for k in range(num_warmup):
        _wait(fwd_handles)
        fwd_handles = None
        output_tensor = forward_step_helper(k)

        next_c = chunk_id(k + 1, forward=True)
        recv_prev = not (parallel_state.is_pipeline_first_stage(ignore_virtual=True) and next_c == 0)
        if k == total - 1:
            recv_prev = False
        if parallel_state.is_pipeline_last_stage():
            output_tensor = None  # the loss stays here
        start_backward = k == num_warmup - 1 and not forward_only and not all_warmup
        recv_next = not parallel_state.is_pipeline_last_stage(ignore_virtual=True)

        if overlap_p2p_comm:
            input_tensor, fwd_handles = p2p_communication.send_forward_recv_forward(
                output_tensor, recv_prev=recv_prev, overlap_p2p_comm=True, **comm)
            if start_backward:
                output_tensor_grad, bwd_handles = p2p_communication.send_backward_recv_backward(
                    None, recv_next=recv_next, overlap_p2p_comm=True, **comm)
                output_tensor_grads[num_model_chunks - 1].append(output_tensor_grad)
        elif start_backward:
            input_tensor, output_tensor_grad = p2p_communication.send_forward_backward_recv_forward_backward(
                output_tensor, None, recv_prev=recv_prev, recv_next=recv_next, **comm)
            output_tensor_grads[num_model_chunks - 1].append(output_tensor_grad)
        else:
            input_tensor = p2p_communication.send_forward_recv_forward(output_tensor, recv_prev=recv_prev, **comm)
        input_tensors[next_c].append(input_tensor)
        free_output_tensor(output_tensor, deallocate_pipeline_outputs)

    # Steady state: one forward, one backward.
    for k in range(num_remaining):
        fk = k + num_warmup
        bk = k
        last = k == num_remaining - 1
        if overlap_p2p_comm:
            _wait(fwd_handles)
            output_tensor = forward_step_helper(fk)
            parallel_state.set_virtual_pipeline_model_parallel_rank(chunk_id(fk, forward=True))
            if parallel_state.is_pipeline_last_stage():
                output_tensor = None
            recv_prev, next_fc = next_forward_chunk(fk)
            if last:
                recv_prev = False  # the extra activation was received before the loop
            input_tensor, fwd_handles = p2p_communication.send_forward_recv_forward(
                output_tensor, recv_prev=recv_prev, overlap_p2p_comm=True, **comm)
            free_output_tensor(output_tensor, deallocate_pipeline_outputs)

            _wait(bwd_handles)
            input_tensor_grad = backward_step_helper(bk)
            parallel_state.set_virtual_pipeline_model_parallel_rank(chunk_id(bk, forward=False))
            if parallel_state.is_pipeline_first_stage():
                input_tensor_grad = None
            recv_next, next_bc = next_backward_chunk(bk)
            output_tensor_grad, bwd_handles = p2p_communication.send_backward_recv_backward(
                input_tensor_grad, recv_next=recv_next, overlap_p2p_comm=True, **comm)
        else:
            output_tensor = forward_step_helper(fk)
            input_tensor_grad = backward_step_helper(bk)
            parallel_state.set_virtual_pipeline_model_parallel_rank(chunk_id(fk, forward=True))
            if parallel_state.is_pipeline_last_stage():
                output_tensor = None
            parallel_state.set_virtual_pipeline_model_parallel_rank(chunk_id(bk, forward=False))
            if parallel_state.is_pipeline_first_stage():
                input_tensor_grad = None
            recv_prev, next_fc = next_forward_chunk(fk)
            recv_next, next_bc = next_backward_chunk(bk)
            if last:
                recv_prev = False
            input_tensor, output_tensor_grad = p2p_communication.send_forward_backward_recv_forward_backward(
                output_tensor, input_tensor_grad, recv_prev=recv_prev, recv_next=recv_next, **comm)
            free_output_tensor(output_tensor, deallocate_pipeline_outputs)
        if recv_prev:
            input_tensors[next_fc].append(input_tensor)
        if recv_next:
            output_tensor_grads[next_bc].append(output_tensor_grad)

    # Cool-down backwards.
    if not forward_only:
        _wait(bwd_handles)
        bwd_handles = None
        if all_warmup:
            output_tensor_grads[num_model_chunks - 1].append(p2p_communication.recv_backward(
                tensor_shape=tensor_shape, dtype=dtype, async_comm=async_comm,
                sequence_parallel_enabled=sequence_parallel_enabled, sync_batch_comm=sync_batch_comm,
                batch_p2p_comm=batch_p2p_comm))
        for k in range(num_remaining, total):
            input_tensor_grad = backward_step_helper(k)
            next_bc = chunk_id(k + 1, forward=False)
            recv_next = not (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
                             and next_bc == num_model_chunks - 1)
            if k == total - 1:
                recv_next = False
            output_tensor_grads[next_bc].append(p2p_communication.send_backward_recv_backward(
                input_tensor_grad, recv_next=recv_next, **comm))
    _wait(fwd_handles)

    enable_grad_sync()
    if custom_grad_sync_func is not None and not forward_only:
        # Chunks whose last backward on the earlier stages fell outside the loop above.
        for c in range(num_model_chunks):
            if c not in grad_synced:
                custom_grad_sync_func(model[c].parameters())
    grad_sync.finish(forward_only)
    return losses_reduced
