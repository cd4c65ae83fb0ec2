"""Gradient accumulation over microbatches on one stage (Apex's ``forward_backward_no_pipelining``)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from culmen.transformer.pipeline_parallel.schedules.common import (
    Batch,
    FwdStepFunc,
    PipelineConfigError,
    backward_step,
    forward_step,
)
from culmen.transformer.pipeline_parallel.utils import (
    get_kth_microbatch,
    get_model_type,
    get_num_microbatches,
    listify_model,
)

__all__ = ["forward_backward_no_pipelining"]


def forward_backward_no_pipelining(
    forward_step_func: FwdStepFunc,
    batch: Batch,
    model: torch.nn.Module | list[torch.nn.Module],
    *,
    forward_only: bool,
    dtype: torch.dtype | None = None,
    grad_scaler: Any | None = None,
    disable_autocast: bool = False,
    custom_sync_context_handler: Any | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run forward (and backward) over ``get_num_microbatches()`` microbatches without pipelining.

    The gradients accumulate in ``.grad`` (each microbatch back-propagates ``loss / num_microbatches``).
    All microbatches but the last run inside ``custom_sync_context_handler()`` (default: the DDP
    model's ``no_sync``), so a data-parallel gradient reduction happens once, on the last backward.

    Args:
        forward_step_func: ``(batch, model) -> (output, loss_func)``; see ``schedules.common``.
        batch: the local minibatch, a list of tensors whose dim 0 is split into microbatches
            (``get_kth_microbatch``).
        model: one module (or a one-element list).
        forward_only: skip the backward passes.
        dtype: autocast dtype (``torch.half`` / ``torch.bfloat16`` enable autocast).
        grad_scaler: scales the loss before backward.
        disable_autocast: never enter autocast.
        custom_sync_context_handler: factory of the context that suppresses gradient reduction.
        **kwargs: other schedules' arguments (``tensor_shape`` ...), ignored.

    Returns:
        The list of ``loss_func``'s second outputs, one per microbatch.
    """
    chunks = listify_model(model)
    if len(chunks) != 1:
        raise PipelineConfigError(f"`model` is expected be a `nn.Module`, but got a list of {len(chunks)} modules")
    model = chunks[0]
    model_type = get_model_type(model)

    if custom_sync_context_handler is not None:
        context_handler = custom_sync_context_handler
    elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
        context_handler = model.no_sync
    else:
        context_handler = contextlib.nullcontext

    losses_reduced: list[Any] = []
    num_micro_batches = get_num_microbatches()

    def step(k: int) -> None:
        output_tensor = forward_step(forward_step_func, get_kth_microbatch(batch, k), model, None,
                                     losses_reduced, dtype=dtype, disable_autocast=disable_autocast)
        if not forward_only:
            backward_step(None, output_tensor, None, model_type=model_type, grad_scaler=grad_scaler)

    with context_handler():
        for k in range(num_micro_batches - 1):
            step(k)
    # The last microbatch outside the context: its backward reduces the gradients.
    step(num_micro_batches - 1)
    return losses_reduced
