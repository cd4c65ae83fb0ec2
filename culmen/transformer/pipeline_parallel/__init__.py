"""Apex's ``apex.transformer.pipeline_parallel``: pipeline schedules, point-to-point communication and
the helpers of pipeline-parallel training, on ``torch.distributed``.

``get_forward_backward_func(virtual_pipeline_model_parallel_size, pipeline_model_parallel_size)`` picks
the schedule; ``build_model`` builds this rank's model chunk(s). Submodules: ``schedules``,
``p2p_communication``, ``utils``.
"""

from culmen.transformer.pipeline_parallel.schedules import get_forward_backward_func
from culmen.transformer.pipeline_parallel.schedules.common import build_model

__all__ = [
    "get_forward_backward_func",
    "build_model",
]
