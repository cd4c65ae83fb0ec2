"""Pipeline schedules and the function that picks one (Apex's ``pipeline_parallel.schedules``)."""

from __future__ import annotations

from collections.abc import Callable

from culmen.transformer import parallel_state
from culmen.transformer.pipeline_parallel.schedules.common import PipelineConfigError
from culmen.transformer.pipeline_parallel.schedules.fwd_bwd_no_pipelining import forward_backward_no_pipelining
from culmen.transformer.pipeline_parallel.schedules.fwd_bwd_pipelining_with_interleaving import (
    _forward_backward_pipelining_with_interleaving,
)
from culmen.transformer.pipeline_parallel.schedules.fwd_bwd_pipelining_without_interleaving import (
    forward_backward_pipelining_without_interleaving,
)
from culmen.transformer.pipeline_parallel.utils import get_num_microbatches

__all__ = ["get_forward_backward_func"]


class ExperimentalWarning(Warning):
    """Warned by experimental pipeline options."""


def get_forward_backward_func(
    virtual_pipeline_model_parallel_size: int | None,
    pipeline_model_parallel_size: int,
) -> Callable:
    """The schedule for the current pipeline: no pipelining (1 stage), 1F1B, or interleaved 1F1B.

    Args:
        virtual_pipeline_model_parallel_size: model chunks per stage, or ``None`` (no interleaving).
        pipeline_model_parallel_size: number of pipeline stages.

    Returns:
        ``forward_backward_no_pipelining`` when ``parallel_state`` has one pipeline stage,
        ``_forward_backward_pipelining_with_interleaving`` with a virtual size, else
        ``forward_backward_pipelining_without_interleaving``.

    Raises:
        PipelineConfigError (a ``ValueError``, and a ``RuntimeError`` as in Apex): interleaving with a
        number of microbatches that ``pipeline_model_parallel_size`` does not divide.
    """
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        if virtual_pipeline_model_parallel_size is not None:
            num_microbatches = get_num_microbatches()
            if num_microbatches % pipeline_model_parallel_size != 0:
                raise PipelineConfigError(
                    f"number of microbatches ({num_microbatches}) is not divisible by pipeline-parallel size "
                    f"({pipeline_model_parallel_size}) when using interleaved schedule")
            return _forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining
